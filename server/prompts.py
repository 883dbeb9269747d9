"""``PromptPreparer``: the front ends' prompt work, off the event loop and off the engine thread.

Both front ends (HTTP and gRPC) share one event loop, and the engine thread runs every step; a
prompt tokenized (or a chat template rendered) on either would stall every other request for as
long as that takes. Here a text prompt is first refused by its character count
(``jaxmoe.engine.prompt_limits``: no work proportional to its size), then tokenized in a small
thread pool of its own, then refused by its token count; the engine gets token ids only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from jaxmoe.engine.prompt_limits import check_prompt_chars, check_prompt_tokens

DEFAULT_WORKERS = 2


class PromptTooLong(ValueError):
    """A prompt over the server's limit; ``param`` names the field (the error message, the limit)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ToolsNotRendered(ValueError):
    """``tool_choice: "auto"`` with a chat template that does not show the tools to the model."""


class PromptPreparer:
    def __init__(self, engine, workers: int = DEFAULT_WORKERS):
        """``engine``: the ``LLMEngine`` (its tokenizer and ``max_model_len``)."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxmoe-tokenize")

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_chars(self, num_chars: int, param: str) -> None:
        try:
            check_prompt_chars(num_chars, self.max_model_len, param)
        except ValueError as e:
            raise PromptTooLong(str(e), param) from None

    def check_tokens(self, num_tokens: int, param: str) -> None:
        try:
            check_prompt_tokens(num_tokens, self.max_model_len, param)
        except ValueError as e:
            raise PromptTooLong(str(e), param) from None

    async def run(self, fn, *args):
        """``fn(*args)`` in the tokenizer threads (tokenizing, decoding, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A prompt (text or token ids) as token ids within the context; raises PromptTooLong."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), param)
            ids = await self.run(self.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        self.check_tokens(len(ids), param)
        return ids

    async def chat_ids(
        self, conversation: list[dict], param: str = "messages", tools=None, tools_must_show: bool = False
    ) -> list[int]:
        """The conversation (and ``tools``, OpenAI's JSON) through the chat template, tokenized;
        raises PromptTooLong, ToolsNotRendered (``tools_must_show`` and the template renders the
        same text without them), or the template's own errors (ValueError, jinja2.TemplateError)."""
        self.check_chars(sum(len(m["content"]) for m in conversation), param)
        ids = await self.run(self._chat, conversation, tools, tools_must_show)
        self.check_tokens(len(ids), param)
        return ids

    def _chat(self, conversation, tools=None, tools_must_show: bool = False) -> list[int]:
        plain = None
        if not tools or tools_must_show:  # a tokenizer without tool support still renders tool-less chats
            plain = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        text = plain
        if tools:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tools=tools)
            if tools_must_show and text == plain:
                raise ToolsNotRendered(
                    "tool_choice: this checkpoint's chat template does not render tools, so the model cannot "
                    'choose to call one ("auto"); send "required" or name a function (the call is then forced)'
                )
        return self.tokenizer.encode(text)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
