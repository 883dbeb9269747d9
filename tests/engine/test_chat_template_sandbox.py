"""A checkpoint's chat template is untrusted: it renders in jinja2's immutable sandbox, so reaching
Python internals or mutating the messages is refused with a clear error, while ordinary templates
render as before."""

from __future__ import annotations

import shutil

import pytest

from jaxmoe.tokenizer import ChatTemplateError, load_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(checkpoint_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(checkpoint_dir("mixtral"), d)
    return d


def _with_template(d, template: str):
    (d / "chat_template.jinja").write_text(template)
    return load_tokenizer(d)


@pytest.mark.slow
def test_an_ordinary_template_renders(model_dir):
    tok = _with_template(
        model_dir, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}{% endfor %}{{ eos_token }}"
    )
    assert tok.apply_chat_template(MESSAGES).startswith("<user>HI")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set x = messages.pop() %}",
    ],
)
def test_a_template_reaching_python_internals_is_refused(model_dir, template):
    tok = _with_template(model_dir, template)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template(MESSAGES)
    assert MESSAGES == [{"role": "user", "content": "hi"}]
