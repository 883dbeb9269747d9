"""Live re-scaling (``LLMEngine.rescale``): a bounded load of mixed requests while the layout changes
three times on the 8-device CPU mesh (2a6e -> 4a4e -> 1a7e -> 2a6e); no request fails, every greedy
output equals the request's standalone output (the monolithic executor, one request at a time), all
KV blocks are free at the end, and each change reports its stall. Bad rescales change nothing.
"""

from __future__ import annotations

import gc
import os
import re

import numpy as np
import pytest

from jaxmoe.janus.live_rescale import LiveRescaler
from jaxmoe import LLM, SamplingParams
from jaxmoe.janus.live_rescale import RescaleError, RescaleInProgressError

ENGINE = dict(dtype="float32", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=16, max_batch_tokens=32)
CHANGES = [(4, 4), (1, 7), (2, 6)]
MAX_REQUESTS = 40


def _prompt(i: int) -> list[int]:
    rng = np.random.default_rng(i)
    return [int(t) for t in rng.integers(3, 250, size=int(rng.integers(3, 30)))]


def _sampling(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + (i * 7) % 17, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("mixtral")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, mesh="meshes/cpu-8.yaml", **ENGINE)


@pytest.fixture(scope="module")
def mono(path):
    """The monolithic executor: each request's standalone output."""
    return LLM(path, **ENGINE)


@pytest.mark.slow
def test_rescale_three_times_under_load(llm, mono):
    engine = llm.engine
    final, added = {}, []

    def add(i):
        added.append(engine.add_request(_prompt(i), _sampling(i), "ls" if i % 3 == 0 else "be", f"r{i}"))

    def step():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    for i in range(6):
        add(i)
    results = []
    for attention, experts in CHANGES:
        for _ in range(2):
            step()
        job = LiveRescaler.of(engine).start(attention, experts)
        while not job.done():  # serve while the new layout is built; the swap happens in a step
            live = len(engine.scheduler.sequences())
            if job.ready() or live > 2:
                step()
            elif len(added) < MAX_REQUESTS:
                add(len(added))
            else:  # keep two requests in flight for the swap (their KV moves)
                job.wait_ready(0.05)
        results.append(job.result())
        assert llm.executor.num_attention == attention and llm.executor.num_expert_instances == experts
        add(len(added))
    for _ in range(2000):  # bounded
        if not engine.has_work():
            break
        step()

    assert sorted(final) == sorted(added)
    assert all(o.finish_reason == "length" and o.error is None for o in final.values())
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    for rid in added:
        i = int(rid[1:])
        want = mono.generate([_prompt(i)], _sampling(i))[0].token_ids
        assert final[rid].token_ids == want, rid

    for r, (attention, experts) in zip(results, CHANGES):
        assert (r.attention, r.experts) == (attention, experts)
        assert r.swap_s > 0 and r.build_s > 0
        assert r.expert_slots_local > 0  # experts a kept device already held are not copied
        assert r.stall_ratio is not None and r.normal_step_s > 0
        print(r.as_dict())
    assert any(r.kv_blocks_moved > 0 for r in results)
    assert [h.attention for h in LiveRescaler.of(engine).history] == [a for a, _ in CHANGES]


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux memory mappings")
def test_repeated_rescales_keep_the_mappings_bounded(llm):
    """XLA:CPU maps memory for every compiled program: a long-running server that rescales back and
    forth must free the programs of the layouts it left (and find a revisited layout's spec equal to
    the earlier one), or it reaches the kernel's vm.max_map_count. Four idle changes 4a4e <-> 2a6e:
    the mappings after the third and fourth are within 1500 of those after the first and second
    (before the fix they grew by 1.5-3.4k per change: every layout's programs were kept)."""
    prompt, sp = _prompt(0), _sampling(0)
    want = llm.generate([prompt], sp)[0].token_ids
    after = []
    for attention, experts in [(4, 4), (2, 6), (4, 4), (2, 6)]:
        llm.rescale(attention, experts)
        assert llm.generate([prompt], sp)[0].token_ids == want
        gc.collect()  # the old executor is freed at Python's next collection (reference cycles)
        after.append(_mappings())
    assert after[2] - after[0] < 1500 and after[3] - after[1] < 1500, after
    assert llm.executor.sub.spec.source.count("rescaled to") == 1, llm.executor.sub.spec.source


TP2X2 = "meshes/cpu-8-tp2x2.yaml"  # 2 attention x 2 devices (heads split) + 2 expert instances x 2 devices (columns)
TP_CHANGES = [(1, 3), (3, 1)]  # instances of 2 devices: 2 + 6 and 6 + 2 of the 8 devices


@pytest.fixture(scope="module")
def tp_llm(path):
    return LLM(path, mesh=TP2X2, **ENGINE)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (
            dict(attention=3, experts=2),
            "attention=3 x 2 devices per instance + experts=2 x 2 devices per instance = 10 devices do not fit the 8",
        ),
        (dict(attention=4, experts=1), "= 10 devices do not fit the 8 devices"),
        (dict(attention=3, experts=1, slots_per_instance=4), "experts=1: 8 experts need 8 slots per instance"),
    ],
)
def test_bad_tensor_parallel_rescale_changes_nothing(tp_llm, kwargs, names):
    before = tp_llm.executor.sub.spec
    with pytest.raises(RescaleError, match=re.escape(names)):
        LiveRescaler.of(tp_llm.engine).start(**kwargs)
    assert LiveRescaler.of(tp_llm.engine).job is None and tp_llm.executor.sub.spec == before


@pytest.mark.slow
def test_rescale_tensor_parallel_instances_under_load(tp_llm, mono):
    """Instances of 2 devices on both sides (heads and FFN columns split) re-scaled twice under a
    bounded load, counting instances of 2 devices: 2a2e -> 1a3e -> 3a1e. 0 failed requests, every
    greedy output equals its standalone monolithic output, all KV blocks free; the new layouts keep
    2 devices per instance and the expert column slices of a kept instance are not copied."""
    llm = tp_llm
    engine = llm.engine
    final, added = {}, []

    def add(i):
        added.append(engine.add_request(_prompt(i), _sampling(i), "ls" if i % 3 == 0 else "be", f"t{i}"))

    def step():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out

    for i in range(4):
        add(i)
    results = []
    for attention, experts in TP_CHANGES:
        step()
        job = LiveRescaler.of(engine).start(attention, experts)
        while not job.done():
            if job.ready() or len(engine.scheduler.sequences()) > 2:
                step()
            elif len(added) < 10:
                add(len(added))
            else:
                job.wait_ready(0.05)
        results.append(job.result())
        spec = llm.executor.sub.spec
        assert (spec.attention.count, spec.experts.count) == (attention, experts)
        assert spec.attention.devices_per_instance == spec.experts.devices_per_instance == 2
        assert spec.attention.devices[-1] == (2 * attention - 2, 2 * attention - 1)
        add(len(added))
    for _ in range(2000):  # bounded
        if not engine.has_work():
            break
        step()

    assert sorted(final) == sorted(added)
    assert all(o.finish_reason == "length" and o.error is None for o in final.values())
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    for rid in added:
        i = int(rid[1:])
        assert final[rid].token_ids == mono.generate([_prompt(i)], _sampling(i))[0].token_ids, rid
    # 2a2e -> 1a3e: the instance on devices 4-5 and 6-7 stays; 1a3e -> 3a1e: the one on 6-7 stays
    assert all(r.expert_slots_local > 0 for r in results)
    assert results[0].expert_slots_copied > 0  # the new instance on devices 2-3 got its column slices
    assert any(r.kv_blocks_moved > 0 for r in results)


def test_normal_step_is_the_same_work():
    """The stall baseline: a first step with a prefill chunk is compared with the steps before that
    made the same program calls (tokens per row), not with the decode-only median; with fewer than 3
    alike, with all steps."""
    from jaxmoe.janus.live_rescale import normal_step

    decode, mixed = (1,), (1, 16)
    before = [(0.010, decode)] * 10 + [(0.050, mixed), (0.070, mixed), (0.060, mixed)]
    assert normal_step(before, [(8, 1)]) == 0.010
    assert normal_step(before, [(8, 1), (1, 16)]) == 0.060  # rows differ across layouts, tokens do not
    assert normal_step(before, [(4, 64)]) == 0.010  # no step alike: the median of all
    assert normal_step(before[:10] + before[10:12], [(8, 1), (1, 16)]) == 0.010  # only 2 alike
    assert normal_step([], [(8, 1)]) is None


def test_a_rescale_compiles_the_shapes_needed_now():
    """The build compiles the shapes the live sequences need: idle, one decode shape; decodes up to
    their count per instance; prefill chunks only while some prefill, up to their longest rest."""
    from types import SimpleNamespace

    from jaxmoe.engine.buckets import ShapePlan

    plan = ShapePlan(max_num_seqs=16, max_prefill_chunk=256, prefill_rows=4)

    def seq(uncomputed):
        return SimpleNamespace(num_uncomputed=uncomputed, is_prefill=uncomputed > 1)

    assert plan.shapes_for([]) == [(1, 1)]
    assert plan.shapes_for([seq(1)] * 3) == [(1, 1), (2, 1), (4, 1)]
    assert plan.shapes_for([seq(1), seq(40)]) == [(1, 1), (2, 1), (1, 16), (1, 32), (1, 64)]
    many = [seq(1000)] * 5  # chunks capped at max_prefill_chunk, rows at prefill_rows
    assert set(plan.shapes_for(many)) == set(plan.shapes()) - {(16, 1)}
    assert set(plan.shapes_for(many)) <= set(plan.shapes())
    assert ShapePlan(4, 64, fixed=(2, 16)).shapes_for([seq(1)]) == [(2, 16)]


def _layout(llm):
    ex = llm.executor
    return ex.num_attention, ex.num_expert_instances, ex.slots_per_instance, ex.placement()


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(attention=5, experts=4), "attention=5 + experts=4 = 9 instances do not fit the 8 devices"),
        (dict(attention=0, experts=6), "attention must be a positive integer"),
        (dict(attention=2, experts="6"), "experts must be a positive integer"),
        (dict(attention=7, experts=1), "experts=1: 8 experts need 8 slots per instance, memory holds 4"),
        (dict(attention=2, experts=6, slots_per_instance=9), "slots_per_instance=9: a device's memory holds 4"),
        (dict(attention=2, experts=6), "already runs 2a6e"),
    ],
)
def test_bad_rescale_changes_nothing(llm, kwargs, names):
    before = _layout(llm)
    with pytest.raises(RescaleError, match=re.escape(names)):
        LiveRescaler.of(llm.engine).start(**kwargs)
    assert LiveRescaler.of(llm.engine).job is None and _layout(llm) == before


@pytest.mark.slow
def test_rescale_while_one_is_in_progress(llm):
    """A second rescale is refused while the first one is built; the first one still completes."""
    job = LiveRescaler.of(llm.engine).start(4, 4)
    with pytest.raises(RescaleInProgressError, match="a rescale to 4a4e is in progress; attention=1, experts=7"):
        LiveRescaler.of(llm.engine).start(1, 7)
    assert job.wait_ready(300)
    LiveRescaler.of(llm.engine).apply()
    assert job.result(1).attention == 4 and _layout(llm)[:2] == (4, 4)
    assert llm.rescale(2, 6).experts == 6  # the notebook API; back to the launch layout


def test_rescale_too_small_for_a_live_request(llm):
    """4 attention instances hold 128 KV slots each; a live request that may need 200 would not fit."""
    rid = llm.engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=163, ignore_eos=True))
    try:
        with pytest.raises(RescaleError, match=r"attention=4: request 'req-\d+' may need 200 KV slots.*hold 128"):
            LiveRescaler.of(llm.engine).start(4, 4)
    finally:
        llm.engine.abort(rid)
    assert _layout(llm)[:2] == (2, 6)


def test_rescale_needs_a_mesh(path):
    with pytest.raises(RescaleError, match="needs the disaggregated executor"):
        LiveRescaler.of(LLM(path, **ENGINE).engine).start(2, 6)


@pytest.mark.parametrize(
    "payload, names",
    [
        ({"attention": 2}, "experts: Field required"),
        ({"attention": "2", "experts": 6}, "attention: Input should be a valid integer (got '2')"),
        ({"attention": 0, "experts": 6}, "attention: Input should be greater than or equal to 1 (got 0)"),
        ({"attention": 2, "experts": 6, "gpus": 8}, "gpus: Extra inputs are not permitted"),
        ([2, 6], "body: Input should be a valid dictionary"),
    ],
)
def test_admin_payload_errors_name_the_field(payload, names):
    from jaxmoe.server import admin

    with pytest.raises(admin.AdminError, match=re.escape(names)) as err:
        admin.parse_rescale(payload)
    assert err.value.http_status == 400


@pytest.mark.slow
def test_grpc_rescale_behind_the_api_key_while_streaming(llm):
    """``Rescale`` needs the API key; a bad one is INVALID_ARGUMENT naming the value; a good one
    answers once 4a4e serves, while a streamed request goes on with its standalone tokens. Then
    HTTP ``POST /admin/rescale`` the same way (401 without the key, 400 naming the field) back to 2a6e."""
    import grpc

    from jaxmoe.server.app import ServeOptions, ServerThread
    from jaxmoe.server.client import JaxmoeClient
    from jaxmoe.server.security import SecurityOptions

    prompt, sampling = _prompt(101), SamplingParams(max_tokens=40, ignore_eos=True)
    want = llm.generate([prompt], sampling)[0].token_ids
    opts = ServeOptions(warmup=False, security=SecurityOptions(api_key="k3y"))
    st = ServerThread(llm.engine, opts)
    srv = st.start()
    try:
        with JaxmoeClient(srv.grpc_target) as anonymous, JaxmoeClient(srv.grpc_target, api_key="k3y") as admin:
            with pytest.raises(grpc.RpcError) as err:
                anonymous.rescale(4, 4)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                admin.rescale(6, 6)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "attention=6 + experts=6 = 12 instances do not fit the 8 devices" in err.value.details()
            stream = admin.generate(prompt, max_tokens=40, ignore_eos=True, temperature=0.0)
            first = next(stream)
            resp = admin.rescale(4, 4)
            ids = list(first.delta_token_ids) + [t for c in stream for t in c.delta_token_ids]
            assert (resp.attention, resp.experts, resp.previous) == (4, 4, "2a6e") and resp.swap_s > 0
            assert ids == want
            assert srv.async_engine.call(lambda e: e.runner.executor.num_attention) == 4
        # the same over HTTP: POST /admin/rescale, behind the key, errors naming the field
        assert _post(srv, {"attention": 2, "experts": 6})[0] == 401
        status, body = _post(srv, {"attention": "two", "experts": 6}, key="k3y")
        assert status == 400 and body["error"]["param"] == "attention", body
        status, body = _post(srv, {"attention": 5, "experts": 4}, key="k3y")
        assert status == 400 and "do not fit the 8 devices" in body["error"]["message"], body
        status, body = _post(srv, {"attention": 2, "experts": 6}, key="k3y")
        assert status == 200 and (body["attention"], body["experts"], body["previous"]) == (2, 6, "4a4e"), body
    finally:
        st.stop(abort_inflight=True)


def _post(srv, payload: dict, key: str | None = None) -> tuple[int, dict]:
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=600)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", "/admin/rescale", json.dumps(payload), headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.mark.slow
def test_placement_controller_follows_the_new_executor(llm):
    from jaxmoe.janus.placement_controller import PlacementController

    controller = PlacementController.attach(llm.engine, every_steps=0)
    try:
        llm.rescale(4, 4)
        assert controller.executor is llm.executor and controller.executor.num_expert_instances == 4
        llm.generate([_prompt(7)], _sampling(7))
        assert controller.rebalance() is not None  # re-places the new executor's replicas
    finally:
        llm.engine.hooks.remove(controller)
        llm.rescale(2, 6)


@pytest.mark.slow
def test_lower_step_compiles_what_a_step_runs(llm):
    """What a rescale across processes compiles in the background instead of running: a new layout's
    step programs from ``ModelRunner.lower_step`` (here with ``CrossProcessTransfer``, whose A2E /
    E2A are programs, in one process), compiled; the step on that shape then compiles nothing."""
    from jaxmoe.compilation import compile_events
    from jaxmoe.engine.model_runner import ModelRunner
    from jaxmoe.janus.reshard import build_rescaled, rescaled_spec
    from jaxmoe.runtime.cross_process import CrossProcessTransfer

    ex, runner = llm.executor, llm.engine.runner
    target = (2, 6) if _layout(llm)[:2] == (4, 4) else (4, 4)
    slots = llm.engine.config.num_blocks * llm.engine.config.block_size
    new, _ = build_rescaled(ex, rescaled_spec(ex.sub.spec, *target), slots, transfer=CrossProcessTransfer)
    new_runner = ModelRunner(new, runner.block_size, runner.max_blocks_per_seq, runner.plan)
    programs = new_runner.lower_step(1, 1)  # the decode shape of one row per attention instance
    names = {p.as_text().split("@", 2)[1].split("(", 1)[0] for p in programs}
    assert len(programs) >= 8 and any("shmap" in n or "body" in n for n in names), names  # the A2E / E2A
    for program in programs:
        program.compile()
    before = compile_events()["programs"]
    new_runner.warm(1, 1)
    assert compile_events()["programs"] == before


@pytest.mark.slow
@pytest.mark.parametrize("form", ["beside", "steps"])
def test_agreed_rescale_waits_for_every_process_and_fails_everywhere(llm, form, monkeypatch):
    """The ``jax.distributed`` agreement (``agreed``) in one process, with a stand-in for the
    all-gather: while another process reports building, steps go on and ``apply`` does not swap; when
    it reports that its build failed, the rescale fails here too (naming it) and the old layout stays.
    ``beside`` (the default): one serving shape lowered before each step on the engine's thread, its
    programs compiled by background threads that run no collective and move no data (no
    ``device_put``, no agreement: those stay on the engine's thread); ``steps``: one build unit (a
    lowering or a few programs compiled) before each step, none in ``apply`` while requests run."""
    import threading

    import jax

    from jaxmoe.janus.live_rescale import BUILDING, FAILED

    engine = llm.engine
    rescaler = LiveRescaler.of(engine)
    other, agreements, threads = [BUILDING], [], set()

    def gather(mine):  # [state, unit microseconds] of this process; the other one's units take 1 s
        agreements.append(int(mine[0]))
        threads.add(threading.current_thread().name)
        return [list(mine), [other[0], 1_000_000 if mine[1] else 0]]

    device_put = jax.device_put

    def recorded_device_put(*args, **kwargs):  # a host value onto every process's devices is a collective
        threads.add(threading.current_thread().name)
        return device_put(*args, **kwargs)

    own_gather, before = rescaler.gather, _layout(llm)
    llm.generate([_prompt(300)], SamplingParams(max_tokens=2, ignore_eos=True))  # the steps' programs compiled
    assert rescaler.across_processes == "beside"  # the default
    rescaler.agreed, rescaler.gather, rescaler.across_processes = True, gather, form
    rid = engine.add_request(_prompt(300), SamplingParams(max_tokens=8, ignore_eos=True))
    try:
        job = rescaler.start(*((2, 6) if before[:2] == (4, 4) else (4, 4)))
        assert job.agreed and job.paused_s > 0  # the parameters moved between steps
        monkeypatch.setattr(jax, "device_put", recorded_device_put)
        for _ in range(3):
            engine.step()
        assert rescaler.apply() is False and not job.done() and len(agreements) == 5  # start's, 3 steps', apply's
        assert job.thread is None and job.units_run == 3 and not job.ready(), job.units_run
        assert 0 < job.largest_pause_s
        # each step waited for the slower process's unit (the other one's: 1 s)
        assert len(job.step_pauses) == 3 and min(job.step_pauses) >= 1.0, job.step_pauses
        assert job.largest_pause_s == max(job.largest_pause_s, *job.step_pauses)
        steps = 3
        if form == "beside":  # three shapes lowered here; the compiles start once all are lowered
            assert all(unit.startswith("lower ") for unit, _ in job.unit_pauses) and job.compiles == []
            while job.units is not None and steps < 20:  # bounded: one lowering per step
                engine.step()
                steps += 1
            assert job.units_run == len(job.shapes) + 1 and len(job.compiles) > job.units_run  # + the KV move
            compiled = [future.result(300) for future in job.compiles[:2]]  # [shape: program, seconds]
            assert all(": jit_" in name and seconds > 0 for name, seconds in compiled), compiled
        else:
            assert job.build_s > 0
        other[0] = FAILED
        engine.step()
        assert job.done() and rescaler.job is None
        with pytest.raises(RescaleError, match=r"building the \da\de layout failed on process 1"):
            job.result(0)
        # the units not run are dropped ("beside": the step after the last lowering found none left)
        assert job.units is None and job.units_run == (4 if form == "steps" else steps - 1)
        assert job.compile_pool is None  # ("beside") its compiles not started are dropped too
        assert _layout(llm) == before
        assert 3 <= job.steps_during_build <= steps  # the old layout served meanwhile
        # every collective and every device_put ran on the engine's thread (this one)
        assert threads == {threading.current_thread().name}, threads
    finally:
        monkeypatch.undo()
        engine.abort(rid)
        rescaler.agreed, rescaler.gather, rescaler.across_processes = False, own_gather, "beside"


@pytest.mark.slow
def test_agreed_start_refused_on_another_process_moves_nothing(llm):
    """(``jax.distributed``, a stand-in for the all-gather) A rescale that another process refuses at
    ``start`` is refused here too, before any parameter moves (a collective the other process would
    never join): one line naming the process, no job, the layout unchanged; the next request starts."""
    from jaxmoe.janus.live_rescale import BUILDING, FAILED

    rescaler = LiveRescaler.of(llm.engine)
    other, agreements = [FAILED], []

    def gather(mine):
        agreements.append(int(mine[0]))
        return [list(mine), [other[0], 0]]

    own_gather, before = rescaler.gather, _layout(llm)
    target = (2, 6) if before[:2] == (4, 4) else (4, 4)
    rescaler.agreed, rescaler.gather = True, gather
    try:
        with pytest.raises(RescaleError, match=r"^attention=\d, experts=\d: refused on process 1; nothing changed$"):
            rescaler.start(*target)
        assert agreements == [BUILDING] and rescaler.job is None and _layout(llm) == before
        with pytest.raises(RescaleError, match="attention=5 \\+ experts=4 = 9 instances do not fit"):
            rescaler.start(5, 4)  # refused here: this process's own error, after the same agreement
        assert agreements == [BUILDING, FAILED] and rescaler.job is None
    finally:
        rescaler.agreed, rescaler.gather = False, own_gather


@pytest.mark.slow
def test_collective_attention_moves_equal_the_host_path(llm):
    """The attention side of a rescale across processes, in one process: the attention parameters
    sent to the new attention devices by a ``slot_moves`` collective and the KV blocks moved by one
    (rows: cache slots) equal the ``device_put`` / host-memory path, and the KV lands where the
    moves say; only the blocks that change device count as bytes moved."""
    import jax

    from jaxmoe.compilation import compile_events
    from jaxmoe.janus.reshard import MoveStats, build_rescaled, lower_kv_move, move_kv, rescaled_spec
    from jaxmoe.runtime import slot_moves

    ex = llm.executor
    slots = llm.engine.config.num_blocks * llm.engine.config.block_size
    old, _ = build_rescaled(ex, rescaled_spec(ex.sub.spec, 2, 6), slots)
    rng = np.random.default_rng(3)
    old.cache = [
        {k: jax.device_put(rng.standard_normal(v.shape).astype(v.dtype), v.sharding) for k, v in layer.items()}
        for layer in old.cache
    ]
    spec = rescaled_spec(ex.sub.spec, 3, 5)  # attention devices 0, 1 -> 0, 1, 2
    by_collective, _ = build_rescaled(old, spec, slots, collective=True)
    by_device_put, _ = build_rescaled(old, spec, slots, collective=False)
    a, b = jax.tree.leaves(by_collective.params), jax.tree.leaves(by_device_put.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # old blocks of both instances (32 each) -> new blocks of the three new ones (64 / 3 -> 22 each)
    nbpi, bs = by_collective.kv_layout.blocks_per_instance, old.block_size
    moves = [([0, 1, 33], [0, 2 * nbpi + 1, nbpi]), ([40, 5], [2 * nbpi + 3, 7])]
    # the KV-move programs compiled ahead (fixed rounds, one per bucket of slots per device pair):
    # moves that differ from call to call then compile nothing
    compiled = compile_events()["programs"]
    ahead = lower_kv_move(old, by_collective, collective=True)
    assert len(ahead) == 4  # slots per device pair padded to 8, 32, 128 or a new instance's (21 blocks)
    for program in ahead:
        program.compile()
    assert compile_events()["programs"] == compiled + 4
    compiled += 4
    stats_c, stats_h = MoveStats(), MoveStats()
    move_kv(old, by_collective, [([33], [nbpi + 2])], MoveStats(), collective=True)  # another plan first
    mover = slot_moves.mover_for(by_collective.sub)
    sent, moved = mover.rows_sent, mover.rows_moved
    move_kv(old, by_collective, moves, stats_c, collective=True)
    assert compile_events()["programs"] == compiled
    # blocks 1 and 40 change device (0 -> 2, 1 -> 2): 16 slots; the 4 pairs of devices {0, 1} -> {0, 1, 2}
    # each carry the 8-slot bucket
    assert (mover.rows_moved - moved, mover.rows_sent - sent) == (2 * bs, 4 * 8)
    move_kv(old, by_device_put, moves, stats_h, collective=False)
    assert stats_c == stats_h and stats_c.kv_blocks_moved == 5
    per_slot = sum(v.nbytes // v.shape[0] for layer in old.cache for v in layer.values())
    assert stats_c.kv_bytes_moved == 2 * bs * per_slot  # blocks 0, 5 stay on device 0, 33 on device 1
    for lo, lc, lh in zip(old.cache, by_collective.cache, by_device_put.cache):
        for k in lo:
            want = np.zeros(lc[k].shape, lc[k].dtype)
            for src, dst in moves:
                for s, d in zip(src, dst):
                    want[d * bs : (d + 1) * bs] = np.asarray(lo[k])[s * bs : (s + 1) * bs]
            assert lc[k].sharding == lh[k].sharding
            np.testing.assert_array_equal(np.asarray(lc[k]), want)
            np.testing.assert_array_equal(np.asarray(lh[k]), want)
