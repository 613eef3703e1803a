"""Renders chat templates (the checkpoint's or a built-in one per family) in a sandboxed jinja2 environment.

The environment is transformers' (`apply_chat_template`): trim_blocks and lstrip_blocks, loop
controls, the `{% generation %}` block, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text and does not HTML-escape; `tools` and `documents` are always defined (None when not
given) and special tokens only when the checkpoint has them, so `is defined` tests read the same.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
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

# DeepSeek R1 (and its Qwen/Llama distills): every system message first, joined by a blank line;
# an earlier answer keeps only what follows its last </think> (the reasoning is not replayed); the
# generation prompt opens the reasoning block, so the model's output starts inside it. Tool calls
# and their outputs use DeepSeek's tool tokens; after tool outputs the turn goes on unprompted.
_DEEPSEEK_R1 = """\
{%- set ns = namespace(system='', in_tool=false) -%}
{%- for m in messages if m.role == 'system' -%}
    {%- set ns.system = ns.system ~ ('\\n\\n' if not loop.first else '') ~ m.content -%}
{%- endfor -%}
{{- bos_token ~ ns.system -}}
{%- for m in messages if m.role != 'system' -%}
    {%- if m.role == 'tool' -%}
        {{- ('\\n' if ns.in_tool else '<｜tool▁outputs▁begin｜>') -}}
        {{- '<｜tool▁output▁begin｜>' ~ m.content ~ '<｜tool▁output▁end｜>' -}}
        {%- set ns.in_tool = true -%}
    {%- else -%}
        {%- if ns.in_tool -%}
            {{- '<｜tool▁outputs▁end｜>' -}}
        {%- endif -%}
        {%- if m.role == 'user' -%}
            {{- '<｜User｜>' ~ m.content -}}
        {%- else -%}
            {%- set answer = (m.content or '').split('</think>')[-1] -%}
            {{- ('' if ns.in_tool else '<｜Assistant｜>') ~ answer -}}
            {%- if m.tool_calls -%}
                {{- '<｜tool▁calls▁begin｜>' -}}
                {%- for call in m.tool_calls -%}
                    {%- set f = call.function -%}
                    {%- set args = f.arguments if f.arguments is string else f.arguments | tojson -%}
                    {{- ('\\n' if not loop.first else '') ~ '<｜tool▁call▁begin｜>' ~ (call.type or 'function') -}}
                    {{- '<｜tool▁sep｜>' ~ f.name ~ '\\n```json\\n' ~ args ~ '\\n```<｜tool▁call▁end｜>' -}}
                {%- endfor -%}
                {{- '<｜tool▁calls▁end｜>' -}}
            {%- endif -%}
            {{- '<｜end▁of▁sentence｜>' -}}
        {%- endif -%}
        {%- set ns.in_tool = false -%}
    {%- endif -%}
{%- endfor -%}
{%- if ns.in_tool -%}
    {{- '<｜tool▁outputs▁end｜>' -}}
{%- elif add_generation_prompt -%}
    {{- '<｜Assistant｜><think>\\n' -}}
{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _GEMMA,
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "deepseek_r1": _DEEPSEEK_R1,
}


def builtin_chat_template(family: str) -> str:
    """The built-in template for a chat family ("gemma", "chatml", "llama3", "mistral", "deepseek_r1")."""
    template = BUILTIN_TEMPLATES.get(family)
    if template is None:
        raise ValueError(
            f"chat family is {family!r}; built-in templates exist for {sorted(BUILTIN_TEMPLATES)}"
        )
    return template


def read_chat_template(value: str) -> str:
    """The template a setting names: the file at `value`, else `value` itself when it reads as
    template text (it holds a brace or a newline, as vLLM tells the two apart). ValueError when it
    is neither, or when the template does not parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat template file {value!r} cannot be read: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"chat template {value!r} is not a file (nor template text)")
    _compile(text)
    return text


def cut_after_final_message(text: str, last: str) -> str:
    """Continue the last assistant message: `text` (a rendered conversation) cut after that
    message's content `last`, without the template's end-of-turn.

    Templates may trim the content (Gemma's `| trim`), so its stripped form is looked for next;
    one that drops or rewrites it (R1 removes everything up to `</think>`) cannot be continued:
    ValueError, rather than a prompt with the end-of-turn still in place."""
    for needle in (last, last.strip()):
        end = text.rfind(needle) if needle else -1
        if end >= 0:
            return text[: end + len(needle)]
    raise ValueError(
        "the chat template does not write the final assistant message's content as given (it "
        "drops or rewrites it), so it cannot be continued; send the text as a prompt instead"
    )


def choose_named_template(
    default: str | None, named: Mapping[str, str], name: str | None, has_tools: bool
) -> str | None:
    """Which of a checkpoint's templates renders a request, by transformers' rule.

    An explicit `name` wins; else "tool_use" when tools are given and the checkpoint has one; else
    the default template. A `name` that is not one of the checkpoint's is template text itself.
    """
    if name is not None:
        if name == "default" and default is not None:
            return default
        return named.get(name, name)
    if has_tools and "tool_use" in named:
        return named["tool_use"]
    return default


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
        if msg.get("content") is None and role == "assistant" and msg.get("tool_calls"):
            normalized["content"] = None  # OpenAI: an assistant turn that only calls tools
        else:
            normalized["content"] = _content_text(msg.get("content"), i)
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            # Templates read a turn's reasoning under one of these names (as transformers aliases).
            normalized.setdefault("thinking", reasoning)
            normalized["reasoning_content"] = reasoning
        out.append(normalized)
    return out


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template` as transformers' apply_chat_template(tokenize=False) does.

    Special tokens (`bos_token`, `eos_token`, and `unk_token`/`pad_token` through `extra`) that are
    None stay undefined in the template, as in transformers. Raises ValueError carrying the
    template's own message when it rejects the messages (`raise_exception`) or fails on them.
    """
    compiled = _compile(template)
    special = {"bos_token": bos_token, "eos_token": eos_token}
    for key in ("unk_token", "pad_token"):
        special[key] = extra.pop(key, None)
    context = {k: v for k, v in special.items() if v is not None}
    context.update(extra)  # explicit keyword arguments override special tokens, as in transformers
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as exc:
        # raise_exception() in a template and undefined names inside it are the caller's bad input.
        raise ValueError(f"chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        # A template computing on a message of an unexpected shape, e.g. concatenating None.
        raise ValueError(
            f"chat template failed on the messages: {type(exc).__name__}: {exc}"
        ) from exc


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


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
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


class ChatTemplating:
    """`apply_chat_template` and the special tokens' texts, for a tokenizer that has the
    checkpoint's templates, its special ids and `_token(id) -> text` (tidal.loader.tokenizer's
    Tokenizer and tidal.loader.token_encoder's CompactTokenizer)."""

    chat_template: str | None
    named_chat_templates: dict[str, str]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None

    def _token(self, token_id: int | None) -> str | None:
        raise NotImplementedError

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`; encode it with add_special_tokens=False.

        `chat_template` names one of the checkpoint's templates (or is template text); by default
        the "tool_use" variant renders requests with tools when the checkpoint has one.
        """
        template = choose_named_template(
            self.chat_template, self.named_chat_templates, chat_template, tools is not None
        )
        if template is None:
            raise ValueError(
                "this checkpoint has no chat template and its chat family is unknown; "
                f"pass family= one of {sorted(BUILTIN_TEMPLATES)} to load_tokenizer"
            )
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self._token(self.unk_token_id),
            "pad_token": self._token(self.pad_token_id),
        }
        # Keyword arguments override the checkpoint's special tokens, as in transformers.
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**special, **extra},
        )
