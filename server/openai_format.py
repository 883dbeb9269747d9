"""OpenAI response objects for one request's choices: ``text_completion`` / ``chat.completion``
(and their streamed chunks) from the engine's ``RequestOutput`` s, with logprobs and usage."""

from __future__ import annotations

import time
from typing import Any, Protocol

from jaxmoe.engine.outputs import RequestOutput


class Server(Protocol):
    """What a response format reads of the HTTP front end (``http_service.OpenAIServer``)."""

    tokenizer: Any
    model_name: str


def total_usage(outs, per_prompt: int = 1) -> dict:
    """Usage of the requests ``outs`` (prompt-major, ``per_prompt`` completions of each prompt): each
    prompt counts once, every generated token counts (``best_of`` included), and
    ``prompt_tokens_details.cached_tokens`` the prompt tokens whose KV came from the prefix cache."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for i, out in enumerate(outs):
        if i % per_prompt == 0:
            usage["prompt_tokens"] += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
        usage["completion_tokens"] += len(out.token_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def merge_final(fmts, finals, per_prompt: int = 1, n: int = 1) -> dict:
    """One response of every prompt's choices: of each prompt's ``per_prompt`` requests (``best_of``)
    the ``n`` with the highest cumulative logprob, numbered in order."""
    choices, obj = [], None
    for start in range(0, len(finals), per_prompt):
        group = list(zip(fmts[start : start + per_prompt], finals[start : start + per_prompt]))
        if per_prompt > n:
            group = sorted(group, key=lambda fo: -(fo[1].cumulative_logprob or 0.0))[:n]
        for fmt, out in group:
            fmt.index = len(choices)
            part = fmt.final(out)
            obj = obj or part
            choices += part["choices"]
    obj["choices"] = choices
    obj["usage"] = total_usage(finals, per_prompt)
    return obj


class CompletionFormat:
    """``text_completion`` objects of one choice."""

    def __init__(self, server: Server, rid: str, index: int = 0, echo: bool = False):
        self.server, self.rid, self.index, self.created = server, rid, index, int(time.time())
        self.tok = server.tokenizer
        self.offset = 0
        self.echo = echo
        self.pending = echo  # streamed with echo: the prompt (and its logprobs) not sent yet

    def _base(self, choices, usage=None):
        obj = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return obj

    def _logprobs(self, out: RequestOutput, new: bool):
        if out.logprobs is None:
            return None
        items = out.logprobs[len(out.token_ids) - len(out.delta_token_ids) :] if new else out.logprobs
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in items:
            d["tokens"].append(self.tok.decode([lp.token_id]))
            d["token_logprobs"].append(lp.logprob)
            d["top_logprobs"].append({self.tok.decode([t]): v for t, v in lp.top})
            d["text_offset"].append(self.offset)
            self.offset += len(d["tokens"][-1])
        return d

    def first_chunks(self):
        return []

    def chunk(self, out: RequestOutput):
        """A streamed chunk; with ``echo`` the first one starts with the prompt and its logprobs."""
        text, logprobs = out.delta_text, None
        if self.pending:  # the prompt first (offsets count from it)
            self.pending = False
            prompt_text, logprobs = self._echoed(out, out.logprobs is not None)
            text = prompt_text + text
        new = self._logprobs(out, True)
        if logprobs is None:
            logprobs = new
        elif new:
            for k in logprobs:
                logprobs[k] += new[k]
        return self._base(
            [
                {
                    "index": self.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason if out.finished else None,
                }
            ]
        )

    def _echoed(self, out: RequestOutput, want_logprobs: bool):
        """(the prompt's text, its logprobs or None): the first prompt token has no logprob."""
        prompt = out.prompt_token_ids
        if not want_logprobs and out.prompt_logprobs is None:
            return self.tok.decode(prompt), None
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        scored = out.prompt_logprobs or [None] * len(prompt)
        for token, lp in zip(prompt, scored):
            piece = self.tok.decode([token])
            logprobs["tokens"].append(piece)
            logprobs["token_logprobs"].append(None if lp is None else lp.logprob)
            logprobs["top_logprobs"].append(None if lp is None else {self.tok.decode([t]): v for t, v in lp.top})
            logprobs["text_offset"].append(self.offset)
            self.offset += len(piece)
        return self.tok.decode(prompt), logprobs

    def usage_chunk(self, usage: dict):
        return self._base([], usage)

    def final(self, out: RequestOutput):
        if not self.echo:
            return self._base(
                [
                    {
                        "index": self.index,
                        "text": out.text,
                        "logprobs": self._logprobs(out, False),
                        "finish_reason": out.finish_reason,
                    }
                ],
                total_usage([out]),
            )
        prompt_text, logprobs = self._echoed(out, out.logprobs is not None)
        generated = self._logprobs(out, False)
        if logprobs is not None and generated:
            for k in logprobs:
                logprobs[k] += generated[k]
        return self._base(
            [
                {
                    "index": self.index,
                    "text": prompt_text + out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            ],
            total_usage([out]),
        )


class ChatFormat:
    """``chat.completion`` / ``chat.completion.chunk`` objects. With tools in play (``tools``, a
    ``server.tool_calls.ToolMode``) the reply's calls are read from the finished text: streamed,
    the text is held back and sent in the last chunk, with the calls as ``delta.tool_calls``."""

    pending = False

    def __init__(self, server: Server, rid: str, index: int = 0, tools=None):
        self.server, self.rid, self.index, self.created = server, rid, index, int(time.time())
        self.tok = server.tokenizer
        self.tools = tools

    def _message(self, out: RequestOutput) -> tuple[dict, str | None]:
        """(the reply's message, its finish_reason): tool calls when the text holds them."""
        content, calls = (out.text, []) if self.tools is None else self.tools.parse(out.text)
        if not calls:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def _base(self, obj_type, choices, usage=None):
        obj = {
            "id": self.rid,
            "object": obj_type,
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return obj

    def _entry(self, token_id: int, logprob: float):
        text = self.tok.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, out: RequestOutput, new: bool):
        if out.logprobs is None:
            return None
        items = out.logprobs[len(out.token_ids) - len(out.delta_token_ids) :] if new else out.logprobs
        return {
            "content": [
                dict(self._entry(lp.token_id, lp.logprob), top_logprobs=[self._entry(t, v) for t, v in lp.top])
                for lp in items
            ]
        }

    def first_chunks(self):
        return [
            self._base(
                "chat.completion.chunk",
                [
                    {
                        "index": self.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
        ]

    def chunk(self, out: RequestOutput):
        if self.tools is not None:
            return self._tool_chunk(out)
        delta = {"content": out.delta_text} if out.delta_text else {}
        return self._base(
            "chat.completion.chunk",
            [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": self._logprobs(out, True),
                    "finish_reason": out.finish_reason if out.finished else None,
                }
            ],
        )

    def _tool_chunk(self, out: RequestOutput):
        """Streamed with tools: nothing until the end, then the whole reply in one chunk."""
        if not out.finished:
            return None
        message, reason = self._message(out)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(delta["tool_calls"])]
        return self._base(
            "chat.completion.chunk",
            [{"index": self.index, "delta": delta, "logprobs": self._logprobs(out, False), "finish_reason": reason}],
        )

    def usage_chunk(self, usage: dict):
        return self._base("chat.completion.chunk", [], usage)

    def final(self, out: RequestOutput):
        message, reason = self._message(out)
        return self._base(
            "chat.completion",
            [
                {
                    "index": self.index,
                    "message": message,
                    "logprobs": self._logprobs(out, False),
                    "finish_reason": reason,
                }
            ],
            total_usage([out]),
        )
