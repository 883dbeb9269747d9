"""Every schedule of the disaggregated executor gives the monolithic executor's tokens and logits.

FinDEP (arXiv:2512.21487) ASAS / AASS at r1 = 2 (attention micro-batches) and r2 = 2, 4 (expert-side
chunks), PPPipe (order PP, r1 = 2) and the sequential schedule, for the five model families on the
cpu-8 layouts 2a6e and 4a4e, and r1 = 1, 4 with r2 = 4, 2 on three (family, layout) pairs: prefill + teacher-forced decode logits (relative error < 1e-5) and greedy
tokens, against ``LLM(path)``. One LLM per (family, layout) serves every schedule (the executor's
``pipeline`` is swapped between cases; compiled programs are shared), so the whole file runs in a
few minutes on 2 cores. ``LLM(..., pipeline=NAME)`` and its errors are checked at the end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row
from jaxmoe.findep.online import SolverChooser, pipeline_chooser
from jaxmoe.findep.profile import ProfileError
from jaxmoe.runtime.pipeline import Pipeline

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
LAYOUTS = {"2a6e": "meshes/cpu-8.yaml", "4a4e": "meshes/cpu-8-4a4e.yaml"}
ENGINE = dict(num_blocks=64, block_size=8, max_num_seqs=8)
# 8 rows: 2 per attention instance on 4a4e (r1 = 2 runs), 4 on 2a6e (r1 up to 4)
PROMPTS = [
    [7, 21, 33, 5, 90, 17, 64, 12, 48, 101, 9],
    [11, 3, 77, 29, 54],
    [5, 9, 13],
    [60, 61, 62, 63],
    [1, 2, 3, 4, 5, 6, 7],
    [99, 98],
    [40, 41, 42, 43, 44, 45],
    [8, 16, 24, 32, 40, 48, 56, 64],
]
# blocks in the KV range of the attention instance that gets the row on both layouts (row i: instance
# i // 4 of 2, or i // 2 of 4; 16 blocks per instance on 4a4e): the per-instance attention path, as generate's
TABLES = [[16 * (i // 2) + 2 * (i % 2), 16 * (i // 2) + 2 * (i % 2) + 1] for i in range(len(PROMPTS))]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# every family and layout: these (two micro-batch shapes; chunks add only small expert programs)
SCHEDULES = [
    "sequential",
    {"order": "PP", "r1": 2},  # PPPipe: ping-pong micro-batches, no chunking, no shared overlap
    {"order": "ASAS", "r1": 2, "r2": 2},
    {"order": "AASS", "r1": 2, "r2": 4},
]
# more r1 / r2 values (new micro-batch shapes, so more compiling): one family per layout each
MORE = [{"order": "ASAS", "r1": 1, "r2": 4}, {"order": "AASS", "r1": 4, "r2": 2}]
MORE_ON = {("deepseek_v3", "2a6e"), ("qwen2_moe", "4a4e"), ("mixtral", "2a6e")}


def _logits(llm, steps: int = 2, ran: list | None = None) -> list[np.ndarray]:
    """Prefill then teacher-forced decode logits; ``ran`` gets the pipeline the prefill ran."""
    runner = llm.engine.runner
    rows = [Row(p, 0, t) for p, t in zip(PROMPTS, TABLES)]
    prefill = np.asarray(runner.forward(rows, all_logits=True))
    if ran is not None:
        ran.append(runner.executor.last_pipeline)
    out = [prefill[i, : len(p)] for i, p in enumerate(PROMPTS)]
    for step in range(steps):
        rows = [Row([int(20 + 7 * step + i)], len(p) + step, t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES))]
        out.append(np.asarray(runner.forward(rows)))
    return out


def _greedy(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """family -> (logits, greedy tokens) of the monolithic executor, computed once."""
    made = {}

    def get(family):
        if family not in made:
            mono = LLM(checkpoint_dir(family), dtype="float32", **ENGINE)
            made[family] = (_logits(mono), _greedy(mono))
        return made[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_schedule_equals_monolithic(checkpoint_dir, reference, family, layout):
    want_logits, want_tokens = reference(family)
    llm = LLM(checkpoint_dir(family), dtype="float32", mesh=LAYOUTS[layout], **ENGINE)
    executor = llm.engine.executor
    ran: list[Pipeline] = []  # what each schedule's prefill ran
    more = (family, layout) in MORE_ON
    for schedule in SCHEDULES + (MORE if more else []):
        executor.pipeline = pipeline_chooser(schedule, llm.cfg, executor.sub.spec, "float32", 4)
        for g, w in zip(_logits(llm, ran=ran), want_logits):
            assert _rel_err(g, w) < 1e-5, (schedule, ran[-1])
        assert _greedy(llm) == want_tokens, schedule
    rows = len(PROMPTS) // executor.num_attention  # 4 (2a6e) or 2 (4a4e) per attention instance
    assert ran[0] == Pipeline.sequential()
    assert [p.r1 for p in ran[1:]] == [2, 2, 2] + ([1, min(4, rows)] if more else [])
    assert [p.order for p in ran[1:]] == ["PP", "ASAS", "AASS"] + (["ASAS", "AASS"] if more else [])
    assert ran[2].r2 == 2 and ran[3].r2 == 4 and (not more or ran[4].r2 == 4)  # expert-side chunks ran


@pytest.mark.slow
def test_schedule_by_name_through_llm(checkpoint_dir, reference, tmp_path):
    """``LLM(path, mesh=FILE, pipeline=...)``: names, a fixed dict, the solver cached per shape; errors."""
    path = checkpoint_dir("deepseek_v2")
    want_logits, want_tokens = reference("deepseek_v2")
    findep = LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline="findep", **ENGINE)
    chooser = findep.engine.executor.pipeline
    assert isinstance(chooser, SolverChooser) and chooser.name == "findep"
    assert _greedy(findep) == want_tokens
    for g, w in zip(_logits(findep), want_logits):
        assert _rel_err(g, w) < 1e-5
    assert chooser.cache  # one plan per batch shape seen
    shapes = len(chooser.cache)
    _greedy(findep)
    assert len(chooser.cache) == shapes  # the same shapes again: no new solves
    assert all(p.order in ("ASAS", "AASS") for p in chooser.cache.values())
    pp = pipeline_chooser("pppipe", findep.cfg, findep.engine.executor.sub.spec, "float32", 4)
    assert all(pp.for_batch(4, t).order == "PP" and pp.for_batch(4, t).r2 == 1 for t in (1, 16))

    with pytest.raises(ValueError, match="'fastest'"):
        LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline="fastest", **ENGINE)
    with pytest.raises(ValueError, match="r1=9"):
        LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline={"order": "ASAS", "r1": 9}, **ENGINE)
    with pytest.raises(ValueError, match="r2=4096"):
        LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline={"r2": 4096}, **ENGINE)
    with pytest.raises(ValueError, match="order"):
        LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline={"order": "SASA"}, **ENGINE)
    with pytest.raises(ValueError, match="mesh"):
        LLM(path, dtype="float32", pipeline="findep", **ENGINE)
    # a profile made for another mesh is refused, naming the field
    other = chooser.profile.model_copy(update={"mesh": "cpu-4a4e-00000000"})
    bad = tmp_path / "other.json"
    other.save(bad)
    with pytest.raises(ProfileError, match="mesh 'cpu-4a4e-00000000'"):
        LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline="findep", pipeline_profile=bad, **ENGINE)
    good = tmp_path / "good.json"
    chooser.profile.save(good)
    assert json.loads(good.read_text())["mesh"] == chooser.profile.mesh
    llm = LLM(path, dtype="float32", mesh=LAYOUTS["2a6e"], pipeline="pppipe", pipeline_profile=good, **ENGINE)
    assert llm.engine.executor.pipeline.profile.mesh == chooser.profile.mesh


@pytest.mark.slow
def test_serve_pipeline_option(checkpoint_dir):
    """``jaxmoe serve --pipeline``: a name or a JSON object, handed to the engine's executor."""
    from jaxmoe.assembly import FinDEPConfig, RuntimeConfig, build_engine
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.findep.online import parse_pipeline

    assert parse_pipeline("findep") == "findep"
    assert parse_pipeline('{"order": "AASS", "r1": 2, "r2": 2}') == {"order": "AASS", "r1": 2, "r2": 2}
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_pipeline("{r1: 2}")
    config = EngineConfig(**ENGINE)
    path = str(checkpoint_dir("mixtral"))

    def serve(pipeline):
        return build_engine(
            RuntimeConfig(path, "float32", LAYOUTS["4a4e"], engine=config, findep=FinDEPConfig(pipeline))
        )

    engine = serve(parse_pipeline('{"order": "AASS", "r1": 2}'))
    assert engine.executor.pipeline.fixed == Pipeline(2, "AASS", 1)
    engine = serve("findep")
    assert isinstance(engine.executor.pipeline, SolverChooser)
