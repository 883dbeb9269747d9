"""The prompt length bound checked before any work proportional to a prompt's size.

A text prompt is refused by its character count before it is tokenized: no tokenizer turns more
than ``MAX_CHARS_PER_TOKEN`` characters into one token on average (byte-level BPE vocabularies top
out at a few dozen characters per token, and only for runs of one repeated character), so a prompt
longer than ``max_model_len * MAX_CHARS_PER_TOKEN`` characters cannot fit the context whatever it
says. The token count is checked after tokenization (``LLMEngine.add_request``).
"""

from __future__ import annotations

MAX_CHARS_PER_TOKEN = 32


def max_prompt_chars(max_model_len: int) -> int:
    """The most characters a text prompt may have for a context of ``max_model_len`` tokens."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def check_prompt_chars(num_chars: int, max_model_len: int, what: str = "prompt") -> None:
    """Raise ValueError (naming the limit) when ``num_chars`` characters cannot fit the context."""
    limit = max_prompt_chars(max_model_len)
    if num_chars > limit:
        raise ValueError(
            f"{what} of {num_chars} characters is longer than the limit of {limit} characters "
            f"(max_model_len {max_model_len} tokens x {MAX_CHARS_PER_TOKEN} characters per token)"
        )


def check_prompt_tokens(num_tokens: int, max_model_len: int, what: str = "prompt") -> None:
    """Raise ValueError (naming the limit) when a prompt of ``num_tokens`` leaves no room to generate."""
    if num_tokens >= max_model_len:
        raise ValueError(
            f"{what} of {num_tokens} tokens does not fit the context of {max_model_len} tokens (max_model_len)"
        )
