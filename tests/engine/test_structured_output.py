"""Structured output in the engine: ``SamplingParams(structured_outputs=...)`` through ``LLM.generate``
constrains the text (greedy and sampled, beside unconstrained requests that stay unchanged);
``mask_logits`` keeps exactly the tokens llguidance's own NumPy reference keeps; a Hugging Face
tokenizer (the demo's) drives the grammar too; chat templates receive ``tools``."""

from __future__ import annotations

import json
import shutil

import jsonschema
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from jaxmoe import LLM
from jaxmoe.demo import DEMO_DIR
from jaxmoe.sampling import SamplingParams, SamplingParamsError, mask_logits
from jaxmoe.structured_output import GrammarBackend, StructuredOutputsParams
from jaxmoe.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "color": {"enum": ["red", "blue"]}},
    "required": ["id", "color"],
    "additionalProperties": False,
}


def test_mask_logits_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    allowed = rng.integers(-(1 << 31), 1 << 31, size=(3, 4), dtype=np.int64).astype(np.int32)
    allowed[2] = -1  # a row without a grammar keeps everything
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, allowed)
    got = np.asarray(mask_logits(logits, allowed))
    np.testing.assert_array_equal(got, expected)
    assert np.isfinite(got[2]).all()


@pytest.mark.slow  # compiles several batch shapes of the tiny model
def test_generate_follows_the_schema_and_leaves_other_requests_alone():
    llm = LLM("tiny-random", num_blocks=64, block_size=8, max_num_seqs=4)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    (alone,) = llm.generate(["Hello"], plain)
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(
        ["Hello", "a", "b"],
        [
            plain,
            SamplingParams(max_tokens=40, structured_outputs=so),
            SamplingParams(max_tokens=40, temperature=1.0, seed=2, structured_outputs=so),
        ],
    )
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for out in outs[1:]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    (choice,) = llm.generate(
        ["x"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    )
    assert choice.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json={"type": "nope"}), "does not compile"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="("), "does not compile"),
        (dict(json=SCHEMA, regex="a"), "exactly one"),
        (dict(), "exactly one"),
    ],
)
def test_bad_grammars_name_the_field(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message) as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    assert e.value.param == "structured_outputs" and "\n" not in str(e.value)


def test_a_hugging_face_tokenizer_drives_the_grammar():
    """The demo's tokenizer.json through llguidance: always taking the highest allowed id (an
    adversarial 'model') still ends in JSON that validates."""
    tok = load_tokenizer(DEMO_DIR)
    grammar = GrammarBackend(tok, 4096, {0, 4}).grammar(StructuredOutputsParams(json=SCHEMA))
    ids = []
    for _ in range(200):
        bits = grammar.mask()
        allowed = [t for t in range(4096) if (bits[t // 32] >> (t % 32)) & 1]
        token = max(allowed)
        grammar.accept(token)
        if token in (0, 4):  # EOS
            break
        ids.append(token)
        if grammar.done:
            break
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


@pytest.mark.slow
def test_the_chat_template_receives_tools(tmp_path):
    shutil.copy(DEMO_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tools=tools) == "[tool get_weather]user: hi\n"
    assert tok.apply_chat_template(messages) == "user: hi\n"
