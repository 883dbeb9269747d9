"""Model correctness against transformers on tiny random checkpoints of every family (fp32, CPU).

For each (family, variant): prompt logits and >= 8 steps of incremental decode logits match
transformers' forward within 1e-4 (relative to the largest logit), and greedy generation of 32
tokens through the public ``LLM`` API equals transformers' greedy ``generate`` token for token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxmoe import LLM, SamplingParams
from jaxmoe.engine.model_runner import Row
from tiny_checkpoints import VARIANTS, hf_model

CASES = [(f, v) for f, vs in VARIANTS.items() for v in vs]
PROMPT_LEN, DECODE_STEPS = 11, 9


def _rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(b).max())


@pytest.mark.slow
@pytest.mark.parametrize("family,variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_logits_and_greedy_match_transformers(checkpoint_dir, family, variant):
    path = checkpoint_dir(family, variant)
    hf = hf_model(path)
    llm = LLM(path, dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, llm.cfg.vocab_size, (2, PROMPT_LEN + DECODE_STEPS))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()

    # Two sequences of different lengths in one batch, with non-contiguous block tables.
    tables = [[5, 2, 9, 7, 1, 3], [4, 8, 0, 6, 10, 11]]
    runner = llm.engine.runner
    lens = [PROMPT_LEN, PROMPT_LEN - 3]
    rows = [Row(list(tokens[i, :n]), 0, tables[i]) for i, n in enumerate(lens)]
    prompt_logits = np.asarray(runner.forward(rows, all_logits=True))
    for i, n in enumerate(lens):
        assert _rel_err(prompt_logits[i, :n], ref[i, :n]) < 1e-4
    # Incremental decode, one token per step, teacher-forced.
    for step in range(DECODE_STEPS):
        rows = [Row([int(tokens[i, n + step])], n + step, tables[i]) for i, n in enumerate(lens)]
        logits = np.asarray(runner.forward(rows))
        for i, n in enumerate(lens):
            assert _rel_err(logits[i], ref[i, n + step]) < 1e-4, f"decode step {step}, row {i}"

    # Greedy generation of 32 tokens, prompts of different lengths batched together.
    prompts = [list(map(int, tokens[0, :PROMPT_LEN])), list(map(int, tokens[1, :5]))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expect = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[
                0, len(prompt) :
            ].tolist()
        assert out.token_ids == expect
