"""``jaxmoe serve`` on two JAX processes (loopback, 4 CPU devices each, meshes/cpu-2x4.yaml: attention and
expert instances on both): process 0 answers HTTP and gRPC with the tokens the single-process monolithic
engine makes, for every model family; SIGTERM to process 0 stops both; a follower killed with SIGKILL
makes process 0 unhealthy (503), ends the request in flight with an error and exits non-zero; a mesh
file that does not match the cluster is refused at start with one line naming the field;
``POST /admin/rescale`` re-scales both processes while requests run, building in the background on
each, the attention side going from both processes to process 0 (KV blocks moved between the
processes by a collective), and a follower that hangs without dying is given up after
``--step-timeout``.
Each cluster test takes 2-4 minutes on 2 busy cores (the step programs compile on first use); the rescale
one 5-9 minutes (7.1 at load 10-15, 9.2 at load 13-16)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MESH = ROOT / "meshes" / "cpu-2x4.yaml"
PROMPTS = ["The mixture of experts", "Hello, world"]
MAX_TOKENS = 6
LONG = 100  # tokens of the requests in flight across a live rescale
ENGINE_FLAGS = ["--num-blocks", "64", "--block-size", "8", "--max-num-seqs", "4"]
ENGINE_FLAGS += ["--max-batch-tokens", "64", "--max-prefill-chunk", "32"]
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=4, max_batch_tokens=64, max_prefill_chunk=32)
# a follower that SIGUSR1 hangs without dying: its main thread (the steps) sleeps, jax's threads (the
# coordination service's heartbeats) go on
HANGS_ON_USR1 = (
    "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: time.sleep(3600)); "
    "from jaxmoe.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log(path: Path, lines: int = 30) -> str:
    noise = ("W0000", "I0000", "[Gloo]")
    text = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith(noise)]
    return "\n".join(text[-lines:])


class Cluster:
    """Two ``jaxmoe serve`` processes joined by ``jax.distributed`` on 127.0.0.1."""

    def __init__(
        self, tmp_path: Path, mesh: Path = MESH, *flags: str, model: str = "tiny-random", hangable: bool = False
    ):
        self.http_port, self.grpc_port, coordinator = _free_port(), _free_port(), _free_port()
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        env["JAXMOE_JOIN_TIMEOUT"] = "120"
        self.logs = [tmp_path / f"serve{i}.log" for i in range(2)]
        self.procs = []
        for i in range(2):
            launch = ["-c", HANGS_ON_USR1] if hangable and i > 0 else ["-m", "jaxmoe.cli"]
            cmd = [sys.executable, *launch, "serve", "--model", model, "--dtype", "float32"]
            cmd += ["--mesh", str(mesh), "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2"]
            cmd += ["--process-id", str(i), "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
            cmd += ["--no-warmup", *ENGINE_FLAGS, *flags]
            with open(self.logs[i], "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                    )
                )

    def wait_serving(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "http listening" in self.logs[0].read_text(errors="replace"):
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        pytest.fail(f"the cluster did not start serving:\n{self.report()}")

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        return [p.poll() for p in self.procs]

    def report(self) -> str:
        return "\n".join(f"--- process {i} (exit {p.poll()}):\n{_log(self.logs[i])}" for i, p in enumerate(self.procs))

    def kill(self) -> None:
        print(self.report())  # shown when the test fails
        for p in self.procs:  # SIGKILL: jax's preemption notifier catches SIGTERM
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)

    def post(self, path: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None  # not answering at all


def _complete(cluster: Cluster, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 300.0):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return cluster.post("/v1/completions", body, timeout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_process_server_answers_like_one_process_and_stops_on_sigterm(tmp_path):
    from jaxmoe import LLM, SamplingParams
    from jaxmoe.server.client import JaxmoeClient

    cluster = Cluster(tmp_path)
    try:
        cluster.wait_serving()
        http = [_complete(cluster, p) for p in PROMPTS]
        with JaxmoeClient(f"127.0.0.1:{cluster.grpc_port}") as client:
            grpc_out = [
                client.complete(p, timeout=300, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                for p in PROMPTS
            ]
        # a rescale that does not fit the devices is refused on both processes, nothing changes
        rescale = cluster.post("/admin/rescale", {"attention": 5, "experts": 6})
        again = _complete(cluster, PROMPTS[0])
        assert cluster.health() == 200
        t0 = time.monotonic()
        cluster.procs[0].send_signal(signal.SIGTERM)
        codes = cluster.wait_exit(30)
        stopped_s = time.monotonic() - t0
        report = cluster.report()
    finally:
        cluster.kill()
    assert codes == [0, 0], report
    assert stopped_s < 30
    assert "following process 0" in report and "process 0 stopped the cluster" in report

    ref = LLM("tiny-random", dtype="float32", **ENGINE)
    want = ref.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for (status, body), g, w in zip(http, grpc_out, want):
        assert status == 200, body
        assert body["choices"][0]["text"] == w.text
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert g["token_ids"] == list(w.token_ids)
    assert rescale[0] == 400 and "do not fit the 8 devices" in rescale[1]["error"]["message"], rescale
    assert again[0] == 200 and again[1]["choices"][0]["text"] == want[0].text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_follower_stops_process_0(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        cluster.wait_serving()
        assert _complete(cluster, PROMPTS[0])[0] == 200  # compiles the prefill and decode programs
        inflight: dict = {}
        t = threading.Thread(target=lambda: inflight.update(r=_complete(cluster, PROMPTS[1], 400, 120)), daemon=True)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(cluster.procs[1].pid, signal.SIGKILL)
        health = None
        while time.monotonic() - t0 < 30:
            health = cluster.health()
            if health != 200:
                break
            time.sleep(0.2)
        unhealthy_s = time.monotonic() - t0
        new = _complete(cluster, PROMPTS[0], timeout=30)
        t.join(60)
        codes = cluster.wait_exit(60 - (time.monotonic() - t0))
        exit_s = time.monotonic() - t0
        report = cluster.report()
    finally:
        cluster.kill()
    assert health != 200 and unhealthy_s < 30, (health, unhealthy_s, report)
    assert new[0] == 503 and "cluster" in new[1]["error"]["message"], new
    status, body = inflight["r"]  # ended with an error, not hanging and not a complete answer
    assert status >= 500 and "error" in body, inflight
    assert codes[0] not in (None, 0) and exit_s < 60, (codes, exit_s, report)


@pytest.mark.slow  # two jax processes start and join: 20-30 s each on 2 busy cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "nodes, per_node, field",
    [
        (4, 2, "nodes: the file describes 4 nodes (one process each) but jax.distributed reports 2 processes"),
        (2, 2, "devices_per_node: the file says 2 but this process has 4 jax devices"),
    ],
)
def test_mesh_that_does_not_match_the_cluster_is_refused(tmp_path, nodes, per_node, field):
    mesh = tmp_path / "bad.yaml"
    mesh.write_text(
        f"platform: cpu\nnodes: {nodes}\ndevices_per_node: {per_node}\n"
        "attention:\n  devices: [0]\nexperts:\n  devices: [1, 2, 3]\n  slots_per_instance: 4\n"
    )
    cluster = Cluster(tmp_path, mesh)
    try:
        codes = cluster.wait_exit(120)
        logs = [_log(path) for path in cluster.logs]
    finally:
        cluster.kill()
    assert codes == [2, 2], cluster.report()
    for log in logs:
        lines = [ln for ln in log.splitlines() if ln.startswith("jaxmoe:")]
        assert len(lines) == 1 and lines[0].startswith(f"jaxmoe: {mesh}: {field}"), log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rescale_over_http_on_two_processes(tmp_path):
    """meshes/cpu-2x4.yaml (attention instances 0 and 1 on processes 0 and 1, experts on both):
    ``POST /admin/rescale`` to 4a4e (attention on devices 0-3 of process 0, experts on 4-7 of
    process 1) while two long requests run reaches both processes: parameters moved between two
    steps (attention parameters and expert replicas by collectives), then the step programs lowered
    one shape before each step on both and compiled (not run) by background threads while the old
    layout serves (steps during the build, each pause one lowering), swapped once both have built, the KV blocks of the live requests
    moved at that step by a collective (the request on attention instance 1 goes from process 1 to
    process 0); the first step on the new layout compiles nothing. The requests in flight, those sent
    during the rescale and the ones after keep the single-process monolithic greedy tokens. Then the
    follower hangs without dying (SIGUSR1: its steps stop, its heartbeats go
    on): process 0 gives up after ``--step-timeout``, fails the request in flight, answers 503 and
    exits 1."""
    from jaxmoe import LLM, SamplingParams

    few_shapes = ["--max-num-seqs", "2", "--max-prefill-chunk", "16", "--max-batch-tokens", "32"]
    step_timeout = 40  # cpu-2x4: a follower compiling attention programs may take 30 s more than process 0 (loaded)
    flags = [*few_shapes, "--step-timeout", str(step_timeout)]
    cluster = Cluster(tmp_path, MESH, *flags, hangable=True)
    try:
        cluster.wait_serving()
        first = _complete(cluster, PROMPTS[0])
        # two long requests at a time, one on each attention instance (least loaded), live at the swap:
        # each client sends the next one when one ends until the rescale is done (the build compiles
        # in the background while the old layout serves more steps than a request's tokens), so
        # their KV moves
        inflight: dict = {0: [], 1: []}
        done = threading.Event()

        def long_requests(i):
            for _ in range(12):  # bounded
                inflight[i].append(_complete(cluster, PROMPTS[i], LONG))
                if done.is_set():
                    return

        threads = [threading.Thread(target=long_requests, args=(i,), daemon=True) for i in (1, 0)]
        for t in threads:
            t.start()
            time.sleep(0.5)
        box: dict = {}

        def rescale():
            box["r"] = cluster.post("/admin/rescale", {"attention": 4, "experts": 4}, timeout=840)
            box["t"] = time.monotonic()
            done.set()

        r = threading.Thread(target=rescale, daemon=True)
        r.start()
        during = []  # (answer, when) of requests sent while the rescale runs
        while r.is_alive() and len(during) < 3:  # served by the old layout during the build, or the new
            during.append((_complete(cluster, PROMPTS[0], timeout=840), time.monotonic()))
        r.join(840)
        for t in threads:
            t.join(600)
        rescaled = box["r"]
        after = _complete(cluster, PROMPTS[0])
        # then the follower hangs without dying (its heartbeats go on): process 0 waits in a step past
        # --step-timeout, fails the request in flight, answers 503 and exits non-zero
        hung: dict = {}
        t = threading.Thread(target=lambda: hung.update(r=_complete(cluster, PROMPTS[1], 100, 120)), daemon=True)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(cluster.procs[1].pid, signal.SIGUSR1)
        health = 200
        while health == 200 and time.monotonic() - t0 < step_timeout + 30:
            time.sleep(0.5)
            health = cluster.health()
        unhealthy_s = time.monotonic() - t0
        refused = _complete(cluster, PROMPTS[0], timeout=30)
        t.join(60)
        codes = cluster.wait_exit(step_timeout + 60 - (time.monotonic() - t0))
        exit_s = time.monotonic() - t0
        report = cluster.report()
    finally:
        cluster.kill()
    assert rescaled[0] == 200, (rescaled, report)
    assert rescaled[1]["attention"] == 4 and rescaled[1]["experts"] == 4, rescaled
    keys = ("paused_s", "build_s", "largest_pause_s", "build_units", "swap_s", "steps_during_build")
    keys += ("kv_blocks_moved", "kv_bytes_moved", "sequences_recomputed", "expert_slots_copied", "first_step_compiles")
    keys += ("swap_compiles",)
    print({k: rescaled[1][k] for k in keys})
    print("unit pauses:", sorted((round(t, 2), u) for u, t in rescaled[1]["unit_pauses_s"])[::-1])
    print("compiled beside:", sorted((round(t, 2), u) for u, t in rescaled[1]["compiled_beside_s"])[::-1])
    steps = sorted(rescaled[1]["step_pauses_s"])
    if steps:  # per step during the build: the slower process's unit
        print("step pauses:", len(steps), "median", steps[len(steps) // 2], "max", steps[-1], steps[::-1])
    print("hang:", health, round(unhealthy_s, 1), codes, round(exit_s, 1))
    assert health == 503 and unhealthy_s < step_timeout + 15, (health, unhealthy_s, report)
    assert refused[0] == 503 and "stopped stepping without dying" in refused[1]["error"]["message"], refused
    assert hung["r"][0] >= 500 and "error" in hung["r"][1], hung
    # the follower stays hung until jax terminates it once process 0 (the coordination service) is gone
    assert codes[0] == 1 and codes[1] != 0 and exit_s < step_timeout + 60, (codes, exit_s, report)
    # compiled ahead (not by running: the first step on it compiles nothing) in background threads
    # while the old layout served, one shape lowered before each step: no pause as long as the build
    assert rescaled[1]["paused_s"] > 0 and rescaled[1]["build_s"] > 0 and rescaled[1]["build_units"] > 1
    assert all(u.startswith("lower ") for u, _ in rescaled[1]["unit_pauses_s"]), rescaled
    assert rescaled[1]["steps_during_build"] > 0, rescaled
    assert rescaled[1]["largest_pause_s"] < rescaled[1]["build_s"], rescaled
    assert rescaled[1]["largest_pause_s"] >= max(rescaled[1]["step_pauses_s"]), rescaled
    # 4a4e: process 0 holds no expert device, so it compiles no expert program (``process_local``)
    compiled = {unit.split(": ")[-1] for unit, _ in rescaled[1]["compiled_beside_s"]}
    assert "jit_layer_step" in compiled and "jit_run" not in compiled, compiled
    assert rescaled[1]["first_step_compiles"] is None or rescaled[1]["first_step_compiles"] <= 2, rescaled
    # the swap compiles nothing: the KV move's programs (fixed rounds) were compiled with the build's
    assert rescaled[1]["swap_compiles"] == 0 and any(
        u.startswith("kv move: ") for u, _ in rescaled[1]["compiled_beside_s"]
    )
    assert during and all(a[0] == 200 for a, _ in during), (during, rescaled)
    # both requests were live at the swap (nothing recomputed): their KV moved, the blocks of the one
    # on attention instance 1 (process 1) to process 0 (the new attention side has no device there)
    assert rescaled[1]["kv_blocks_moved"] >= 2 and rescaled[1]["kv_bytes_moved"] > 0, rescaled
    assert rescaled[1]["sequences_recomputed"] == 0, rescaled
    ref = LLM("tiny-random", dtype="float32", **ENGINE)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want0 = ref.generate(PROMPTS[:1], greedy)[0].text
    want_long = ref.generate(PROMPTS, SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))
    assert first[0] == after[0] == 200 and first[1]["choices"][0]["text"] == after[1]["choices"][0]["text"] == want0
    assert all(a[1]["choices"][0]["text"] == want0 for a, _ in during), during
    for i in (0, 1):
        assert inflight[i], inflight
        for status, body in inflight[i]:
            assert status == 200 and body["choices"][0]["text"] == want_long[i].text, (i, inflight)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_two_process_server_answers_like_one_process_per_family(tmp_path, checkpoint_dir, family):
    """The other model families (tiny Hugging Face checkpoints; ``tiny-random`` above is the Mixtral
    form): greedy text over HTTP from two processes == the single-process monolithic engine's."""
    from jaxmoe import LLM, SamplingParams

    path = checkpoint_dir(family)
    cluster = Cluster(tmp_path, MESH, model=str(path))
    try:
        cluster.wait_serving()
        got = _complete(cluster, PROMPTS[0])
        cluster.procs[0].send_signal(signal.SIGTERM)
        codes = cluster.wait_exit(30)
        report = cluster.report()
    finally:
        cluster.kill()
    assert codes == [0, 0], report
    ref = LLM(str(path), dtype="float32", **ENGINE)
    want = ref.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert got[0] == 200, got
    assert got[1]["choices"][0]["text"] == want.text and got[1]["usage"]["completion_tokens"] == MAX_TOKENS
