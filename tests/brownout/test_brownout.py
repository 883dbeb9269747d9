"""BrownoutServe: Algorithm 1 against a direct reading, brownout in the monolithic expert computation
(threshold 1 = the exact model, any threshold = a plain jnp reference, no recompile when it moves),
per-phase thresholds (prefill and decode each follow their own), united experts (`jaxmoe unite`) and
the Experts Loader (united experts of another k loaded at run time), SALC (Algorithm 2, one per
phase) and the SLO analyzer, bad input."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe import LLM, BrownoutConfig, BrownoutError, SamplingParams
from jaxmoe.brownout.routing import BrownoutRouting, set_threshold, split, split_reference
from jaxmoe.models.routing import TopKRouting
from jaxmoe.brownout.routing import threshold as brownout_threshold
from jaxmoe.brownout.salc import SALC, SLOAnalyzer
from jaxmoe.compilation import compile_events
from jaxmoe.models.common import swiglu_mlp
from jaxmoe.models.experts import moe_layer

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 9, 27, 81, 11], [5, 25, 17], [2, 4, 8, 16, 32, 64]]


def _ids_with_counts(counts):
    """Top-1 routing whose per-expert counts are ``counts``."""
    return np.concatenate([[e] * c for e, c in enumerate(counts)]).astype(np.int32)[:, None]


def test_the_papers_worked_example():
    """Fig. 4b / 5a: 8 experts, 20 tokens with counts 2, 4, 1, 5, 2, 1, 2, 3, threshold 0.6: S1 = {E1, E3,
    E7}; with k = 4, UE0 takes E0 and E2, UE1 takes E4, E5 and E6 (5 expert accesses instead of 8)."""
    ids = _ids_with_counts([2, 4, 1, 5, 2, 1, 2, 3])
    valid = np.ones(len(ids), bool)
    orig, united = split_reference(ids, valid, np.arange(8) // 4, 0.6, full=False)
    assert set(np.unique(orig[orig >= 0])) == {1, 3, 7}
    assert {int(e): int(u) for e, u in zip(ids[:, 0], united[:, 0]) if u >= 0} == {0: 0, 2: 0, 4: 1, 5: 1, 6: 1}
    # k = 3: groups {0,1,2} {3,4,5} {6,7}: E6 is alone in its group's S2 part -> keeps its original expert
    orig, united = split_reference(ids, valid, np.arange(8) // 3, 0.6, full=False)
    assert set(np.unique(orig[orig >= 0])) == {1, 3, 7, 6}
    assert set(np.unique(united[united >= 0])) == {0, 1}
    orig, united = split_reference(ids, valid, np.arange(8) // 4, 0.6, full=True)  # full: S2 dropped
    assert set(np.unique(orig[orig >= 0])) == {1, 3, 7} and (united < 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_split_equals_the_direct_reading(seed):
    rng = np.random.default_rng(seed)
    E, K, T = [(8, 2, 40), (16, 4, 64), (8, 1, 7), (12, 3, 30), (6, 2, 100), (16, 2, 5)][seed]
    f = jax.jit(split, static_argnames="full")
    for trial in range(12):
        ways = [w for w in (2, 3, 4) if E % w == 0][trial % 2]
        groups = np.arange(E) // ways if trial % 3 else rng.permutation(np.arange(E) // ways)
        probs = rng.dirichlet(np.full(E, 0.3))
        ids = np.stack([rng.choice(E, K, replace=False, p=probs) for _ in range(T)]).astype(np.int32)
        valid = rng.random(T) > 0.2
        threshold = float(rng.choice([0.0, 1.0, rng.random()]))
        full = bool(trial % 4 == 3)
        want = split_reference(ids, valid, groups, threshold, full)
        got = f(jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(groups, jnp.int32), jnp.float32(threshold), full=full)
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        np.testing.assert_array_equal(np.asarray(got[1]), want[1])


def _layer(rng, E=8, D=16, F=24, U=4):
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    return {
        "router": w(D, E),
        "w_gate": w(E, D, F),
        "w_up": w(E, D, F),
        "w_down": w(E, F, D),
        "united": {"w_gate": w(U, D, F), "w_up": w(U, D, F), "w_down": w(U, F, D)},
        "united_groups": jnp.asarray(np.arange(E) // (E // U), jnp.int32),
    }


@pytest.mark.slow
def test_moe_layer_with_brownout_equals_a_plain_reference(checkpoint_dir):
    """eq. 5: original experts for S1, united experts (same weights g) for S2, computed per token;
    padding tokens (not valid) activate no expert."""
    from jaxmoe.config import load_config
    from jaxmoe.models.router import route

    cfg = load_config(checkpoint_dir("mixtral"))  # 8 experts, top-2, softmax routing
    rng = np.random.default_rng(0)
    p = _layer(rng, D=cfg.hidden_size)
    x = jnp.asarray(rng.standard_normal((37, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(rng.random(37) > 0.1)
    plain = moe_layer(p, cfg, x, valid=valid)  # top-k
    for threshold, full in ((1.0, False), (0.55, False), (0.0, False), (0.4, True)):
        routing = BrownoutRouting(full)
        got = moe_layer(routing.logical_params(p), cfg, x, None, routing, valid, jnp.float32(threshold))
        ids, weights = route(p, cfg.moe, x)
        orig, united = split_reference(
            np.asarray(ids), np.asarray(valid), np.asarray(p["united_groups"]), threshold, full
        )
        want = np.zeros(x.shape, np.float32)
        for t in np.flatnonzero(np.asarray(valid)):
            for j in range(ids.shape[1]):
                g = float(weights[t, j])
                if orig[t, j] >= 0:
                    want[t] += g * np.asarray(
                        swiglu_mlp({k: p[k][orig[t, j]] for k in ("w_gate", "w_up", "w_down")}, x[t])
                    )
                if united[t, j] >= 0:
                    want[t] += g * np.asarray(swiglu_mlp({k: v[united[t, j]] for k, v in p["united"].items()}, x[t]))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
        if threshold == 1.0:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))  # zero brownout: exact
            # ... and no extra work: the expert FFN gets exactly top-k's (token, expert) rows
            b_ids, _ = routing.route(routing.logical_params(p), cfg.moe, x, valid, jnp.float32(1.0))
            k_ids, _ = TopKRouting().route(p, cfg.moe, x, valid)
            assert _rows(b_ids) == _rows(k_ids)


def _rows(ids):
    """The (token, expert) rows an expert FFN computes for ids [T, K] (-1: none), sorted."""
    ids = np.asarray(ids)
    t, k = np.nonzero(ids >= 0)
    return sorted(zip(t.tolist(), ids[t, k].tolist()))


@pytest.fixture(scope="module")
def united_dir(checkpoint_dir, tmp_path_factory):
    from jaxmoe.brownout.united import unite

    corpus = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "glob.py"):
        shutil.copy(stdlib / name, corpus / name)
    out = tmp_path_factory.mktemp("united") / "m"
    report = unite(checkpoint_dir("mixtral"), 2, out, tokens=1024, steps=60, corpus=str(corpus), progress=False)
    return out, report


@pytest.mark.slow
def test_unite_writes_united_experts(united_dir):
    out, report = united_dir
    assert (out / "united_experts.safetensors").exists() and (out / "brownout.json").exists()
    assert sorted(report) == [0, 1]
    for r in report.values():
        assert r["groups"] == [0, 0, 1, 1, 2, 2, 3, 3] and len(r["losses"]) == 4
        assert all(np.isfinite(v) and v >= 0 for v in r["losses"])


@pytest.mark.slow
def test_distillation_lowers_eq4_from_the_group_mean_start(united_dir):
    """Each united expert's eq. 4 loss after training is well below its value at the group-mean start
    (both reported by ``unite`` and saved in brownout.json)."""
    import json

    out, report = united_dir
    meta = json.loads((out / "brownout.json").read_text())
    for i, r in report.items():
        assert meta["layers"][str(i)]["initial_losses"] == r["initial_losses"]
        assert len(r["initial_losses"]) == len(r["losses"]) == 4
        for start, end in zip(r["initial_losses"], r["losses"]):
            assert end < 0.8 * start, (i, r)


@pytest.mark.slow
def test_threshold_one_is_the_original_model_and_moving_it_does_not_recompile(united_dir, checkpoint_dir):
    out, _ = united_dir
    want = [o.token_ids for o in LLM(checkpoint_dir("mixtral"), dtype="float32").generate(PROMPTS, GREEDY)]
    llm = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=1.0))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    before = compile_events()["programs"]
    for threshold in (0.5, 0.0, 0.8):
        set_threshold(llm.executor, threshold)
        outs = llm.generate(PROMPTS, GREEDY)
        assert all(len(o.token_ids) == 8 for o in outs)
    assert compile_events()["programs"] == before
    # the prefix cache: KV of the exact model (threshold 1) serves a browned-out step (SALC moves the
    # threshold every step: keyed by the threshold alone, no prompt would hit); browned-out KV never
    # serves threshold 1, which keeps the original's tokens
    exact, browned = [list(range(3, 23))], [list(range(40, 60))]  # 20 tokens: one full block of 16
    original = LLM(checkpoint_dir("mixtral"), dtype="float32").generate(browned, GREEDY)[0].token_ids
    set_threshold(llm.executor, 1.0)
    assert llm.generate(exact, GREEDY)[0].num_cached_tokens == 0
    set_threshold(llm.executor, 0.3)
    assert llm.generate(exact, GREEDY)[0].num_cached_tokens == 16
    assert llm.generate(browned, GREEDY)[0].num_cached_tokens == 0
    assert llm.generate(browned, GREEDY)[0].num_cached_tokens == 16  # the same threshold: its own KV
    set_threshold(llm.executor, 1.0)
    out = llm.generate(browned, GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == original


def _by_hand(llm, prompts, sampling, prefill: float, decode: float):
    """The oracle of per-phase thresholds from the single-threshold mechanism: one step serving every
    prompt's prefill (each gets its first token; prompt scoring runs in it too) at ``prefill``, the
    rest of the steps at ``decode``."""
    set_threshold(llm.executor, prefill)
    ids = [llm.engine.add_request(p, sampling) for p in prompts]
    first = {o.request_id: len(o.token_ids) for o in llm.engine.step()}
    assert first == {r: 1 for r in ids}  # the prefills (and only they) ran in the first step
    set_threshold(llm.executor, decode)
    final = llm.engine.run_until_done()
    return [final[r].token_ids for r in ids]


@pytest.mark.slow
def test_prefill_and_decode_follow_their_own_thresholds(united_dir):
    """The paper's one threshold per phase: prefill at 1 and decode at 0 gives the original model's
    prompt logprobs and the tokens of an oracle that runs the prefill step at threshold 1 and the
    decode steps at 0 by hand (browned-out decode tokens: not the original ones); swapped (prefill 0,
    decode 1), the prompt logprobs move and the tokens follow the swapped oracle."""
    out, _ = united_dir
    scored = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=0)

    def prompt_lps(outs):
        return [t.logprob for o in outs for t in o.prompt_logprobs if t is not None]

    llm = LLM(out, dtype="float32", brownout=BrownoutConfig(prefill_threshold=1.0, decode_threshold=0.0))
    assert (brownout_threshold(llm.executor, "prefill"), brownout_threshold(llm.executor, "decode")) == (1.0, 0.0)
    split = llm.generate(PROMPTS, scored)
    set_threshold(llm.executor, 0.0, "prefill")
    set_threshold(llm.executor, 1.0, "decode")
    swapped = llm.generate(PROMPTS, scored)
    # the oracles, on the same engine with one threshold for both phases
    oracle = {(p, d): _by_hand(llm, PROMPTS, scored, p, d) for p, d in ((1.0, 0.0), (0.0, 1.0))}
    set_threshold(llm.executor, 1.0)
    original = llm.generate(PROMPTS, scored)
    assert oracle[1.0, 0.0] != [o.token_ids for o in original]  # decode at 0 does brown out
    assert prompt_lps(split) == pytest.approx(prompt_lps(original), rel=1e-6, abs=1e-7)
    assert [o.token_ids for o in split] == oracle[1.0, 0.0]
    assert prompt_lps(swapped) != pytest.approx(prompt_lps(original), rel=1e-3)
    assert [o.token_ids for o in swapped] == oracle[0.0, 1.0]
    with pytest.raises(BrownoutError, match="brownout phase must be 'prefill' or 'decode', got 'ttft'"):
        set_threshold(llm.executor, 0.5, "ttft")
    with pytest.raises(BrownoutError, match=r"brownout decode_threshold must be a number in \[0, 1\], got 2"):
        BrownoutConfig(decode_threshold=2)


@pytest.mark.slow
def test_ways_that_do_not_divide_the_experts_give_a_short_last_group(checkpoint_dir, tmp_path, united_dir):
    """The paper's k = 3, m = 8 example: ceil(8 / 3) = 3 united experts over groups of 3, 3 and 2;
    threshold 1 is still the original model, and lower thresholds run (the special case keeps a lone
    browned-out expert of a group).

    The Experts Loader on these k = 3 experts: an engine serving k = 2 loads them at run time
    (``LLM.load_united_experts``) with a request in flight, which goes on and, at threshold 1, keeps
    the original tokens; at threshold 0 it then gives the tokens of an engine started with k = 3;
    ``POST /admin/united_experts`` loads k = 2 back (the tokens of k = 2 again) and refuses a
    directory without united experts with 400, the server still serving."""
    from jaxmoe.brownout.united import unite

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py"):
        shutil.copy(stdlib / name, corpus / name)
    out = tmp_path / "u3"
    report = unite(checkpoint_dir("mixtral"), 3, out, tokens=512, steps=5, corpus=str(corpus), progress=False)
    for r in report.values():
        assert r["groups"] == [0, 0, 0, 1, 1, 1, 2, 2] and len(r["losses"]) == 3
    want = [o.token_ids for o in LLM(checkpoint_dir("mixtral"), dtype="float32").generate(PROMPTS, GREEDY)]
    llm = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=1.0))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.executor.num_logical_experts == 8 + 3  # E originals + ceil(E / k) united experts
    set_threshold(llm.executor, 0.0)
    three = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(len(t) == 8 for t in three)

    import http.client
    import json

    from jaxmoe.server.app import ServeOptions, ServerThread

    two = LLM(united_dir[0], dtype="float32", brownout=BrownoutConfig(threshold=0.0))
    two_low = [o.token_ids for o in two.generate(PROMPTS, GREEDY)]
    assert two_low != three  # k = 2 and k = 3 brown out differently
    set_threshold(two.executor, 1.0)
    rid = two.engine.add_request(PROMPTS[0], GREEDY)
    two.engine.step()
    two.engine.step()
    assert two.load_united_experts(out) == {"ways": 3, "grouping": "index", "united_experts": 3, "logical_experts": 11}
    assert two.engine.run_until_done()[rid].token_ids == want[0]  # in flight across the swap
    set_threshold(two.executor, 0.0)
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == three
    st = ServerThread(two.engine, ServeOptions(warmup=False))
    server = st.start()
    try:
        answers = []
        for path in (united_dir[0], checkpoint_dir("mixtral")):
            conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
            body = json.dumps({"path": str(path)})
            conn.request("POST", "/admin/united_experts", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answers.append((resp.status, json.loads(resp.read())))
    finally:
        st.stop()
    assert answers[0] == (200, {"ways": 2, "grouping": "index", "united_experts": 4, "logical_experts": 12})
    assert answers[1][0] == 400 and "has no united experts" in answers[1][1]["error"]["message"]
    assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == two_low


@pytest.mark.slow
def test_brownout_on_quantized_weights(united_dir):
    """United experts on a model quantized on load: they are quantized by the same method, threshold 1
    is the quantized model's tokens (int8 and fp8), threshold 0 gives the same tokens on the
    disaggregated executor as on the monolithic one, and the Experts Loader swaps quantized united
    experts (this raised a TypeError before: united experts were cast to the int8 dtype)."""
    from jaxmoe.quantization import Quantized

    out, _ = united_dir
    for method in ("int8", "fp8"):
        plain = [o.token_ids for o in LLM(out, dtype="float32", quantization=method).generate(PROMPTS, GREEDY)]
        llm = LLM(out, dtype="float32", quantization=method, brownout=BrownoutConfig(threshold=1.0))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain, method
    set_threshold(llm.executor, 0.0)
    low = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert low != plain  # the united experts serve
    layer = next(layer for layer in llm.executor.params["layers"] if "moe" in layer)
    assert isinstance(layer["moe"]["w_up"], Quantized) and layer["moe"]["w_up"].shape[0] == 8 + 4
    mesh = LLM(
        out, dtype="float32", quantization="fp8", mesh="meshes/cpu-8.yaml", brownout=BrownoutConfig(threshold=0.0)
    )
    assert [o.token_ids for o in mesh.generate(PROMPTS, GREEDY)] == low
    assert llm.load_united_experts(out)["logical_experts"] == 12  # the loader takes quantized united experts
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == low


@pytest.mark.slow
def test_eval_with_brownout(united_dir, capsys, tmp_path):
    import json

    from jaxmoe.cli import main

    out, _ = united_dir
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha beta gamma delta\n" * 200)
    (corpus / "b.txt").write_text("one two three four five\n" * 200)
    args = [
        "eval",
        "--model",
        str(out),
        "--corpus",
        str(corpus),
        "--heldout-fraction",
        "0.5",
        "--seq-len",
        "32",
        "--max-tokens",
        "256",
        "--json",
    ]
    results = []
    for extra in ([], ["--brownout-threshold", "1.0"], ["--brownout-threshold", "0.0"]):
        assert main(args + extra) == 0
        results.append(json.loads(capsys.readouterr().out)["perplexity"])
    assert results[1] == pytest.approx(results[0], rel=1e-4)  # zero brownout: the model itself
    assert results[2] != pytest.approx(results[0], rel=1e-6)


@pytest.mark.slow
def test_bad_brownout_input(checkpoint_dir, tmp_path, capsys):
    from jaxmoe.brownout.united import unite
    from jaxmoe.cli import main

    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(BrownoutError, match=rf"threshold must be a number in \[0, 1\], got {bad!r}"):
            BrownoutConfig(threshold=bad)
    with pytest.raises(BrownoutError, match="ways 1 must be an integer from 2 to the 8 experts"):
        unite(checkpoint_dir("mixtral"), 1, tmp_path / "x", progress=False)
    assert main(["unite", "--model", str(checkpoint_dir("mixtral")), "--ways", "16", "--out", str(tmp_path / "y")]) == 2
    assert "ways 16 must be an integer from 2 to the 8 experts" in capsys.readouterr().err
    with pytest.raises(BrownoutError, match=f"{checkpoint_dir('mixtral')} has no united experts"):
        LLM(checkpoint_dir("mixtral"), brownout=BrownoutConfig(0.5))
    llm = LLM(checkpoint_dir("mixtral"), dtype="float32", num_blocks=8)
    with pytest.raises(ValueError, match="built without brownout"):
        set_threshold(llm.executor, 0.5)
    with pytest.raises(BrownoutError, match="load united experts: this engine runs without brownout"):
        llm.load_united_experts(checkpoint_dir("mixtral"))
    assert main(["eval", "--model", str(checkpoint_dir("mixtral")), "--brownout-threshold", "2"]) == 2
    assert "threshold must be a number in [0, 1], got 2.0" in capsys.readouterr().err
    for kw, msg in (
        (dict(slo=0), "SALC slo must be > 0, got 0"),
        (dict(slo=1, warning_factor=1.5), r"SALC warning_factor must be in \(0, 1\], got 1.5"),
        (dict(slo=1, increment=0), r"SALC increment must be in \(0, 1\], got 0"),
        (dict(slo=1, shrink_ratio=1.0), r"SALC shrink_ratio must be in \(0, 1\), got 1.0"),
        (dict(slo=float("inf")), "SALC slo must be > 0, got inf"),
    ):
        with pytest.raises(BrownoutError, match=msg):
            SALC(**kw)
    from jaxmoe.brownout.controller import SALCConfig

    for kw, msg in (
        (dict(slo_tpot_s=-0.1), "SALC slo_tpot_s must be > 0 seconds, got -0.1"),
        (dict(slo_ttft_s=1.0, window_s=0), "SALC window must be > 0 seconds, got 0"),
        (dict(slo_ttft_s=1.0, shrink_ratio=2.0), r"SALC shrink_ratio must be in \(0, 1\), got 2.0"),
    ):
        with pytest.raises(BrownoutError, match=msg):
            SALCConfig(**kw)
    serve = ["serve", "--model", str(checkpoint_dir("mixtral")), "--grpc-port", "0", "--http-port", "0"]
    assert main(serve + ["--salc", "--slo-tpot-ms", "100", "--salc-shrink-ratio", "1.5"]) == 2
    assert "SALC shrink_ratio must be in (0, 1), got 1.5" in capsys.readouterr().err
    assert main(serve + ["--salc"]) == 2
    assert "SALC needs an SLO" in capsys.readouterr().err
    assert main(serve + ["--brownout-threshold", "-1"]) == 2
    assert "--brownout-threshold: must be in [0, 1], got -1.0" in capsys.readouterr().err  # before the model loads
    assert main(serve + ["--brownout-threshold", "0.5"]) == 2  # the checkpoint has no united experts
    assert "has no united experts" in capsys.readouterr().err


def test_salc_is_algorithm_2():
    """Below warning_factor x slo: + increment (capped at 1); above slo: x shrink_ratio; between: kept."""
    salc = SALC(slo=1.0, threshold=0.5)
    got = [salc.update(v) for v in (0.5, 0.9, 1.2, 1.2, 0.7, None, 0.81, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1)]
    want, t = [], 0.5
    for v in (0.5, 0.9, 1.2, 1.2, 0.7, None, 0.81, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1):
        if v is not None:
            t = min(1.0, t + 0.1) if v < 0.8 else (t * 0.8 if v > 1.0 else t)
        want.append(t)
    assert got == pytest.approx(want)
    assert got[-1] == 1.0


def test_slo_analyzer_p90_over_a_sliding_window():
    now = [0.0]
    a = SLOAnalyzer(window_s=10.0, clock=lambda: now[0])
    for i in range(100):
        now[0] = i * 0.1
        a.record("tpot", float(i))
    assert a.p90("tpot") == pytest.approx(np.percentile(np.arange(100), 90))
    now[0] = 25.0
    a.record("tpot", 1.0)
    assert a.p90("tpot") == 1.0 and a.p90("ttft") is None
    with pytest.raises(BrownoutError, match="phase"):
        a.record("e2e", 1.0)
    # the sorted window gives np.percentile's P90 to the last bit as samples arrive and expire (ties too)
    rng, seen, b = np.random.default_rng(0), [], SLOAnalyzer(window_s=1.0, clock=lambda: now[0])
    for i in range(400):
        now[0] = i * 0.01
        for v in rng.choice([0.25, 0.5, rng.random()], size=rng.integers(0, 4)):
            b.record("tpot", v)
            seen.append((now[0], float(v)))
        window = [v for t, v in seen if t >= now[0] - 1.0]
        assert b.samples("tpot") == window
        assert b.p90("tpot") == (float(np.percentile(window, 90)) if window else None)


@pytest.mark.slow
def test_salc_moves_the_threshold_of_a_serving_engine(united_dir):
    """A TPOT SLO no step can meet shrinks the decode threshold (the TPOT SALC's phase) and leaves the
    prefill one; both gauges (``jaxmoe_brownout_threshold{phase}``) and the P90 are exported."""
    import http.client

    from jaxmoe.brownout.controller import BrownoutController, SALCConfig
    from jaxmoe.server.app import ServeOptions, ServerThread

    out, _ = united_dir
    llm = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=1.0))
    ctl = BrownoutController.attach(llm.engine, SALCConfig(slo_tpot_s=1e-6, window_s=60.0))
    llm.generate(PROMPTS, GREEDY)
    decode = ctl.state()["threshold"]["decode"]
    assert decode < 0.5 and ctl.state()["p90"]["tpot"] > 1e-6
    assert ctl.state()["threshold"] == {"prefill": 1.0, "decode": decode}  # no TTFT SLO: prefill not moved
    assert brownout_threshold(llm.executor, "decode") == decode
    st = ServerThread(llm.engine, ServeOptions(warmup=False))
    server = st.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        st.stop()
    assert 'jaxmoe_brownout_threshold{phase="prefill"} 1.0' in text
    assert f'jaxmoe_brownout_threshold{{phase="decode"}} {decode}' in text
    assert 'jaxmoe_slo_p90_seconds{phase="tpot"}' in text
    relaxed = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=0.5))
    ctl = BrownoutController.attach(relaxed.engine, SALCConfig(slo_tpot_s=60.0))
    relaxed.generate(PROMPTS, GREEDY)
    assert ctl.state()["threshold"] == {"prefill": 0.5, "decode": 1.0}  # under the TPOT SLO: decode back to 1
    with pytest.raises(BrownoutError, match="needs an SLO"):
        SALCConfig()


@pytest.mark.slow
def test_salc_tpot_samples_are_per_token(united_dir):
    """Every decoded token is one TPOT sample (the time since its request's previous token), so the
    P90 is over tokens: 3 requests x 7 tokens after the first = 21 samples, 3 TTFT samples."""
    from jaxmoe.brownout.controller import BrownoutController, SALCConfig

    out, _ = united_dir
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]

    llm = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=1.0))
    ctl = BrownoutController.attach(llm.engine, SALCConfig(slo_tpot_s=60.0, window_s=1e6), clock=clock)
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(len(o.token_ids) - 1 for o in outs) == 21
    assert len(ctl.analyzer.samples("tpot")) == 21 and len(ctl.analyzer.samples("ttft")) == 3
    assert all(v > 0 for v in ctl.analyzer.samples("tpot"))


@pytest.mark.slow
def test_salc_period_spaces_the_updates(united_dir):
    """With ``period_s`` Algorithm 2 runs at most once per period (samples are still taken every
    step): on a frozen clock one update, one shrink (1.0 x 0.8); without a period, one per step."""
    from jaxmoe.brownout.controller import BrownoutController, SALCConfig

    out, _ = united_dir
    got = {}
    for period in (100.0, 0.0):
        llm = LLM(out, dtype="float32", brownout=BrownoutConfig(threshold=1.0))
        ctl = BrownoutController(llm.executor, SALCConfig(slo_ttft_s=1e-9, period_s=period), clock=lambda: 0.0)
        llm.engine.add_hook(ctl)
        llm.generate(PROMPTS, GREEDY)
        got[period] = ctl.state()["threshold"]["prefill"]  # the TTFT SALC's phase
    assert got[100.0] == pytest.approx(0.8)
    assert got[0.0] < 0.8 * 0.8
    with pytest.raises(BrownoutError, match="SALC period must be >= 0 seconds, got -1"):
        SALCConfig(slo_ttft_s=1.0, period_s=-1)


@pytest.mark.parametrize("seed,ways", [(0, 2), (1, 2), (2, 4)])
def test_coactivation_grouping_recovers_planted_groups(seed, ways):
    from jaxmoe.brownout.united import group_by_coactivation

    rng = np.random.default_rng(seed)
    E = 8
    planted = rng.permutation(E).reshape(E // ways, ways)  # hidden groups the router favours
    rows = []
    for _ in range(400):
        if rng.random() < 0.8:  # two distinct experts of one planted group
            rows.append(rng.choice(planted[rng.integers(len(planted))], 2, replace=False))
        else:  # noise: any two distinct experts
            rows.append(rng.choice(E, 2, replace=False))
    groups = group_by_coactivation(np.asarray(rows), E, ways)
    got = sorted(sorted(np.flatnonzero(groups == g).tolist()) for g in range(E // ways))
    assert got == sorted(sorted(g.tolist()) for g in planted)


@pytest.mark.slow
def test_distil_with_coactivation_grouping(checkpoint_dir):
    from jaxmoe.brownout.united import distill_layer, group_by_coactivation
    from jaxmoe.checkpoint.model import load_model
    from jaxmoe.models.router import route

    cfg, params, _ = load_model(checkpoint_dir("mixtral"), "float32")
    moe = params["layers"][0]["moe"]
    xs = np.random.default_rng(0).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    united, groups, losses = distill_layer(moe, cfg, xs, 2, "coactivation", steps=3, lr=1e-3, seed=0)
    ids, _ = route({k: v for k, v in moe.items() if k not in ("w_gate", "w_up", "w_down")}, cfg.moe, jnp.asarray(xs))
    np.testing.assert_array_equal(groups, group_by_coactivation(np.asarray(ids), 8, 2))
    assert sorted(np.bincount(groups).tolist()) == [2, 2, 2, 2]
    assert united["w_gate"].shape[0] == 4 and len(losses["final"]) == 4 and all(np.isfinite(losses["final"]))
    with pytest.raises(BrownoutError, match="grouping must be one of"):
        distill_layer(moe, cfg, xs, 2, "bogus", steps=1, lr=1e-3, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_activated_experts_counts_the_weights_a_step_reads(seed):
    from jaxmoe.brownout.routing import activated_experts

    rng = np.random.default_rng(seed)
    E, ways, T = 8, 2, 24
    groups = np.arange(E) // ways
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(T)])
    valid = rng.random(T) < 0.8
    count = jax.jit(activated_experts, static_argnums=(3, 4))
    for threshold, full in ((1.0, False), (0.5, False), (0.0, False), (0.3, True)):
        orig, united = split_reference(ids, valid, groups, threshold, full)
        got = count(jnp.asarray(orig), jnp.asarray(united), jnp.asarray(valid), E, E // ways)
        want = (
            len({e for t in np.flatnonzero(valid) for e in orig[t] if e >= 0}),
            len({u for t in np.flatnonzero(valid) for u in united[t] if u >= 0}),
        )
        assert tuple(int(v) for v in got) == want
        if threshold == 1.0:
            assert want == (len(set(ids[valid].ravel())), 0)
    every = np.array([[2 * i, 2 * i + 1] for i in range(E // 2)] * 2)  # all 8 experts used
    orig, united = split_reference(every, np.ones(len(every), bool), groups, 0.0, False)
    assert tuple(int(v) for v in activated_experts(orig, united, np.ones(len(every), bool), E, 4)) == (0, 4)


@pytest.mark.slow
def test_expert_queues_with_brownout(united_dir):
    """QLLM's per-expert queues combined with brownout (monolithic executor, united experts loaded:
    the queues are over the E + U logical experts, the threshold is applied by the routing before the
    assignments enter them). A latency-sensitive prompt arrives between the expert rounds of a
    best-effort decode step and merges into the queues; at threshold 1 every request gets its
    standalone tokens. (Below 1 Algorithm 1 depends on the step's counts, so a merged request has
    no standalone oracle; ``tests/models/test_routing.py`` checks the rounds against the fused
    program there, united experts queued.)"""
    out, _ = united_dir
    llm = LLM(
        out,
        dtype="float32",
        num_blocks=64,
        max_num_seqs=8,
        brownout=BrownoutConfig(threshold=1.0),
        expert_queues=3,
        ls_merge_tokens=None,  # the prompt merges whatever it pads (the cost model would run it nested)
    )
    engine, executor = llm.engine, llm.executor
    E, params = engine.cfg.moe.num_experts, SamplingParams(max_tokens=4, ignore_eos=True)
    be, ls = PROMPTS[:2], PROMPTS[2]
    alone = [llm.generate([p], params, priority="be")[0].token_ids for p in be]
    alone.append(llm.generate([ls], params, priority="ls")[0].token_ids)
    ids = [engine.add_request(p, params, "be") for p in be]
    depths, steps, finished = [], [0], {}

    def poll():  # the LS prompt arrives between the expert rounds of the first decode step
        if executor.pause_stage == "routing":
            depths.append(executor.expert_queue_depth())
        if len(ids) == 2 and steps[0] == 1 and executor.pause_stage == "experts":
            ids.append(engine.add_request(ls, params, "ls"))

    engine.poll = poll
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.token_ids
        steps[0] += 1
    assert [finished[i] for i in ids] == alone and engine.layer_hook.queue_merges == 1
    assert len(depths[0]) == executor.num_logical_experts > E  # queues at united experts too (none used at 1)
    assert all(d[E:].sum() == 0 for d in depths) and all(d[:E].sum() > 0 for d in depths)
