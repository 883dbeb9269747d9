"""Serving: ``jaxmoe serve`` vs vLLM's OpenAI server, both driven by guidellm (issue 17's setting).

The serving rows of the outside measurement in issue 17 ("Performance"), on one command:

* checkpoint: ``bench/startup.py``'s ``bench-107m`` (Mixtral architecture, hidden 512, 8 layers,
  8 / 2 heads, 8 experts top-2, expert width 1024, vocab 1024, untied head, 107 M parameters,
  random weights stored bf16; fp32 runs upcast on load) plus a byte-level BPE tokenizer with exactly
  1024 entries (``tokenizers``, trained on this Python's standard-library sources; ids 0-2 are
  ``<unk>``, ``<s>``, ``</s>`` as in the model config), saved as ``tokenizer.json`` +
  ``tokenizer_config.json`` in the checkpoint directory, so both servers and guidellm
  (``--processor``) tokenize alike;
* servers, one at a time on a free 127.0.0.1 port (the other is not running), same checkpoint and
  ``--dtype`` (``--dtypes``: float32 and bfloat16), ``--max-num-seqs`` 16, ``--max-model-len`` 512:

  - ``jaxmoe serve`` (the ``jaxmoe`` script next to this interpreter, else ``python -m jaxmoe.cli``);
    its own defaults otherwise (warm-up compiles before /health answers 200);
  - ``python -m vllm.entrypoints.openai.api_server`` with ``--vllm-python`` and its best CPU settings:
    ``VLLM_CPU_OMP_THREADS_BIND`` = every core this process may use, ``VLLM_CPU_KVCACHE_SPACE=1``,
    ``LD_PRELOAD`` of tcmalloc and the venv's Intel OpenMP (``libiomp5.so``), and
    ``--no-enable-prefix-caching`` (guidellm's synthetic prompts are all different anyway);

* load: guidellm (``--guidellm``, 0.8.1) against ``/v1/completions``, streaming, synthetic text of
  ``--prompt-tokens`` 256 prompt tokens and ``--output-tokens`` 128 output tokens per request
  (guidellm sends ``max_tokens`` = 128 and ``ignore_eos: true``; both servers honour it, and the
  table reports the completion tokens the servers actually returned):

  - throughput: guidellm's ``throughput`` profile with ``max_concurrency`` = ``--concurrency`` (16),
    ``--throughput-requests`` requests (64) -> output tokens/s;
  - constant rate: ``--rate`` (1) request/s for ``--rate-seconds`` (60) s -> inter-token latency
    P50 and TTFT P50 / P90;

* start-up: process start to the first ``GET /health`` = 200 (polled every 0.5 s);
* ``--rounds`` (1) rounds; the server order is reversed in every other round, so load from other
  jobs on this shared machine hits both alike. Ratios are jaxmoe / vLLM within one round.

jaxmoe's compiles after ready (``jaxmoe_compiles_after_warmup`` from ``/metrics``) are reported
too: non-zero means serving traffic waited for XLA compiles.

Run from the repository root (about 2 x (start-up + 64 requests + 60 s) per dtype and round; on 2
busy cores expect 30-40 minutes for both dtypes)::

    python bench/serve_guidellm.py --out /tmp/serve_guidellm.md
    python bench/serve_guidellm.py --dtypes bfloat16 --rounds 2 --out /tmp/serve_guidellm.md
    # a smoke run: one dtype, 4 requests, 8 s at 1 req/s
    python bench/serve_guidellm.py --dtypes float32 --throughput-requests 4 --rate-seconds 8

Needs: vLLM's CPU build in its own venv (``--vllm-python``, default /tmp/vllm-venv/bin/python; see
``bench/serve_vs_vllm.py`` for how it was installed) and guidellm 0.8.1 in another
(``--guidellm``, default /tmp/guidellm-venv/bin/guidellm; ``pip install guidellm==0.8.1`` with torch
pinned to the CPU wheel).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 = the checkpoint's (unk), bos_token_id, eos_token_id
SERVERS = ("jaxmoe", "vllm")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


# --------------------------------------------------------------------------------------------------
# checkpoint + tokenizer
# --------------------------------------------------------------------------------------------------
def _corpus(max_mb: float):
    """Lines of this interpreter's standard-library .py files (sorted paths), up to ``max_mb`` MB."""
    root = pathlib.Path(os.__file__).parent
    budget = int(max_mb * 1e6)
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from text.splitlines(keepends=True)
        budget -= len(text)
        if budget <= 0:
            return


def make_tokenizer(vocab_size: int, corpus_mb: float):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(corpus_mb), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, not {vocab_size}: raise --tokenizer-corpus-mb")
    return tok


def make_checkpoint(path: pathlib.Path, corpus_mb: float) -> dict:
    """``bench-107m`` (written once) plus its tokenizer in ``path``; the model config."""
    from startup import SHAPES, write_checkpoint

    if not (path / "config.json").exists():
        t0 = time.monotonic()
        write_checkpoint(path, **SHAPES["bench-107m"])
        print(f"checkpoint written to {path} in {time.monotonic() - t0:.1f}s", flush=True)
    config = json.loads((path / "config.json").read_text())
    marker = path / "bench_tokenizer.json"
    want = {"kind": "byte-level BPE", "vocab_size": config["vocab_size"], "corpus_mb": corpus_mb, "specials": SPECIALS}
    if not (marker.exists() and json.loads(marker.read_text()) == want and (path / "tokenizer.json").exists()):
        from transformers import PreTrainedTokenizerFast

        t0 = time.monotonic()
        tok = make_tokenizer(config["vocab_size"], corpus_mb)
        for name, tid in (("<s>", config["bos_token_id"]), ("</s>", config["eos_token_id"])):
            if tok.token_to_id(name) != tid:
                raise SystemExit(f"tokenizer: {name} is id {tok.token_to_id(name)}, the config says {tid}")
        PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            model_max_length=config["max_position_embeddings"],
        ).save_pretrained(path)
        marker.write_text(json.dumps(want))
        print(f"tokenizer ({config['vocab_size']} entries) trained in {time.monotonic() - t0:.1f}s", flush=True)
    return config
