"""Start-up: warm-up compiles a closed set of programs whose number (and the JIT's memory mappings)
does not grow with depth, and ``jaxmoe serve`` stops promptly on SIGTERM, warm-up included."""

import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from jaxmoe.compilation import compile_events
from jaxmoe.config import from_hf_config
from jaxmoe.demo import DEMO_HF_CONFIG, demo_params
from jaxmoe.engine.async_engine import AsyncEngine
from jaxmoe.engine.engine import EngineConfig, LLMEngine
from jaxmoe.assembly import QLLMConfig, RuntimeConfig, attach_features, build_executor
from jaxmoe.tokenizer import ByteTokenizer

TINY = dict(DEMO_HF_CONFIG, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _warm(layers: int) -> tuple[int, int, int]:
    """(shapes warmed, programs XLA compiled or loaded, memory mappings added) for a fresh model;
    then every shape runs once, and must compile nothing (warm-up compiled it ahead, on a pool)."""
    jax.clear_caches()
    cfg = from_hf_config(dict(TINY, num_hidden_layers=layers))
    config = EngineConfig(max_num_seqs=4, max_prefill_chunk=32, max_model_len=256, num_blocks=64)
    executor = build_executor(cfg, demo_params(cfg, seed=layers), RuntimeConfig(engine=config))
    engine = LLMEngine(cfg, executor, ByteTokenizer(), config)
    ae = AsyncEngine(engine).start()
    try:
        maps, programs = _mappings(), compile_events()["programs"]
        ae.warmup(progress=False)
        compiled, added = compile_events()["programs"] - programs, _mappings() - maps
        for rows, tokens in engine.runner.plan.shapes():
            ae.call(lambda e, r=rows, t=tokens: e.runner.warm(r, t))  # runs the step and the sampler
        assert compile_events()["programs"] - programs == compiled, "a shape compiled after warm-up"
        return len(engine.runner.plan.shapes()), compiled, added
    finally:
        ae.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_programs_and_mappings_do_not_grow_with_depth():
    shallow, deep = _warm(2), _warm(32)
    assert shallow[0] == deep[0] == 3 + 3 * 2  # decode batches 1, 2, 4; prefill 1-4 rows x 16, 32 tokens
    # every shape compiles its step program; the sampler, adjust_logits (penalties) and mask_logits
    # (structured output) compile once per batch size (1, 2, 4)
    assert deep[1] == shallow[1] <= deep[0] + 3 * 3
    assert deep[2] <= 1.5 * shallow[2] + 500, (shallow, deep)


def _serve(*args, cache=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cache is not None:
        env["JAXMOE_COMPILATION_CACHE"] = str(cache)
    cmd = [
        sys.executable,
        "-m",
        "jaxmoe.cli",
        "serve",
        "--model",
        "tiny-random",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        *args,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen, text: str, timeout: float) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen += line
        if text in line:
            return seen
    raise AssertionError(f"{text!r} not seen in {timeout}s; output:\n{seen}")


@pytest.mark.slow
def test_sigterm_during_warmup_stops_within_seconds(tmp_path):
    proc = _serve(cache=tmp_path / "xla")  # a fresh cache: warm-up compiles for over a minute
    try:
        _wait_for(proc, "warming up", timeout=120)
        time.sleep(1.0)  # inside the first compiles
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, rest
    assert "stopped during warm-up" in rest
    assert took < 15, took


@pytest.mark.slow
def test_sigterm_while_serving_drains_and_exits():
    # fused steps only (QLLM's layer preemption, not the subject here, would warm each shape again)
    proc = _serve("--max-num-seqs", "2", "--max-prefill-chunk", "16", "--max-model-len", "64", "--no-layer-preemption")
    try:
        _wait_for(proc, "http listening", timeout=300)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and "stopped" in rest
    assert time.monotonic() - t0 < 15


def test_compile_workers_setting(monkeypatch):
    from jaxmoe.engine.warmup import ENV_WORKERS, compile_workers

    monkeypatch.setenv(ENV_WORKERS, "3")
    assert compile_workers() == 3
    monkeypatch.delenv(ENV_WORKERS)
    assert compile_workers() == len(os.sched_getaffinity(0))
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ENV_WORKERS, bad)
        with pytest.raises(ValueError, match=ENV_WORKERS):
            compile_workers()


@pytest.mark.slow
@pytest.mark.parametrize("expert_queues", [0, 2])
def test_warmup_with_layer_preemption_covers_both_paths(expert_queues):
    """With layer preemption in a serving loop (a poll: steps may pause) every step runs the
    layer-by-layer programs (a step that does not pause too: one ``layers`` call per layer group),
    never the fused one; they (with per-expert queues also
    a MoE layer's attention side, routing and expert round) compile ahead on the pool, nothing runs:
    afterwards neither a pausable nor an unpaused step compiles."""
    from jaxmoe.engine.warmup import warm_up

    cfg = from_hf_config(dict(TINY, num_hidden_layers=2))
    config = RuntimeConfig(
        engine=EngineConfig(max_num_seqs=2, max_prefill_chunk=16, max_model_len=64, num_blocks=16),
        qllm=QLLMConfig(layer_preemption=True, expert_queues=expert_queues),
    )
    executor = build_executor(cfg, demo_params(cfg, seed=3), config)
    engine = attach_features(LLMEngine(cfg, executor, ByteTokenizer(), config.engine), config)
    engine.poll = lambda: None  # what ``AsyncEngine`` sets before its warm-up
    shapes = [(1, 1), (1, 16)]
    executor._step = None  # the fused program: neither lowered nor run
    ran = []
    executor.forward = lambda *args, **kwargs: ran.append(args)  # warm-up must run no step
    warm_up(engine, shapes, progress=False, workers=2)
    del executor.forward
    assert ran == []
    before = compile_events()["programs"]
    for rows, tokens in shapes:
        engine.runner.warm(rows, tokens)
        engine.runner.warm(rows, tokens, layer_by_layer=True)
    assert compile_events()["programs"] == before
