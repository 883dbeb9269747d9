"""The OpenAI HTTP API's request bodies as strict pydantic models (what ``/v1/completions`` and
``/v1/chat/completions`` accept), and their translation into jaxmoe's ``SamplingParams``.

Strict: a field of the wrong JSON type is refused, never coerced (``"stream": "false"``,
``"max_tokens": true``, ``"seed": 1.5`` are 400s naming the field). Fields the OpenAI API defines
that jaxmoe does not implement are refused when set to a value that would change the output
(``n`` > 1, penalties, ``logit_bias``, ``suffix``, ``best_of`` > 1); other unknown fields are ignored, as the OpenAI
API and vLLM do. Defaults follow the OpenAI API (temperature 1.0, top_p 1.0, completions
``max_tokens`` 16).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from jaxmoe.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError

MAX_PROMPTS = 64  # prompts in one completions request
MAX_MESSAGES = 1024


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate: not valid Unicode text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_utf8)]
Number = StrictFloat | StrictInt
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension (vLLM)
    seed: StrictInt | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    n: StrictInt = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    priority: Text | None = None  # extension: "ls" | "be" (QLLM); the X-Priority header otherwise
    # extension (vLLM): requests share cached prefix KV only with requests of the same salt
    cache_salt: Annotated[Text, Field(min_length=1, max_length=1024)] | None = None
    user: Text | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported (send the request n times)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported (must be 0 or absent)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        return self

    def sampling(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The shared validator (``SamplingParams``) with the OpenAI API's defaults."""
        stop = self.stop if self.stop is not None else ()
        return SamplingParams(
            prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


PromptText = Annotated[Text, Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: (
        PromptText
        | TokenIds
        | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
        | (Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    )
    max_tokens: StrictInt | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 needs echo (prompt scoring); otherwise at least 1")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per choice."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling(self) -> SamplingParams:
        """With ``echo`` and ``logprobs`` the prompt tokens are scored too (their logprobs come first)."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = None
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            prompt_logprobs = self.logprobs or 0
        return self.sampling(max_tokens, self.logprobs, prompt_logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def to_sampling(self, default_max_tokens: int) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(
            default_max_tokens if limit is None else limit, (self.top_logprobs or 0) if self.logprobs else None
        )

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class RequestError(ValueError):
    """A request body that does not validate; ``param`` names the field (OpenAI's ``error.param``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def request_error(errors: list[dict]) -> RequestError:
    """A RequestError naming the first offending field of pydantic's ``errors()``."""
    first = errors[0]
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" and ":" in msg and not loc:  # a model validator naming its field
        param = msg.split(":", 1)[0]
    return RequestError(f"{param}: {msg}" if param and not msg.startswith(param) else msg, param)


def parse(model: type[BaseModel], body: Any) -> Any:
    """``model.model_validate(body)``, or a RequestError naming the first offending field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        return _raise(request_error(e.errors()))
    except SamplingParamsError as e:
        return _raise(RequestError(str(e), e.param))
    except RecursionError:
        return _raise(RequestError("the body is nested too deeply", None))


def _is_union_tag(p) -> bool:
    # pydantic puts the union member's type name into ``loc`` ("str", "list[int]", "function-after[...]")
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("function-"))


def _raise(e: Exception):
    raise e
