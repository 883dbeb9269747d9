"""A byte-level BPE tokenizer trained on the training documents (``tokenizers``), saved the way Hugging
Face checkpoints ship one: ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens and a chat
template), which both ``jaxmoe.tokenizer.HFTokenizer`` and transformers' ``AutoTokenizer`` read.

``<|endoftext|>`` separates documents in training and starts every encoded text (the post-processor
adds it), so a prompt looks like the start of a document; generating it ends the text.  The chat
roles are special tokens of their own; ``<|end|>`` closes a message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

ENDOFTEXT = "<|endoftext|>"
END_OF_MESSAGE = "<|end|>"
SPECIAL_TOKENS = [ENDOFTEXT, "<|system|>", "<|user|>", "<|assistant|>", END_OF_MESSAGE]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``tokenizers.Tokenizer``: byte-level BPE with ``vocab_size`` entries (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (at least 262)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    eot = tokenizer.token_to_id(ENDOFTEXT)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{ENDOFTEXT} $A", pair=f"{ENDOFTEXT} $A {ENDOFTEXT} $B:1", special_tokens=[(ENDOFTEXT, eot)]
    )
    return tokenizer


def save_tokenizer(tokenizer, directory: str | Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) in ``directory``."""
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "unk_token": None,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,  # the post-processor adds it
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def special_token_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
