"""Chat templates: the real models' formats, the sandbox, the ChatML fallback."""

from __future__ import annotations

import functools

import gguf
import pytest

from apir.models.chat import (
    CHATML_TEMPLATE,
    GEMMA3_TEMPLATE,
    ChatTemplateFallbackWarning,
    render_chat,
)
from apir.models.errors import ChatTemplateError, ModelNotFoundError
from apir.models.resolve import resolve_model

HI = [{"role": "user", "content": "Hi"}]




@functools.cache
def _gguf_template(model: str) -> str | None:
    try:
        path = resolve_model(model)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    field = gguf.GGUFReader(path).get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    return None if field is None else field.contents()


def test_smollm2_template() -> None:
    prompt = render_chat(_gguf_template("smollm2-135m"), HI)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_template_without_generation_prompt() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    prompt = render_chat(_gguf_template("smollm2-135m"), messages, add_generation_prompt=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_gemma3_template() -> None:
    prompt = render_chat(GEMMA3_TEMPLATE, HI, bos_token="<bos>", eos_token="<eos>")
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_template_system_prompt_and_roles() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert render_chat(GEMMA3_TEMPLATE, messages, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_template_raise_exception_is_a_chat_template_error() -> None:
    bad_order = [{"role": "assistant", "content": "Hi"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(GEMMA3_TEMPLATE, bad_order)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",  # plain Jinja would print "" here; we refuse
        "{{ cycler.__init__.__globals__.os }}",
        "{{ messages.append({'role': 'system'}) }}",  # the sandbox is immutable
        "{{ 'x' * 100000000 }}",
        "{{ 10 ** 100000000 }}",
    ],
)
def test_malicious_templates_are_refused(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="blocked"):
        render_chat(template, HI)


@pytest.mark.parametrize(
    "template, match",
    [
        ("{% for m in messages %}{{ m.content }", "invalid chat template \\(line 1\\)"),
        ("{{ messages[3].content }}", "UndefinedError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_broken_templates_raise_one_line_errors(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as info:
        render_chat(template, HI)
    assert "\n" not in str(info.value)


def test_hf_helpers_are_available() -> None:
    template = (
        "{{ strftime_now('%Y') | length }} {{ {'a': '<b>é'} | tojson }}"
        "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% break %}{% endfor %}"
    )
    assert render_chat(template, HI) == '4 {"a": "<b>é"}user'


def test_no_template_falls_back_to_chatml_with_a_warning() -> None:
    with pytest.warns(ChatTemplateFallbackWarning):
        prompt = render_chat(None, HI)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt == render_chat(CHATML_TEMPLATE, HI)
