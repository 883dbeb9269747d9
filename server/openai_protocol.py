"""The OpenAI HTTP API's request bodies as strict pydantic models (what ``/v1/completions`` and
``/v1/chat/completions`` accept), and their translation into jaxmoe's ``SamplingParams``.

Strict: a field of the wrong JSON type is refused, never coerced (``"stream": "false"``,
``"max_tokens": true``, ``"seed": 1.5`` are 400s naming the field). Sampling fields: the OpenAI
API's (``n``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` with token ids as string
keys, completions' ``best_of``) and vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``). Structured output: ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` / ``structured_outputs`` become ``SamplingParams.structured_outputs`` (at most
one of them per request); chat's ``tools`` / ``tool_choice`` are ``ChatCompletionRequest.tool_mode``
(``server.tool_calls``). Fields the OpenAI API defines that jaxmoe does not implement are refused
when set to a value that would change the output (``suffix``, ``functions``, ``audio``, ...), a 400
naming the field, never silently ignored; other unknown fields are ignored, as the OpenAI API and
vLLM do. Unset temperature / top_p / top_k come from the
checkpoint's ``generation_config.json`` (when it sets ``do_sample``), else greedy: the one default
every front end shares (docs/serving.md); completions' ``max_tokens`` defaults to 16.
"""

from __future__ import annotations

import json
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
from jaxmoe.server.tool_calls import ToolChoice, ToolMode, Tools, tool_mode
from jaxmoe.structured_output import StructuredOutputsParams

MAX_PROMPTS = 64  # prompts in one completions request
MAX_MESSAGES = 1024


def _utf8(text: str) -> str:
    if text.isascii():  # constant time (CPython keeps the flag): no surrogate, and no 2 MB copy for a huge prompt
        return text
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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Annotated[Text, Field(max_length=64)] | None = None
    description: Text | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('json_schema: {"type": "json_schema"} needs a json_schema object with its schema')
        return self


class GuidedOptions(BaseModel):
    """vLLM's ``structured_outputs`` body field: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None


STRUCTURE_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _structures(name: str, value) -> bool:
    """Whether a structured-output field is set to something that constrains the output."""
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


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
    repetition_penalty: Number | None = None  # extension (vLLM)
    min_p: Number | None = None  # extension (vLLM)
    logit_bias: dict[str, Number] | None = None  # token id (as a string) -> bias in [-100, 100]
    priority: Text | None = None  # extension: "ls" | "be" (QLLM); the X-Priority header otherwise
    # extension (vLLM): requests share cached prefix KV only with requests of the same salt
    cache_salt: Annotated[Text, Field(min_length=1, max_length=1024)] | None = None
    user: Text | None = None
    # structured output (``structured``): OpenAI's response_format, vLLM's guided_* / structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: GuidedOptions | None = None

    @model_validator(mode="after")
    def _one_structure(self):
        given = [name for name in STRUCTURE_FIELDS if _structures(name, getattr(self, name))]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give at most one of {', '.join(given)} (each constrains the output)")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match (None: free text); checked by ``SamplingParams``."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format")
        if rf is not None and rf.type == "json_schema":
            return StructuredOutputsParams(json=rf.json_schema.schema_, param="response_format")
        if self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json, param="guided_json")
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex, param="guided_regex")
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=tuple(self.guided_choice), param="guided_choice")
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar, param="guided_grammar")
        so = self.structured_outputs
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice and tuple(so.choice),
                grammar=so.grammar,
                json_object=so.json_object,
                param="structured_outputs",
            )
        return None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise SamplingParamsError("logit_bias", f"keys are token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    def sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
        defaults: dict | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The shared validator (``SamplingParams``); temperature, top_p and top_k the request leaves
        unset take ``defaults`` (the checkpoint's generation_config), else greedy. ``structured``:
        the output's grammar when the request's own fields do not say it (a forced tool call)."""
        stop = self.stop if self.stop is not None else ()
        defaults = defaults or {}
        return SamplingParams(
            structured_outputs=structured if structured is not None else self.structured(),
            n=self.n,
            best_of=best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self._logit_bias(),
            prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens,
            temperature=defaults.get("temperature", 0.0) if self.temperature is None else self.temperature,
            top_p=defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=defaults.get("top_k", 0) if self.top_k is None else self.top_k,
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
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: must equal n when streaming (the best completions are known at the end)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per choice."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def to_sampling(self, defaults: dict | None = None) -> SamplingParams:
        """With ``echo`` and ``logprobs`` the prompt tokens are scored too (their logprobs come first)."""
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = None
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            prompt_logprobs = self.logprobs or 0
        return self.sampling(max_tokens, self.logprobs, prompt_logprobs, self.best_of, defaults)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text
    arguments: Text  # JSON text, as the OpenAI API returns it


class ToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore")

    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def rendered(self) -> dict:
        """As chat templates read it: ``arguments`` as an object (what transformers' templates expect)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns

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
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # at most one call is made per reply either way
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @model_validator(mode="after")
    def _chat_not_implemented(self):
        mode = self.tool_mode
        if mode is not None and mode.forced:
            given = [name for name in STRUCTURE_FIELDS if _structures(name, getattr(self, name))]
            if given:
                raise ValueError(f"{given[0]}: cannot be combined with a forced tool call (tool_choice)")
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported by this server")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError('modalities: only ["text"] is supported')
        return self

    def to_sampling(self, default_max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        mode = self.tool_mode
        return self.sampling(
            default_max_tokens if limit is None else limit,
            (self.top_logprobs or 0) if self.logprobs else None,
            defaults=defaults,
            structured=mode.grammar() if mode is not None else None,
        )

    @property
    def tool_mode(self) -> ToolMode | None:
        """How the tools are used (``server.tool_calls``); None: no tools in play."""
        return tool_mode(self.tools, self.tool_choice)

    def conversation(self) -> list[dict]:
        out = []
        for m in self.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                msg["tool_calls"] = [c.rendered() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                msg["name"] = m.name
            out.append(msg)
        return out


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (as vLLM's): a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (as vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


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
