"""Training (``jaxmoe train`` / ``jaxmoe eval``): a tiny run learns, resumes exactly, exports a
checkpoint that jaxmoe and transformers read with the same greedy tokens; bad settings fail early."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.train.config import PRESETS
from jaxmoe.train.corpus import CorpusError, load_corpus
from jaxmoe.train.loop import train

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = [
    "textwrap.py",
    "string.py",
    "bisect.py",
    "heapq.py",
    "shlex.py",
    "glob.py",
    "fnmatch.py",
    "colorsys.py",
    "keyword.py",
    "reprlib.py",
    "numbers.py",
    "contextlib.py",
    "calendar.py",
    "queue.py",
    "sched.py",
    "abc.py",
    "copy.py",
    "random.py",
    "pprint.py",
    "difflib.py",
    "statistics.py",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small folder of standard-library sources (fast to tokenize)."""
    folder = tmp_path_factory.mktemp("corpus")
    for name in MODULES:
        shutil.copy(STDLIB / name, folder / name)
    return folder


def tiny(corpus: Path, **kw):
    return dataclasses.replace(PRESETS["tiny"], corpus=str(corpus), heldout_fraction=0.2, **kw)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run")
    return out, train(tiny(corpus, steps=40), out, progress=False, log=lambda *_: None)


@pytest.mark.slow
def test_tiny_run_learns_and_reports(trained):
    out, report = trained
    assert report["steps"] == 40 and report["train_tokens"] == 40 * 8 * 32
    progress = json.loads((out / "progress.json").read_text())
    assert progress["step"] == 40
    # untrained: ln(320) = 5.77 nats; trained on 10k tokens it must be clearly better on held-out text
    assert report["heldout"]["loss"] < 5.2, report["heldout"]
    share = np.asarray(report["expert_share_heldout"])
    assert share.shape == (2, 8) and np.allclose(share.sum(axis=1), 1.0, atol=1e-3) and (share > 0).all()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / "model" / name).exists(), name


@pytest.mark.slow
def test_resume_gives_the_same_parameters(corpus, tmp_path, trained):
    """Stopped after 20 steps and resumed: the same export as the uninterrupted 40-step run."""
    from safetensors.numpy import load_file

    out = tmp_path / "resumed"
    assert train(tiny(corpus, steps=40), out, progress=False, log=lambda *_: None, stop_after=20) is None
    report = train(tiny(corpus, steps=40), out, progress=False, log=lambda *_: None)
    assert report["steps"] == 40
    a, b = load_file(trained[0] / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_greedy_tokens(trained):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxmoe import LLM, SamplingParams

    model_dir = trained[0] / "model"
    llm = LLM(model_dir, dtype="float32", num_blocks=64, block_size=8)
    prompt = "def main():\n    "
    ids = llm.tokenizer.encode(prompt)
    ours = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert ours == theirs[0, len(ids) :].tolist()


@pytest.mark.slow
def test_eval_cli_prints_json(trained, corpus, capsys):
    from jaxmoe.cli import main

    model_dir = trained[0] / "model"
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--corpus",
            str(corpus),
            "--heldout-fraction",
            "0.2",
            "--seq-len",
            "32",
            "--max-tokens",
            "2048",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 2048 and 1 < result["perplexity"] < 320
    assert abs(result["perplexity"] - trained[1]["heldout"]["perplexity"]) < 1e-3 * result["perplexity"]


def test_bad_settings_fail_before_training(corpus, tmp_path, capsys):
    from jaxmoe.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(CorpusError, match="holds no text"):
        load_corpus(empty)
    assert main(["train", "--preset", "tiny", "--corpus", str(empty), "--out", str(tmp_path / "a")]) == 2
    assert "holds no text" in capsys.readouterr().err
    with pytest.raises(ValueError, match="top_k=9 is larger than num_experts=8"):
        train(tiny(corpus, top_k=9), tmp_path / "b", progress=False)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ValueError, match="not writable"):
        train(tiny(corpus), blocked / "run", progress=False)
    assert main(["train", "--preset", "nope", "--out", str(tmp_path / "c")]) == 2
    assert "unknown preset" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_cli_scores_a_text_file(trained, tmp_path, capsys):
    from jaxmoe.cli import main

    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    assert (
        main(["eval", "--model", str(trained[0] / "model"), "--text-file", str(text), "--seq-len", "32", "--json"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] > 100 and result["perplexity"] > 1 and result["tokens_per_s"] > 0
