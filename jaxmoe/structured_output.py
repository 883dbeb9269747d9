"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark / GBNF grammar) turned into the set of tokens allowed next, step by step, through
the llguidance library.

``StructuredOutputsParams`` is the request's setting (vLLM's names; one of its fields set), checked
when ``SamplingParams`` is built. ``GrammarBackend`` (one per engine) holds llguidance's view of the
tokenizer (built on first use) and makes each request a ``Grammar``: before a step samples the
request's token, ``Grammar.mask`` gives the allowed tokens as a packed bitmask (bit ``t % 32`` of
word ``t // 32``), which ``sampling.mask_logits`` applies to the logits on the device; after it,
``Grammar.accept`` advances the grammar by the sampled token. The request ends when the grammar is
complete (EOS is allowed only where the grammar accepts, and is then the only token allowed once no
more text fits).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

# JSON is generated compact, in ``json.dumps``'s default layout: no whitespace beyond ", " and ": "
# (a model free to add whitespace may add it forever)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (as vLLM's ``StructuredOutputsParams``); set exactly one
    of: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (True: any JSON object),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark or GBNF). ``param`` names the
    field an error reports (the HTTP front end sets ``response_format``, ``guided_json``, ...)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    param: str = dataclasses.field(default="structured_outputs", compare=False)

    def __post_init__(self):
        if isinstance(self.json, dict):  # kept as canonical text: hashable, one key per schema
            object.__setattr__(self, "json", _dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    def validate(self) -> None:
        """Raise ValueError (one line) if the setting is malformed or its grammar does not compile."""
        set_fields = [f for f in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, f)]
        if len(set_fields) != 1:
            raise ValueError(
                f"set exactly one of json, regex, choice, grammar, json_object; got {set_fields or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
            if value is not None and len(value) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None and (
            not isinstance(self.choice, tuple) or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("choice must be a list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        problem = _problem(self)
        if problem:
            raise ValueError(problem)

    def spec(self) -> str:
        """The llguidance grammar of this setting."""
        from llguidance import LLMatcher

        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"json: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json: a JSON schema is an object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        from llguidance import grammar_from

        return grammar_from("grammar", self.grammar)


class Grammar:
    """One request's grammar state (an llguidance matcher)."""

    def __init__(self, matcher, width: int, words: int):
        self._m, self.width, self._words = matcher, width, words

    def mask(self):
        """The tokens allowed next: int32 [width], bit ``t % 32`` of word ``t // 32`` set for token t
        (ids past the tokenizer's vocabulary, the model's padding, are never allowed)."""
        import numpy as np

        words = np.zeros(self.width, np.int32)
        try:
            self._m.unsafe_compute_mask_ptr(words.ctypes.data, 4 * self._words)
        except Exception:  # nothing allowed: ``accept`` then fails this request alone, with the matcher's error
            words[:] = 0
        return words

    def accept(self, token: int) -> None:
        """Advance by the sampled token; ValueError if the grammar refuses it."""
        if not self._m.consume_token(token):
            raise ValueError(f"structured output: token {token} does not fit the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """No more tokens fit (the output is complete)."""
        return self._m.is_stopped()


class GrammarBackend:
    """llguidance for one engine's tokenizer and vocabulary (the model's, which may be larger)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None

    @property
    def width(self) -> int:
        return -(-self.vocab_size // 32)

    def lltokenizer(self):
        """llguidance's tokenizer (built once: about a second for a 150k vocabulary)."""
        if self._lltok is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            backend = getattr(self.tokenizer, "backend", None)
            if backend is not None:  # a Hugging Face tokenizer.json
                source: Any = backend.to_str()
            else:  # any tokenizer that lists its tokens' bytes (the byte-level one)
                source = TokenizerWrapper(_Listed(self.tokenizer))
            self._lltok = LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)
        return self._lltok

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh grammar state for one request; ValueError if it does not compile."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.lltokenizer(), params.spec(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {_one_line(matcher.get_error())}")
        words = -(-self.lltokenizer().vocab_size // 32)
        return Grammar(matcher, max(self.width, words), words)


class _Listed:
    """A tokenizer with ``token_bytes()`` (each id's bytes) as llguidance's ``TokenizerWrapper`` wants it."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = [t for t in (self.eos_token_id, self.bos_token_id) if t is not None]

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=256)
def _problem(params: StructuredOutputsParams) -> str | None:
    """Why the grammar of ``params`` does not compile (None: it does); remembered, as a request's
    settings are checked again for each of its ``n`` completions."""
    from llguidance import LLMatcher

    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(params.spec())
    except (ValueError, TypeError) as e:
        return _one_line(str(e))
    return f"the grammar does not compile: {_one_line(messages[0])}" if is_error else None


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))  # key order kept: it is the order properties are generated in


def _one_line(message: str) -> str:
    return " ".join(message.split())
