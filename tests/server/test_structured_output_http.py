"""Structured output and tools over HTTP: ``response_format`` (``json_schema``, ``json_object``) and
vLLM's ``guided_*`` constrain the generated text (it parses and validates against the schema, for
greedy and sampled requests, streamed or not); ``tools`` with ``tool_choice`` "required" or a named
function return ``message.tool_calls`` that match the tool's parameters; "auto" reads calls back
from Hermes ``<tool_call>`` blocks; requests without them generate exactly what they did; bad
settings are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import jsonschema
import pytest

from jaxmoe import LLM
from jaxmoe.server.app import ServeOptions, ServerThread

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-random", num_blocks=256, block_size=8, max_num_seqs=4)  # room for the tools' JSON
    st = ServerThread(llm.engine, ServeOptions(model_name="tiny", warmup=False))
    yield st.start()
    st.stop(abort_inflight=True)


def _post(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if body.get("stream") and resp.status == 200:
        return resp.status, [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    return resp.status, json.loads(raw)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_output_validates(server, sampling):
    body = {"messages": CHAT, "max_tokens": 120, "response_format": _schema_format(SCHEMA), **sampling}
    status, r = _post(server, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    status, c = _post(
        server, "/v1/completions", {"prompt": "Hello", **{k: v for k, v in body.items() if k != "messages"}}
    )
    assert status == 200, c
    jsonschema.validate(json.loads(c["choices"][0]["text"]), SCHEMA)


@pytest.mark.slow
def test_json_schema_streamed_and_n(server):
    body = {"messages": CHAT, "max_tokens": 120, "response_format": _schema_format(SCHEMA), "stream": True}
    status, events = _post(server, "/v1/chat/completions", {**body, "n": 2, "temperature": 1.0, "seed": 3})
    assert status == 200
    for index in (0, 1):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"][0]["index"] == index)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_guided_fields(server):
    # any JSON object: the random model's keys run long, so its strings are bounded through guided_json instead
    body = {"prompt": "x", "max_tokens": 60, "response_format": {"type": "json_object"}}
    status, r = _post(server, "/v1/completions", {**body, "logit_bias": {str(ord("}")): 100}})
    assert status == 200 and json.loads(r["choices"][0]["text"]) == {}, r
    status, r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "guided_choice": ["red", "green"]})
    assert status == 200 and r["choices"][0]["text"] in ("red", "green"), r
    status, r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "guided_regex": "[0-9]{3}-[a-c]{2}"})
    text = r["choices"][0]["text"]
    assert status == 200 and len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc")
    status, r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 120, "guided_json": SCHEMA})
    assert status == 200
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)
    status, r = _post(
        server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert status == 200 and r["choices"][0]["text"] in ("yes", "no"), r
    for grammar in ('start: "a" ("b" | "c") NUM\nNUM: /[0-9]/', 'root ::= "a" ("b" | "c") [0-9]'):  # Lark, GBNF
        status, r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "guided_grammar": grammar})
        text = r["choices"][0]["text"]
        assert status == 200 and len(text) == 3 and text[:2] in ("ab", "ac") and text[2].isdigit(), r


@pytest.mark.slow
def test_plain_requests_are_unchanged_beside_structured_ones(server):
    plain = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, alone = _post(server, "/v1/completions", plain)
    structured = {"prompt": "x", "max_tokens": 120, "guided_json": SCHEMA, "temperature": 1.0, "seed": 1}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # batched together with grammar rows
        futures = [pool.submit(_post, server, "/v1/completions", b) for b in (structured, plain, structured, plain)]
        results = [f.result() for f in futures]
    for status, r in results[1::2]:
        assert status == 200 and r["choices"][0]["text"] == alone["choices"][0]["text"]
    for status, r in results[0::2]:
        jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"response_format": _schema_format({"type": "nope"})}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
        ),
        ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools"),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_settings_are_refused_by_name(server, path, extra, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    status, err = _post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 400 and err["error"]["param"] == param, err
    assert "\n" not in err["error"]["message"]


def _arguments(call, tool):
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_required_tool_call(server, sampling):
    body = {"messages": CHAT, "max_tokens": 160, "tools": [WEATHER, TIME], "tool_choice": "required", **sampling}
    status, r = _post(server, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    _arguments(call, {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]])


@pytest.mark.slow
def test_named_tool_call_streamed_and_the_tools_reach_the_template(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": CHAT, "max_tokens": 160, "tools": [WEATHER, TIME], "tool_choice": named}
    status, r = _post(server, "/v1/chat/completions", body)
    assert status == 200, r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and _arguments(call, TIME)["zone"] in ("utc", "cet")
    # the byte tokenizer's template puts the tools first, as one JSON list: one token per byte, plus BOS
    rendered = f"<|tools|>\n{json.dumps([WEATHER, TIME])}\n<|user|>\nhi\n<|assistant|>\n"
    assert r["usage"]["prompt_tokens"] == len(rendered.encode()) + 1
    status, events = _post(server, "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (streamed,) = last["delta"]["tool_calls"]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert all("content" not in e["choices"][0]["delta"] for e in events[1:])  # the JSON is not sent as text


@pytest.mark.slow
def test_auto_reads_hermes_tool_calls_and_none_leaves_text(server):
    # the random model writes a Hermes call only when a regex makes it; "auto" must read it back
    regex = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-9]\}\}</tool_call>'
    )
    body = {"messages": CHAT, "max_tokens": 100, "tools": [WEATHER], "guided_regex": regex}
    status, r = _post(server, "/v1/chat/completions", body)
    assert status == 200, r
    message = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Sure."
    assert _arguments(message["tool_calls"][0], WEATHER)["days"] in range(1, 10)
    status, r = _post(server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert status == 200 and "tool_calls" not in r["choices"][0]["message"]
    assert r["choices"][0]["message"]["content"].startswith("Sure. <tool_call>")
    assert r["usage"]["prompt_tokens"] == len("<|user|>\nhi\n<|assistant|>\n") + 1  # "none": tools not rendered


@pytest.mark.slow
def test_a_conversation_with_tool_results(server):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    status, r = _post(server, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 3})
    assert status == 200 and r["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls"), r


@pytest.fixture(scope="module")
def demo_server():
    llm = LLM("demo", num_blocks=64, block_size=8, max_num_seqs=2)
    st = ServerThread(llm.engine, ServeOptions(model_name="demo", warmup=False))
    yield st.start()
    st.stop(abort_inflight=True)


@pytest.mark.slow  # loads and compiles the demo model
def test_the_demo_model_answers_in_json(demo_server):
    messages = [{"role": "user", "content": "def main():"}]
    status, r = _post(demo_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 100, "temperature": 0})
    plain = r["choices"][0]["message"]["content"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # the demo model writes Python
    body = {"messages": messages, "max_tokens": 100, "temperature": 0, "response_format": _schema_format(SCHEMA)}
    status, r = _post(demo_server, "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), SCHEMA)
    body["response_format"] = {"type": "json_object"}
    status, r = _post(demo_server, "/v1/chat/completions", body)
    assert status == 200 and isinstance(json.loads(r["choices"][0]["message"]["content"]), dict), r
    # the demo's chat template does not render tools: "auto" is refused, a forced call works
    status, err = _post(demo_server, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER]})
    assert status == 400 and err["error"]["param"] == "tool_choice", err
    status, r = _post(
        demo_server, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "tool_choice": "required"}
    )
    assert status == 200 and r["choices"][0]["finish_reason"] == "tool_calls", r
    _arguments(r["choices"][0]["message"]["tool_calls"][0], WEATHER)
