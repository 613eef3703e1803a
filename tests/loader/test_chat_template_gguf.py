"""Chat templates from GGUF metadata render exactly as transformers renders them from the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.loader.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")

# Written for these tests: one template that leans on every piece of transformers' Jinja
# environment a real checkpoint's template uses.
TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(system=none, turns=0) -%}
{%- if messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {#- a default system prompt, dated, when the conversation brings none -#}
    {%- set ns.system = 'You are Tidebot. Year: ' ~ strftime_now('%Y') ~ '.' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
<|system|>
{{ ns.system }}
{%- if tools is not none %}

# Tools
{% for tool in tools -%}
{{ tool | tojson(indent=2) }}
{% endfor -%}
{%- endif %}
{%- if documents is defined and documents %}
{%- for doc in documents %}
[doc {{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{%- endfor %}
{%- endif %}
<|end|>
{% for message in loop_messages -%}
    {%- if message.role == 'system' -%}
        {{- raise_exception('System messages are only allowed first, got one at ' ~ loop.index0) -}}
    {%- endif -%}
    {%- if message.content is string and message.content.startswith('#skip') -%}
        {%- continue -%}
    {%- endif -%}
    {%- if message.content is string and message.content == '#stop' -%}
        {%- break -%}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
<|{{ message.role }}|>
{% if message.role == 'assistant' -%}
{%- if message.reasoning_content is defined -%}<think>{{ message.reasoning_content | trim }}</think>
{% endif -%}
{%- generation -%}
{%- if message.tool_calls is defined -%}
{%- for call in message.tool_calls -%}
<tool_call>{{ call.function | tojson }}</tool_call>
{%- endfor -%}
{%- else -%}
{{ message.content | trim }}
{%- endif -%}
{%- endgeneration -%}
{%- else -%}
{{ message.content }}
{%- endif %}
<|end|>{{ '\\n' if not loop.last else '' }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif -%}
{{- '' if unk_token is defined else '(no unk)' -}}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "tide_height",
            "description": "Höhe der Flut in Metern",
            "parameters": {"type": "object", "properties": {"port": {"type": "string"}}},
        },
    }
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "  2+2?\n"}],
    [
        {"role": "user", "content": "Tide at Brest?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "tide_height", "arguments": {"port": "Brest"}},
                }
            ],
        },
        {"role": "tool", "content": '{"m": 6.1}'},
        {"role": "assistant", "content": "6.1 m.", "reasoning_content": " read the tool "},
        {"role": "user", "content": "#skip this one"},
        {"role": "user", "content": "日本語 🤖"},
        {"role": "user", "content": "#stop"},
        {"role": "user", "content": "never rendered"},
    ],
]


def _gguf_with_templates(path: Path, default: str, named: dict[str, str] | None = None) -> Path:
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if named:
        writer.add_chat_template(
            [
                {"name": "default", "template": default},
                *({"name": k, "template": v} for k, v in named.items()),
            ]
        )
    else:
        writer.add_chat_template(default)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tpl")
    path = _gguf_with_templates(root / "t.gguf", TEMPLATE)
    ref = transformers.AutoTokenizer.from_pretrained(root, gguf_file=path.name)
    return load_tokenizer(path), ref


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_metadata_template_matches_transformers(
    files, index: int, add_generation_prompt: bool, with_tools: bool
) -> None:
    ours, ref = files
    messages = CONVERSATIONS[index]
    tools = TOOLS if with_tools else None
    expected = ref.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    assert got == expected
    assert "You are Tidebot" in got or messages[0]["role"] == "system"


def test_documents_and_template_kwargs_match_transformers(files) -> None:
    ours, ref = files
    docs = [{"title": "Tides", "text": "Twice a day."}]
    messages = CONVERSATIONS[0]
    expected = ref.apply_chat_template(messages, documents=docs, tokenize=False)
    assert ours.apply_chat_template(messages, documents=docs, add_generation_prompt=False) == (
        expected
    )
    # A keyword argument overrides a special token, as in transformers.
    expected = ref.apply_chat_template(messages, tokenize=False, bos_token="[B]")
    assert ours.apply_chat_template(messages, add_generation_prompt=False, bos_token="[B]") == (
        expected
    )


def test_raise_exception_is_a_value_error_with_the_templates_message(files) -> None:
    ours, ref = files
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(Exception, match="only allowed first, got one at 1"):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="only allowed first, got one at 1"):
        ours.apply_chat_template(bad)


def test_named_templates_from_metadata(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tool_use = "TOOLS:{{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    rag = "RAG{% for m in messages %}|{{ m.content }}{% endfor %}"
    path = _gguf_with_templates(tmp_path / "n.gguf", TEMPLATE, {"tool_use": tool_use, "rag": rag})
    ours = load_tokenizer(path)
    assert ours.named_chat_templates == {"tool_use": tool_use, "rag": rag}
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # transformers' GGUF reader keeps only the default; give it the same named set by hand.
    ref.chat_template = {"default": TEMPLATE, "tool_use": tool_use, "rag": rag}
    messages = CONVERSATIONS[0]
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "rag"}, {"chat_template": "default"}):
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours.apply_chat_template(messages, **kwargs) == expected, kwargs
    assert ours.apply_chat_template(messages, tools=TOOLS).startswith("TOOLS:1|Hi")


def test_template_that_fails_is_a_400_with_its_message(files) -> None:
    from tidal.server.errors import APIError
    from tidal.server.inputs import PromptLimits, chat_input
    from tidal.server.protocol import ChatCompletionRequest

    ours, _ = files
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "late"},
            ],
        }
    )
    limits = PromptLimits(
        max_model_len=64, vocab_size=ours.vocab_size, max_input_tokens=63, truncate_left=False
    )
    with pytest.raises(APIError) as err:
        chat_input(req, ours, limits)
    assert err.value.status == 400
    assert "System messages are only allowed first, got one at 1" in str(err.value.message)
