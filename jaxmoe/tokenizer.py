"""Tokenizers: a checkpoint's ``tokenizer.json`` (via ``tokenizers``) with its chat template, and
the byte-level tokenizer of the built-in demo model.

A chat template comes with the checkpoint, so it is untrusted code: it renders in jinja2's
``ImmutableSandboxedEnvironment`` (as transformers does), where reaching Python internals
(``''.__class__``, ``obj.__globals__``) or mutating arguments is refused with ``ChatTemplateError``.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The checkpoint's chat template failed or tried something the sandbox refuses."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """Refuses an unsafe attribute at once (jinja2's sandbox renders a lone ``{{ x.__class__ }}``
    as an empty string and only fails when it is used further)."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS = 256, EOS = 257."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (BOS and EOS: none)."""
        return [bytes((i,)) for i in range(256)] + [b"", b""]

    def decode_stream(self):
        """An incremental decoder: ``.step(token_id)`` -> the new text, or None while a UTF-8
        character is incomplete."""
        return _ByteStream()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """``<|role|>`` lines; ``tools`` (OpenAI's JSON) first, as a ``<|tools|>`` turn of one JSON list."""
        text = f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""
        text += "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` plus the special tokens and chat template beside it."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        conf = _read_json(directory / "tokenizer_config.json")
        self.bos_token_id = self._token_id(conf.get("bos_token"))
        self.eos_token_id = self._token_id(conf.get("eos_token"))
        self.add_bos = bool(conf.get("add_bos_token", False)) and self.bos_token_id is not None
        template = conf.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = template
        self._special = {"bos_token": _content(conf.get("bos_token")), "eos_token": _content(conf.get("eos_token"))}
        self.vocab_size = self._tok.get_vocab_size()

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (its ``to_str()`` is the tokenizer.json)."""
        return self._tok

    def _token_id(self, token) -> int | None:
        token = _content(token)
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self):
        """An incremental decoder (``tokenizers.decoders.DecodeStream``): ``.step(token_id)`` -> the
        new text, or None while it waits for the rest of a character."""
        return _HFStream(self._tok)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """The conversation through the checkpoint's template; ``tools`` (OpenAI's JSON) reach it
        as transformers passes them (``tools=``), when given."""
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template")
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            extra = {"tools": tools} if tools else {}
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self._special
            )
        except SecurityError as e:
            raise ChatTemplateError(
                f"the chat template tried an unsafe operation, refused by the sandbox: {e}"
            ) from None


class _HFStream:
    def __init__(self, tok):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tok, token_id)


class _ByteStream:
    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str | None:
        if not 0 <= token_id < 256:  # BOS / EOS: no text
            return None
        return self._utf8.decode(bytes((token_id,))) or None


class Detokenizer:
    """One request's streaming detokenization: each token's text is decoded once (the tokenizer's
    ``decode_stream``), so a stream of n tokens costs O(n), not O(n^2) re-decoding the whole output
    every step. ``text`` is all the text so far (a character split over tokens appears when it is
    complete); ``finish(ids)`` gives the final text, the tokenizer's own ``decode`` of the whole
    output when that extends what was streamed (one full decode per request)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._stream = tokenizer.decode_stream()
        self._pieces: list[str] = []
        self._text = ""
        self._joined = 0  # pieces already in _text

    def add(self, token_id: int) -> str:
        """Decode one more token; returns its new text ("" while a character is incomplete)."""
        piece = self._stream.step(token_id) or ""
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        if self._joined < len(self._pieces):
            self._text += "".join(self._pieces[self._joined :])
            self._joined = len(self._pieces)
        return self._text

    def finish(self, ids) -> str:
        full = self._tok.decode(ids)
        streamed = self.text
        return full if full.startswith(streamed) else streamed


def _content(token):
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def load_tokenizer(directory: str | Path | None):
    if directory is None:
        return ByteTokenizer()
    directory = Path(directory)
    if not (directory / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return HFTokenizer(directory)
