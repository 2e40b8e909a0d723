"""Render a conversation into a prompt with the model's Jinja chat template.

A GGUF's ``tokenizer.chat_template`` is untrusted data, so it runs in Jinja's immutable
sandbox, set up like Hugging Face's ``apply_chat_template`` (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``,
``{% break %}``/``{% continue %}``), with two hardenings: touching an unsafe attribute
raises at once (Jinja would render it as an empty string), and ``*`` / ``**`` refuse
results big enough to exhaust memory. There is no time limit on rendering.
"""

from __future__ import annotations

import json
import operator
import warnings
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

# Used when the model has no template: the generic ChatML format (what HF used as its
# default). Wrong for models trained on another format, hence the warning.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MAX_SIZE = 1 << 20  # longest string/list `*` may build, in items


class ChatTemplateFallbackWarning(UserWarning):
    """The model has no chat template; the prompt was rendered as ChatML instead."""


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself (the message is the template's)."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&`, `'`, which corrupts tool schemas.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` (marks assistant text for training
    masks); here it renders its body and nothing else."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * n > _MAX_SIZE:
                        raise SecurityError("'*' result too large")
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and abs(right) > 1024:
            raise SecurityError("'**' exponent too large")
        return operator.pow(left, right)


def _environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **variables: Any,
) -> str:
    """Render ``messages`` (``{"role": ..., "content": ...}`` dicts) with ``template``.

    ``template`` is the GGUF's ``tokenizer.chat_template``; None (no template) falls back
    to ChatML and emits a :class:`ChatTemplateFallbackWarning`. ``bos_token`` and
    ``eos_token`` are the token *texts* the template may print (e.g. Gemma starts with
    ``{{ bos_token }}``; tokenize the result without adding another BOS). Extra keyword
    arguments (``tools``, ``date_string``...) become template variables.
    Raises ChatTemplateError, one line, when the template fails to parse or render.
    """
    if template is None:
        warnings.warn(
            "the model has no chat template; formatting the prompt as ChatML",
            ChatTemplateFallbackWarning,
            stacklevel=2,
        )
        template = CHATML_TEMPLATE
    try:
        compiled = _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"invalid chat template (line {e.lineno}): {_one_line(e.message)}"
        ) from None
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **variables,
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template refused the messages: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template blocked: {_one_line(e)}") from None
    except Exception as e:  # a template can fail in any way; it is data, not our code
        raise ChatTemplateError(
            f"chat template failed: {type(e).__name__}: {_one_line(e)}"
        ) from None


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


# Gemma 3's template from google/gemma-3-*-it tokenizer_config.json. The gemma3-270m GGUF
# carries no tokenizer.chat_template, so apir carries it
# (llama.cpp would fall back to ChatML for this file, which the model was not trained on).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Templates for architectures whose GGUFs often ship without one.
BUILTIN_TEMPLATES: dict[str, str] = {"gemma3": GEMMA3_TEMPLATE}


def template_for(gguf_template: str | None, arch: str) -> str | None:
    """The model's own template, else a built-in one for its architecture, else None."""
    return gguf_template or BUILTIN_TEMPLATES.get(arch)
