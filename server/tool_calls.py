"""Tool calling for ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, the
grammar that forces a call, and the calls read back from the generated text.

The tools reach the model through the checkpoint's chat template (``tools=`` as transformers passes
them). ``tool_choice``:

* ``"none"``: the tools are not rendered, the reply is text.
* ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: the output is constrained
  (structured output) to one JSON object ``{"name": ..., "arguments": {...}}``, ``arguments``
  matching the tool's ``parameters`` schema; the reply is that call in ``message.tool_calls`` with
  ``finish_reason: "tool_calls"``.
* ``"auto"`` (the default when ``tools`` are given): the output is free; calls written in the
  Hermes format that Qwen's templates ask for, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  are read back as ``tool_calls`` (the rest of the text stays the content).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from jaxmoe.structured_output import StructuredOutputsParams

MAX_TOOLS = 128
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How one chat request uses its tools: ``choice`` "auto", "required" or a function's name."""

    tools: tuple[Tool, ...]
    choice: str

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def rendered(self) -> list[dict]:
        """The tools as the chat template receives them (OpenAI's JSON, as transformers passes it)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar(self) -> StructuredOutputsParams | None:
        """The output's grammar when a call is forced: one ``{"name", "arguments"}`` object."""
        if not self.forced:
            return None
        tools = [t for t in self.tools if self.choice == "required" or t.function.name == self.choice]
        options = [_call_schema(t.function) for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return StructuredOutputsParams(json=schema, param="tools")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(the content left, the OpenAI ``tool_calls``) of a finished output; no calls when the
        text holds none that names one of the tools with an object of arguments."""
        names = {t.function.name for t in self.tools}
        if self.forced:
            call = _call(text, names)
            return (None, [call]) if call else (text, [])
        calls = []
        for match in HERMES_CALL.finditer(text):
            call = _call(match.group(1), names)
            if call is None:
                return text, []  # a malformed call: the text is returned as it is
            calls.append(call)
        if not calls:
            return text, []
        content = HERMES_CALL.sub("", text).strip()
        return content or None, calls


def _call_schema(fn: FunctionSpec) -> dict:
    arguments = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _call(text: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments)},
    }


def tool_mode(tools: list[Tool] | None, choice) -> ToolMode | None:
    """The request's ``ToolMode`` (None: no tools in play); ValueError naming ``tool_choice`` for a
    choice its tools cannot meet."""
    names = [t.function.name for t in tools or ()]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"tools: two tools are named {name!r}")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        if not tools or choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice: names the function {choice.function.name!r}, which is not in tools")
        return ToolMode(tuple(tools), choice.function.name)
    if choice == "none":
        return None
    if not tools:
        raise ValueError(f'tool_choice: "{choice}" needs tools')
    return ToolMode(tuple(tools), choice)
