"""Renders chat templates (the checkpoint's or a built-in one per family) in a sandboxed jinja2 environment."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")

# Gemma: no system role; a system message is folded into the first user turn, "assistant" is "model".
_GEMMA = """\
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
    {%- set first_prefix = messages[0].content ~ '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set first_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
    {%- if m.role not in ('user', 'assistant') or (m.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Gemma conversations alternate user/assistant/user/... after an optional first system message; got role ' ~ m.role ~ ' at turn ' ~ loop.index0) -}}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if m.role == 'assistant' else 'user') ~ '\\n' -}}
    {{- (first_prefix if loop.first else '') ~ (m.content | trim) ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

# ChatML (Qwen): every role is written as is.
_CHATML = """\
{%- for m in messages -%}
    {{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Llama 3: header ids around the role; a tool result is the "ipython" role.
_LLAMA3 = """\
{{- bos_token -}}
{%- for m in messages -%}
    {{- '<|start_header_id|>' ~ ('ipython' if m.role == 'tool' else m.role) ~ '<|end_header_id|>\\n\\n' -}}
    {{- (m.content | trim) ~ '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}
"""

# Mistral [INST]: a system message is prepended to the first user message; answers end with EOS.
_MISTRAL = """\
{{- bos_token -}}
{%- if messages and messages[0].role == 'system' -%}
    {%- set first_prefix = messages[0].content ~ '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set first_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for m in turns -%}
    {%- if m.role not in ('user', 'assistant') or (m.role == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Mistral conversations alternate user/assistant/user/... after an optional first system message; got role ' ~ m.role ~ ' at turn ' ~ loop.index0) -}}
    {%- endif -%}
    {%- if m.role == 'user' -%}
        {{- '[INST] ' ~ (first_prefix if loop.first else '') ~ m.content ~ ' [/INST]' -}}
    {%- else -%}
        {{- m.content ~ eos_token -}}
    {%- endif -%}
{%- endfor -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _GEMMA,
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
}


def builtin_chat_template(family: str) -> str:
    """The built-in template for a chat family ("gemma", "chatml", "llama3", "mistral")."""
    template = BUILTIN_TEMPLATES.get(family)
    if template is None:
        raise ValueError(
            f"chat family is {family!r}; built-in templates exist for {sorted(BUILTIN_TEMPLATES)}"
        )
    return template


def select_chat_template(value: Any, name: str = "default") -> str | None:
    """The template text from a tokenizer_config `chat_template` (a string or a list of named ones)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if name in named:
            return named[name]
        raise ValueError(
            f"chat_template has named templates {sorted(map(str, named))}; none is called {name!r}"
        )
    raise ValueError(
        f"chat_template is a {type(value).__name__}; expected a string or a list of {{name, template}}"
    )


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten list-of-parts content into one string.

    Raises ValueError naming the message index and field for anything a template cannot render.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError(
            f"messages is a {type(messages).__name__}; expected a list of {{role, content}} dicts"
        )
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(
                f"messages[{i}] is a {type(msg).__name__}; expected a dict with role and content"
            )
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role is {role!r}; accepted roles: {', '.join(ROLES)}")
        normalized = dict(msg)
        normalized["content"] = _content_text(msg.get("content"), i)
        out.append(normalized)
    return out


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"messages[{index}].content[{j}] is {part!r}; only text parts "
                    '({"type": "text", "text": "..."}) are accepted'
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(
        f"messages[{index}].content is a {type(content).__name__}; expected a string or a list of text parts"
    )


def render_chat_template(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template` as transformers' apply_chat_template(tokenize=False) does."""
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except jinja2.TemplateError as exc:
        # raise_exception() in a template and type errors inside it are the caller's bad input.
        raise ValueError(f"chat template rejected the messages: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson, keep non-ASCII text and do not HTML-escape (templates build prompts).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"chat template does not parse: {exc.message} (line {exc.lineno})"
        ) from exc
