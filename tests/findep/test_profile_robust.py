"""FinDEP profiles that hold still: compile excluded, medians over repeats taken in rounds, the
agreement of two profiles per stage, and the per-(mesh, model, dtype) cache `jaxmoe plan` and
`LLM(..., pipeline="findep")` read instead of measuring again."""

import json
import pathlib
import random

import pytest

from jaxmoe.findep import measure
from jaxmoe.findep.measure import STATS, Sweep, phase_per_layer, phase_time, time_phases, trimmed_mean
from jaxmoe.findep.paper_profile import paper_profile
from jaxmoe.findep.profile import (
    CACHE_ENV,
    ProfileError,
    agreement,
    cache_path,
    cache_profile,
    cached_profile,
    dims_of,
    mesh_identity,
    model_identity,
)

MESHES = pathlib.Path(__file__).resolve().parents[2] / "meshes"
BASE = {"attention": 2e-3, "a2e": 3e-4, "expert": 4e-3, "e2a": 3e-4}


class FakeExecutor:
    """``forward`` records per-layer phase times drawn around BASE: the first ``compiles`` calls
    compile (and take 100x), calls listed in ``compile_at`` compile too, and a share ``burst`` of the
    calls lands in a burst of load from other processes (2-50x)."""

    def __init__(self, seed: int, compiles: int = 2, compile_at=(), burst: float = 0.2):
        self.rng, self.compiles, self.compile_at, self.burst = random.Random(seed), compiles, set(compile_at), burst
        self.calls, self.compiled = 0, 0
        self.timing, self.timings = False, []

    def forward(self, *args):
        self.calls += 1
        slow = 1.0
        if self.calls <= self.compiles or self.calls in self.compile_at:
            self.compiled += 1
            slow = 100.0
        elif self.rng.random() < self.burst:
            slow = self.rng.uniform(2, 50)
        if self.timing:
            self.timings.append({s: {0: t * slow * self.rng.uniform(0.95, 1.05), 1: t * slow} for s, t in BASE.items()})
        return None


@pytest.fixture
def fake_compiles(monkeypatch):
    holder = {}
    monkeypatch.setattr(measure, "programs_compiled", lambda: holder["executor"].compiled)
    return holder


def test_warm_up_runs_until_nothing_compiles_and_compiling_steps_are_not_timed(fake_compiles):
    ex = fake_compiles["executor"] = FakeExecutor(0, compiles=2, compile_at={5}, burst=0.0)
    records = time_phases(ex, (), repeats=4)
    assert ex.calls == 3 + 5  # two compiling warm-ups + one quiet one; 4 timed steps + 1 that compiled
    assert len(records) == 4 and ex.timing is False
    assert max(r["expert"][0] for r in records) < 2 * BASE["expert"]  # the compile at call 5 is not a sample
    # a shape that compiles at every call is an error, not a sample
    ex = fake_compiles["executor"] = FakeExecutor(0, compiles=100)
    with pytest.raises(ProfileError, match="compiled a program"):
        time_phases(ex, (), repeats=2)


def test_statistics_of_repeats_agree_within_20_percent_under_bursts_of_load(fake_compiles):
    """Two runs with independent load (a fifth of the steps 2-50x slower): the least, the median and
    the trimmed mean per stage land within 20 % of the other run's; the mean, and a single step, do not."""
    assert Sweep().stat == "min"
    per_stat = {}
    for stat in ("min", "median", "trimmed", "mean", "single"):
        runs = []
        for seed in (1, 2):
            ex = fake_compiles["executor"] = FakeExecutor(seed, compiles=1, burst=0.2)
            if stat == "single":
                records = time_phases(ex, (), repeats=9)
                runs.append({s: phase_per_layer(records[:1], s, [0, 1]) for s in BASE})
                continue
            agg = {"mean": lambda v: sum(v) / len(v)}.get(stat) or STATS[stat]
            records = time_phases(ex, (), repeats=9)
            runs.append({s: phase_per_layer(records, s, [0, 1], agg) for s in BASE})
        per_stat[stat] = max(abs(runs[0][s] - runs[1][s]) / min(runs[0][s], runs[1][s]) for s in BASE)
    assert max(per_stat["min"], per_stat["median"], per_stat["trimmed"]) <= 0.2, per_stat
    assert per_stat["mean"] > 0.2 or per_stat["single"] > 0.2, per_stat
    assert trimmed_mean([1, 2, 3, 100]) == 2.5 and trimmed_mean([5]) == 5
    with pytest.raises(ProfileError, match="stat must be one of"):
        Sweep(stat="mean")
    with pytest.raises(ProfileError, match="warmup"):
        Sweep(warmup=0)


def test_the_least_per_layer_needs_no_step_free_of_bursts():
    """Under load where every step has some layer in a burst (here: each step one of 4 layers 3-10x
    slower, the others within 5 %), the least of the steps' layer means is off by the burst's share;
    the mean over layers of each layer's least (``phase_time`` with ``min``, what the profile uses)
    is the quiet time within 5 %. Other statistics are ``phase_per_layer``'s."""
    rng = random.Random(3)
    layers, quiet = [0, 1, 2, 3], 1e-3
    records = []
    for step in range(8):
        hit = step % 4
        records.append(
            {"expert": {i: quiet * rng.uniform(1.0, 1.05) * (rng.uniform(3, 10) if i == hit else 1) for i in layers}}
        )
    assert phase_time(records, "expert", layers, min) == pytest.approx(quiet, rel=0.05)
    assert phase_per_layer(records, "expert", layers, min) > 1.4 * quiet
    assert phase_time(records, "expert", layers) == phase_per_layer(records, "expert", layers)


def _identity_profile(ckpt, mesh_file, scale=1.0, source="cached test profile"):
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.mesh import load_mesh

    cfg, params, _ = load_model(ckpt, "float32")
    spec = load_mesh(mesh_file)
    base = paper_profile(dims_of(cfg, spec, 4), mesh_identity(spec), model_identity(cfg), "float32")
    stages = {
        name: m.model_copy(update={"alpha": m.alpha * scale, "betas": tuple(b * scale for b in m.betas)})
        for name, m in base.stages
        if m is not None
    }
    samples = {"attention": [[4.0, 64.0, 1.0]], "expert": [[16.0, 1.0]], "a2e": [[1e4, 1.0]], "e2a": [[1e4, 1.0]]}
    return base.model_copy(
        update={"source": source, "stages": base.stages.model_copy(update=stages), "samples": samples}
    )


def test_agreement_per_stage(checkpoint_dir):
    ckpt = checkpoint_dir("mixtral")
    a = _identity_profile(ckpt, MESHES / "cpu-8.yaml")
    b = _identity_profile(ckpt, MESHES / "cpu-8.yaml", scale=1.25)
    same, apart = agreement(a, a), agreement(a, b)
    assert set(same) == {"attention", "a2e", "expert", "e2a"} and max(same.values()) == 0
    assert all(d == pytest.approx(0.25) for d in apart.values()), apart
    assert agreement(b, a) == apart


def test_plan_reuses_the_cached_profile_and_measures_only_without_one(checkpoint_dir, tmp_path, monkeypatch, capsys):
    from jaxmoe.cli import main
    from jaxmoe.findep import commands

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    ckpt, mesh = checkpoint_dir("mixtral"), MESHES / "cpu-8.yaml"
    measured = []

    def fake_measure(model, mesh_file, dtype, sweep):
        measured.append(sweep)
        return _identity_profile(model, mesh_file, source=f"measured #{len(measured)}")

    monkeypatch.setattr(commands, "_measure", fake_measure)
    cmd = ["plan", "--model", str(ckpt), "--mesh", str(mesh), "--dtype", "float32", "--batch", "4", "--json"]
    assert main(cmd) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(measured) == 1 and first["profile"] == "measured #1"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [cache_path(*_key(ckpt, mesh)).name]
    for _ in range(2):  # served from the cache: nothing measured, the same plan
        assert main(cmd) == 0
        out = capsys.readouterr()
        assert _no_timing(json.loads(out.out)) == _no_timing(first)
        assert "using the cached" in out.err
    assert len(measured) == 1
    assert main(cmd + ["--remeasure"]) == 0
    assert len(measured) == 2 and json.loads(capsys.readouterr().out)["profile"] == "measured #2"
    # a cached file for another identity under this name is refused, naming the field
    other = _identity_profile(ckpt, MESHES / "cpu-8-4a4e.yaml")
    other.save(cache_path(*_key(ckpt, mesh)))
    assert main(cmd) == 2
    assert "profile was made for mesh" in capsys.readouterr().err


def _no_timing(plan: dict) -> dict:
    return {k: _no_timing(v) if isinstance(v, dict) else v for k, v in plan.items() if k != "solve_ms"}


def _key(ckpt, mesh_file):
    p = _identity_profile(ckpt, mesh_file)
    return p.mesh, p.model, p.dtype


def test_llm_findep_uses_the_cached_profile(checkpoint_dir, tmp_path, monkeypatch):
    from jaxmoe import LLM

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    ckpt, mesh = checkpoint_dir("mixtral"), MESHES / "cpu-8.yaml"
    engine = dict(dtype="float32", mesh=str(mesh), num_blocks=32, block_size=8, max_num_seqs=4)
    no_cache = LLM(ckpt, pipeline="findep", **engine).engine.executor.pipeline.profile
    assert "Fig. 7" in no_cache.source or "paper" in no_cache.source.lower()
    cache_profile(_identity_profile(ckpt, mesh, source="cached for this mesh"))
    assert cached_profile(*_key(ckpt, mesh)).source == "cached for this mesh"
    chooser = LLM(ckpt, pipeline="findep", **engine).engine.executor.pipeline
    assert chooser.profile.source == "cached for this mesh"


@pytest.mark.slow
def test_two_real_profiles_of_one_executor_agree(checkpoint_dir, tmp_path, monkeypatch):
    """Two profiles of the same executor on the cpu-8 mesh (default statistic: the least of the
    repeats), measured one after the other: every stage within 4x. A loose bound: compile time in
    a sample (the 200x gap between two plans seen before) fails it, but on a shared 2-core machine
    the other processes' load can change between the two runs by more than any statistic of one
    run removes (measured: 2-22 % at a steady load average ~22, 79-249 % while it fell from 19 to
    10; bench/results/2026-11-27-findep-dispatch.md)."""
    from jaxmoe.assembly import RuntimeConfig, build_engine
    from jaxmoe.engine.config import EngineConfig
    from jaxmoe.findep.measure import profile_executor

    ckpt = checkpoint_dir("mixtral")
    config = RuntimeConfig(
        model=str(ckpt), dtype="float32", mesh=str(MESHES / "cpu-8.yaml"), engine=EngineConfig(8, 16)
    )
    executor = build_engine(config).executor
    sweep = Sweep(rows=(1, 2, 4), contexts=(16,), repeats=5, host=False)
    a, b = profile_executor(executor, sweep), profile_executor(executor, sweep)
    diffs = agreement(a, b)
    assert set(diffs) >= {"attention", "a2e", "expert", "e2a"}
    assert max(diffs.values()) <= 3.0, diffs
