"""The shipped demo model: trained (not random), small enough to ship, readable text, and its
held-out perplexity where training left it."""

from __future__ import annotations

import pytest

import json

from jaxmoe import LLM, SamplingParams
from jaxmoe.demo import DEMO_DIR

MAX_PERPLEXITY = 45.0  # measured: 30.6 on the first 2048 held-out tokens (docs/demo_model.md)


def test_demo_files_ship_in_the_package():
    names = {p.name for p in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert (DEMO_DIR / "model.safetensors").stat().st_size < 25 * 2**20
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 8
    assert config["num_experts_per_tok"] == 2


@pytest.mark.slow
def test_demo_writes_python_and_english():
    llm = LLM("demo", num_blocks=64, block_size=16)
    greedy = SamplingParams(max_tokens=24)
    code, english = llm.generate(["def fibonacci(n):", "The module provides"], greedy)
    for out in (code, english):
        printable = sum(c.isprintable() or c in "\n\t" for c in out.text)
        assert len(out.text) > 20 and printable / len(out.text) > 0.95, out.text
    assert any(word in code.text for word in ("return", "if ", "def ", '"""', "for ")), code.text
    assert sum(c.isalpha() or c == " " for c in english.text) / len(english.text) > 0.7, english.text


@pytest.mark.slow
def test_demo_held_out_perplexity(capsys):
    from jaxmoe.cli import main

    assert main(["eval", "--model", "demo", "--max-tokens", "2048", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 2048 and result["perplexity"] < MAX_PERPLEXITY
    assert all(min(row) > 0.01 for row in result["expert_share"])  # every expert is used
