"""Beyond one machine: the disaggregated runtime across 2 processes under ``jax.distributed``.

* In-process (8 CPU devices): ``CrossProcessTransfer`` (collectives over one global mesh) moves
  exactly what ``transfer.a2e`` / ``transfer.e2a`` (device_put hops) move, on every layout and
  strategy, with the same hop / byte counters.
* Two subprocesses (``tests/multihost/multiprocess_worker.py``, 4 CPU devices each, gloo, coordinator on
  127.0.0.1, meshes/cpu-8-4a4e.yaml: attention on process 0, experts on process 1): a probe
  records that ``jax.device_put`` cannot cross processes and that the collective transfer can;
  then ``LLM("tiny-random", mesh=...)`` (no wiring: the executor picks the collective transfer) generates
  on both processes: greedy tokens equal to the single-process monolithic ``LLM("tiny-random")``'s,
  sampled tokens (seeded and unseeded) equal on both processes, expert activation counts
  identical on both, and the same greedy tokens after ``set_placement`` moves replicas.
* meshes/cpu-8-1a7e.yaml on two processes (expert instances on both): ``set_placement`` moves
  replicas between the processes (``runtime.slot_moves``) with tokens and logits unchanged, and live
  re-scaling (1a7e -> 4a4e -> 1a7e) under a bounded load re-shards the experts across them.

Each subprocess pair runs under a deadline and is killed (SIGKILL: jax's preemption notifier
catches SIGTERM) on timeout or as soon as one of them fails (the other would wait on it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import astuple
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmoe.mesh import build_meshes, load_mesh
from jaxmoe.runtime import transfer as T
from jaxmoe.runtime.cross_process import CrossProcessTransfer, spans_processes
from jaxmoe.runtime.transfer_rounds import schedule_rounds
from mesh_layouts import LAYOUTS, _inputs

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
MESH = ROOT / "meshes" / "cpu-8-4a4e.yaml"
MESH_1A7E = ROOT / "meshes" / "cpu-8-1a7e.yaml"  # expert instances on both processes
TIMEOUT_S = 240
MAX_TOKENS = 12


# --------------------------------------------------------------------------- in one process


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    spec = load_mesh(LAYOUTS[request.param])
    sub = build_meshes(spec)
    return spec, sub, CrossProcessTransfer(sub)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", T.STRATEGIES)
def test_collective_transfer_matches_device_put_transfer(layout, strategy):
    spec, sub, xp = layout
    x, y, x_attn, y_exp = _inputs(spec, sub)
    plan = T.plan_transfers(spec, x.nbytes // spec.attention.count, strategy)
    before = dict(xp.counts)

    x_exp = xp.a2e(x_attn, plan, sub)
    y_attn = xp.e2a(y_exp, plan, sub)

    assert x_exp.sharding.is_equivalent_to(sub.replicated_sharding, 2)
    assert {s.device for s in x_exp.addressable_shards} == set(sub.experts.devices.flat)
    for shard in x_exp.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x)
    assert y_attn.sharding.is_equivalent_to(sub.batch_sharding, 2)
    np.testing.assert_allclose(np.asarray(y_attn), np.asarray(T.e2a(y_exp, plan, sub)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_attn), y.sum(0), rtol=1e-5, atol=1e-5)
    for direction in ("a2e", "e2a"):  # the hops that ran are the plan's
        ran = [a - b for a, b in zip(astuple(xp.counts[direction]), astuple(before[direction]))]
        assert T.TransferCounts(*ran) == plan.counts(direction), direction
    # one process: to_local is a full single-device copy, nothing crosses
    np.testing.assert_allclose(xp.fetch(y_attn), y.sum(0), rtol=1e-5, atol=1e-5)
    assert len(xp.to_local(y_exp).devices()) == 1
    assert not spans_processes(sub) and xp.counts["fetch"].transfers == 0


def test_rounds_are_permutations_in_plan_order():
    spec = load_mesh(MESH)
    for strategy in T.STRATEGIES:
        plan = T.plan_transfers(spec, 4096, strategy)
        for hops in (plan.a2e, plan.e2a):
            rounds = schedule_rounds(hops)
            assert sorted(map(astuple, (t for r in rounds for t in r.hops))) == sorted(map(astuple, hops))
            for r in rounds:
                srcs, dsts = [t.src for t in r.hops], [t.dst for t in r.hops]
                assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
                assert {len(t.blocks) for t in r.hops} == {r.k}
    # 4A4E two-phase multicast: gather on device 0 (3 rounds), 0 -> 4 (1), multicast from 4 (3)
    plan = T.plan_transfers(spec, 4096, T.MULTICAST)
    assert [len(r.hops) for r in schedule_rounds(plan.a2e)] == [1] * 7
    assert plan.counts("a2e").cross == plan.counts("e2a").cross == 1


# --------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    noise = ("W0000", "I0000", "[Gloo]")
    text = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith(noise)]
    return "\n".join(text[-lines:])


def _run_workers(tmp_path: Path, *args: str, timeout: float = TIMEOUT_S, mesh: Path = MESH) -> list[dict]:
    """Run the worker as processes 0 and 1; return their JSON outputs (fail with their logs)."""
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    procs, logs, outs = [], [], []
    try:
        for i in range(2):
            logs.append(tmp_path / f"worker{i}.log")
            outs.append(tmp_path / f"worker{i}.json")
            with open(logs[i], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(WORKER),
                            "--process-id",
                            str(i),
                            "--num-processes",
                            "2",
                            "--port",
                            str(port),
                            "--mesh",
                            str(mesh),
                            "--out",
                            str(outs[i]),
                            *args,
                        ],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs):
                failed_at = failed_at or now
                if now - failed_at > 5:  # the survivor waits on the dead one: stop it
                    break
            if now > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        report = "\n".join(f"--- process {i} (exit {c}):\n{_tail(logs[i])}" for i, c in enumerate(codes))
        pytest.fail(f"workers failed or timed out after {timeout:.0f} s (exit codes {codes}):\n{report}")
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.slow
def test_device_put_cannot_cross_processes_collectives_can(tmp_path):
    results = _run_workers(tmp_path, "--probe", timeout=120)
    p0, p1 = results
    # jax.device_put from process 0's devices (attention) to process 1's (experts)
    for r in results:
        got = r["device_put_replicated"]
        if got["ok"]:  # a later jax may allow it; then it must deliver the activations
            assert all(np.allclose(shard, r["x_host"]) for shard in got["shards"])
    if jax.__version__.startswith("0.10."):  # the errors quoted in docs/multi_host.md
        assert p0["device_put_replicated"]["error"].startswith(
            "ValueError: device_put's second argument must be a Device or a Sharding which represents "
            "addressable devices"
        )
        assert p1["device_put_replicated"]["error"] == (
            "NotImplementedError: Cannot reshard an input that is not fully addressable"
        )
        for r in results:
            assert "does not support cross-host device transfers" in r["device_put_same_layout"]["error"]
    # the collective transfer works: process 1 (experts) holds the activations, the sum comes back
    assert p0["a2e_local_shards"] == 0 and p1["a2e_local_shards"] == 4
    for r in results:
        assert r["a2e_ok"] and r["e2a_ok"] and r["fetch_ok"]


@pytest.mark.slow
def test_two_processes_generate_the_same_tokens_as_one(tmp_path):
    from jaxmoe import LLM, SamplingParams
    from multiprocess_worker import ENGINE, PROMPTS, SAMPLE_SEED

    results = _run_workers(tmp_path, "--max-tokens", str(MAX_TOKENS))
    ref = LLM("tiny-random", dtype="float32", **ENGINE)
    greedy = ref.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    expected = [list(o.token_ids) for o in greedy]
    (seeded,) = ref.generate(
        PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True, seed=SAMPLE_SEED)
    )

    p0, p1 = results
    assert p0["process_count"] == p1["process_count"] == 2
    assert p0["transfer"] == p1["transfer"] == "CrossProcessTransfer"  # chosen by the executor itself
    assert p0["attention_devices"] == [0] and p0["expert_devices"] == [1]  # attention: process 0, experts: 1
    assert p0["tokens"] == p1["tokens"] == expected
    assert all(len(t) == MAX_TOKENS for t in expected)
    # sampled (temperature > 0): the same tokens on both processes, seeded or not; seeded as in one process
    assert p0["sampled_tokens"] == p1["sampled_tokens"]
    assert p0["sampled_tokens"][0] == list(seeded.token_ids) and p0["sampled_tokens"] != expected
    assert all(len(t) == MAX_TOKENS for t in p0["sampled_tokens"])
    # expert-side counters, read on both processes: identical, top_k per routed token and layer
    counts = p0["expert_activation_counts"]
    assert counts == p1["expert_activation_counts"] and len(counts) == ref.cfg.num_moe_layers
    assert all(sum(c) == p0["routed_tokens"] * ref.cfg.moe.top_k for c in counts)
    assert p0["activated_per_instance"] == p1["activated_per_instance"]
    # set_placement with the expert side inside process 1: replicas moved, same greedy tokens
    assert p0["moved"] == p1["moved"] > 0
    assert p0["relaid_tokens"] == p1["relaid_tokens"] == expected
    # every MoE layer's A2E / E2A crossed from node 0 to node 1 and back, and the counters agree
    stats = p0["transfer_stats"]
    assert stats and all(s["a2e"]["cross"] > 0 and s["e2a"]["cross"] > 0 for s in stats.values())
    for direction in ("a2e", "e2a"):
        assert p0["cross_process"][direction]["cross"] == sum(s[direction]["cross"] for s in stats.values())
        assert p0["cross_process"][direction]["cross_bytes"] == sum(s[direction]["cross_bytes"] for s in stats.values())
    assert p0["cross_process"]["fetch"]["cross"] > 0  # logits: process 0 -> process 1, every step


def _moved_slots(old: list[int], new: list[int], C: int) -> int:
    """Slots of ``new`` that must be copied from another instance: a new expert in the slot and no
    replica of it on the slot's instance in ``old``."""
    return sum(
        1
        for s, e in enumerate(new)
        if e >= 0 and old[s] != e and all(h // C != s // C for h, x in enumerate(old) if x == e)
    )


@pytest.mark.slow
def test_set_placement_moves_replicas_between_processes(tmp_path):
    """meshes/cpu-8-1a7e.yaml on 2 processes: expert instances 0-2 on process 0, 3-6 on process 1.
    Three set_placement calls move replicas between the processes (ppermute rounds, ``slot_moves``);
    greedy tokens and logits stay those before the move and those of the monolithic executor; then
    the placement controller re-places replicas between steps on both processes alike."""
    from jaxmoe import LLM, SamplingParams
    from multiprocess_worker import ENGINE, PROMPTS, logits

    results = _run_workers(tmp_path, "--relayout", "--max-tokens", str(MAX_TOKENS), mesh=MESH_1A7E)
    ref = LLM("tiny-random", dtype="float32", **ENGINE)
    expected = [
        list(o.token_ids) for o in ref.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ]
    ref_logits = np.asarray(logits(ref))

    p0, p1 = results
    assert p0["expert_processes"] == p1["expert_processes"] == [0, 1]
    assert p0["transfer"] == "CrossProcessTransfer"
    C, tp, layers = 4, 1, ref.cfg.num_moe_layers
    for a, b in zip(p0["phases"], p1["phases"]):
        assert a["name"] == b["name"] and a["placement"] == b["placement"] and a["moved"] == b["moved"]
        assert a["tokens"] == b["tokens"] == expected, a["name"]
        for got in (a["logits"], b["logits"]):
            err = np.abs(np.asarray(got) - ref_logits).max() / np.abs(ref_logits).max()
            assert err < 1e-5, (a["name"], err)
        assert a["slots_ok"] and b["slots_ok"], a["name"]  # each process checked the rows it holds
        assert a["slots_checked"] + b["slots_checked"] == layers * 3 * 28  # 3 arrays, 28 slots
        assert a["rows_moved"] == b["rows_moved"] and a["collectives"] == b["collectives"]
    phases = p0["phases"]
    assert [p["name"] for p in phases] == ["start", "forced", "split", "swapped"]
    start = phases[0]
    for prev, cur in zip(phases, phases[1:]):
        want = _moved_slots(prev["placement"], cur["placement"], C)
        assert cur["moved"] == want * layers > 0  # the same placement in every MoE layer
        # the collective path ran (the expert side spans processes) and copied only the moved slots
        assert cur["rows_moved"] - prev["rows_moved"] == cur["moved"] * tp
        assert cur["collectives"] > prev["collectives"]
    assert start["rows_moved"] == start["collectives"] == 0
    # copies between the processes: moved slots with no old replica on the slot's own process (the
    # source rule prefers the same instance, then the same node); instances 0-2 are on process 0
    node = [0 if j < 3 else 1 for j in range(7)]
    crossed = []
    for prev, cur in zip(phases, phases[1:]):
        old, new = prev["placement"], cur["placement"]
        want = sum(
            1
            for s, e in enumerate(new)
            if e >= 0 and old[s] != e and all(node[h // C] != node[s // C] for h, x in enumerate(old) if x == e)
        )
        crossed.append(cur["rows_across_processes"] - prev["rows_across_processes"])
        assert crossed[-1] == want * layers
    # forced: 4 slots per layer need an expert only the other process has (e.g. expert 3 for slot 4);
    # split: every expert is on both processes before, nothing crosses; swapped: all 28 slots cross
    assert crossed == [4 * layers, 0, 28 * layers]
    # the placement controller re-placed replicas between steps on both processes alike
    c0, c1 = p0["controller"], p1["controller"]
    assert c0 == c1 and c0["tokens"] == expected
    assert c0["rebalances"] >= 2 and c0["slots_moved"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_live_rescale_across_processes(tmp_path):
    """meshes/cpu-8-1a7e.yaml on 2 processes, re-scaled 1a7e -> 4a4e -> 1a7e while requests run: the
    expert re-shard moves replicas between the processes (``slot_moves``), the attention side stays
    on process 0. No request fails, every greedy output equals its standalone output on the
    single-process monolithic executor, all KV blocks are free at the end; between two steps every
    process moves the parameters, then lowers the step programs, one shape before each step (or each
    idle ``apply``), and compiles them without running them in background threads while the old
    layout serves, and swaps once all have built, so the first step on the new layout compiles nothing. (4-10 minutes on 2 busy cores.)"""
    from jaxmoe import LLM, SamplingParams
    from multiprocess_worker import RESCALE_ENGINE, RESCALES, rescale_request

    p0, p1 = _run_workers(tmp_path, "--rescale", mesh=MESH_1A7E, timeout=780)
    assert p0["added"] == p1["added"] and len(p0["added"]) >= 5
    for p in (p0, p1):  # a rescale that does not fit: a clear error first, on every process
        assert "attention=5 + experts=4 = 9 instances do not fit the 8 devices" in p["refused"], p["refused"]
    assert p0["tokens"] == p1["tokens"] and sorted(p0["tokens"]) == sorted(p0["added"])
    assert p0["errors"] == p1["errors"] == {} and set(p0["finish"].values()) == {"length"}
    mono = LLM("tiny-random", dtype="float32", **RESCALE_ENGINE)
    for rid in p0["added"]:
        prompt, max_tokens = rescale_request(int(rid[1:]))
        want = mono.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids
        assert p0["tokens"][rid] == list(want), rid
    for p in (p0, p1):
        assert p["blocks_free"][0] == p["blocks_free"][1]
        assert [lay[:2] for lay in p["layouts"]] == [list(c) for c in RESCALES]
    assert [lay[2] for lay in p0["layouts"]] == [[1], [0, 1]]  # the expert side's processes
    for a, b in zip(p0["results"], p1["results"]):
        for key in ("attention", "experts", "kv_blocks_moved", "expert_slots_local", "expert_slots_copied"):
            assert a[key] == b[key], key
        assert a["expert_slots_local"] > 0 and a["expert_slots_copied"] > 0
        assert a["build_s"] > 0 and a["swap_s"] > 0 and a["paused_s"] > 0
        # the old layout served while the units ran, the same steps on both; no pause the whole build
        assert a["steps_during_build"] == b["steps_during_build"] > 0
        # each process compiles only the programs that run on its devices (``runtime.process_local``),
        # but lowers every shape: the same units; each step waited for the slower process's unit
        assert a["build_units"] == b["build_units"] > 1 and a["largest_pause_s"] < a["build_s"]
        assert len(a["step_pauses_s"]) == len(b["step_pauses_s"]) > 0
        assert a["largest_pause_s"] >= max(a["step_pauses_s"] + b["step_pauses_s"])
        # the step programs were compiled ahead (a step compiles ~16 of them); one small program
        # compiled in the first step on the new layout in the run of 2026-11-27 (not identified)
        assert a["first_step_compiles"] == b["first_step_compiles"] <= 2
    assert any(r["kv_blocks_moved"] > 0 for r in p0["results"])
    # on 4a4e the attention side is process 0's, the expert side process 1's: neither compiled the
    # other's programs (the attention layer's jit_layer_step, the expert program's jit_run)
    compiled = [{unit.split(": ")[-1] for unit, _ in p["results"][0]["compiled_beside_s"]} for p in (p0, p1)]
    assert "jit_layer_step" in compiled[0] and "jit_run" not in compiled[0], compiled[0]
    assert "jit_run" in compiled[1] and "jit_layer_step" not in compiled[1], compiled[1]
    # 1a7e -> 4a4e: experts only devices 1-3 (process 0) held go to process 1; 4a4e -> 1a7e: devices
    # 1-3 get experts (and the router) only process 1 holds
    assert all(n > 0 for n in p0["rows_across_processes"])
    print(
        [
            {
                k: r[k]
                for k in (
                    *("previous", "paused_s", "build_s", "largest_pause_s", "build_units", "swap_s"),
                    *("steps_during_build", "first_step_compiles"),
                )
            }
            for r in p0["results"]
        ]
    )


@pytest.mark.slow
def test_two_processes_with_tensor_parallel_instances(tmp_path):
    """meshes/cpu-8-tp2x2.yaml across 2 processes: 2 attention instances x 2 devices (heads split) on
    process 0, 2 expert instances x 2 devices (FFN columns split) on process 1; the same greedy
    tokens as the single-process monolithic LLM."""
    from jaxmoe import LLM, SamplingParams
    from multiprocess_worker import ENGINE, PROMPTS

    p0, p1 = _run_workers(tmp_path, "--max-tokens", "6", mesh=ROOT / "meshes" / "cpu-8-tp2x2.yaml")
    ref = LLM("tiny-random", dtype="float32", **ENGINE)
    expected = [list(o.token_ids) for o in ref.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert p0["transfer"] == "CrossProcessTransfer" and (p0["attention_devices"], p0["expert_devices"]) == ([0], [1])
    assert p0["tokens"] == p1["tokens"] == expected
