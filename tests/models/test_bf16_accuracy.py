"""bf16 accuracy against transformers: jaxmoe's bfloat16 logprobs, teacher-forced on the fp32 greedy
tokens, are no further from the fp32 reference than transformers' own bfloat16 logprobs (mean and
max over every scored position; bench/bf16_accuracy.py measures the same on larger checkpoints and
against vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxmoe import LLM, SamplingParams
from jaxmoe.pallas_kernels.expert_ffn import cpu_kernel
from tiny_checkpoints import hf_model

PROMPTS, PROMPT_LEN, NEW = 4, 8, 40


def _scores(model, seqs: torch.Tensor) -> np.ndarray:
    """transformers' logprob of every token after the prompt, given the tokens before it."""
    with torch.no_grad():
        logp = torch.log_softmax(model(seqs).logits.float()[:, PROMPT_LEN - 1 : -1], dim=-1)
    return torch.gather(logp, -1, seqs[:, PROMPT_LEN:, None])[..., 0].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("bf16_dot", [False, True], ids=["widened", "bf16-pairs"])
def test_bf16_logprob_error_no_larger_than_transformers(checkpoint_dir, monkeypatch, bf16_dot):
    """``bf16-pairs``: the expert weights in the layout of a CPU with AVX512-BF16 (the kernel widens
    the pairs where the CPU has no bf16 dot: the same rounding). ``widened`` scores the prompts in
    32-token chunks, where the CPU kernel reads the bf16 LM head in place (``lm_head(in_place=True)``,
    as in decode steps); ``bf16-pairs`` in one 64-token chunk, by XLA's dot."""
    monkeypatch.setattr(cpu_kernel, "has_bf16_dot", lambda: bf16_dot)
    calls = []  # layer_matmul's (rows, matrix shape), recorded as programs are traced
    matmul = cpu_kernel.layer_matmul

    def recording(x, stack, layer):
        calls.append((x.size // x.shape[-1], stack.shape))
        return matmul(x, stack, layer)

    monkeypatch.setattr(cpu_kernel, "layer_matmul", recording)
    path = checkpoint_dir("mixtral")
    hf = hf_model(path)
    hf.generation_config.eos_token_id = None
    prompts = torch.tensor(np.random.default_rng(3).integers(3, hf.config.vocab_size, (PROMPTS, PROMPT_LEN)))
    with torch.no_grad():
        seqs = hf.generate(prompts, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    reference = _scores(hf, seqs)
    theirs = np.abs(_scores(hf.to(torch.bfloat16), seqs) - reference)

    chunk = 512 if bf16_dot else 32  # tokens of a prompt per forward (the scored logits' rows)
    llm = LLM(path, dtype="bfloat16", num_blocks=64, block_size=8, max_num_seqs=4, max_prefill_chunk=chunk)
    outs = llm.generate(seqs.tolist(), SamplingParams(max_tokens=0, prompt_logprobs=0))
    if not bf16_dot and cpu_kernel.available():  # the scored chunks' LM head (32 rows) by the kernel
        assert (32, (1, hf.config.hidden_size, hf.config.vocab_size)) in calls, calls
    mine = np.abs(np.array([[lp.logprob for lp in o.prompt_logprobs[PROMPT_LEN:]] for o in outs]) - reference)

    assert theirs.max() > 0  # transformers' bf16 does round: the bound below is not vacuous
    assert mine.mean() <= 1.1 * theirs.mean() + 1e-4, (mine.mean(), theirs.mean())
    assert mine.max() <= 1.1 * theirs.max() + 1e-3, (mine.max(), theirs.max())
