"""Chat templates: built-ins against the official Gemma 3 template in transformers, exact strings, errors."""

from __future__ import annotations

import pytest

from tidal.loader.chat_template import (
    builtin_chat_template,
    normalize_messages,
    render_chat_template,
    select_chat_template,
)

# Google's Gemma 3 instruct chat template (tokenizer_config.json of gemma-3-*-it), the reference.
OFFICIAL_GEMMA3 = """{{ bos_token }}
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

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2?\n"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Where is the gold?"},
    ],
    [{"role": "user", "content": "日本語 and émoji 🤖"}, {"role": "assistant", "content": "ok"}],
]


def _gemma(messages: list[dict], add_generation_prompt: bool = True) -> str:
    return render_chat_template(
        builtin_chat_template("gemma"),
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<bos>",
        eos_token="<eos>",
    )


@pytest.fixture(scope="module")
def hf_gemma_tokenizer():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    backend = Tokenizer(
        WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}, unk_token="<unk>")
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        chat_template=OFFICIAL_GEMMA3,
    )


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_gemma_matches_official_template_in_transformers(
    hf_gemma_tokenizer, messages: list[dict], add_generation_prompt: bool
) -> None:
    expected = hf_gemma_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert _gemma(messages, add_generation_prompt) == expected


def test_official_gemma_template_renders_the_same_here(hf_gemma_tokenizer) -> None:
    # Our renderer runs a checkpoint's template exactly as transformers does.
    for messages in CONVERSATIONS:
        ours = render_chat_template(OFFICIAL_GEMMA3, messages, bos_token="<bos>", eos_token="<eos>")
        ref = hf_gemma_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours == ref


def test_gemma_exact_string() -> None:
    assert _gemma(CONVERSATIONS[2]) == (
        "<bos><start_of_turn>user\nYou are a pirate.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nArr, ahoy!<end_of_turn>\n"
        "<start_of_turn>user\nWhere is the gold?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_text_parts_are_joined() -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
        }
    ]
    assert _gemma(parts) == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"


def test_chatml_exact_string() -> None:
    out = render_chat_template(
        builtin_chat_template("chatml"),
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
    )
    assert (
        out
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_exact_string() -> None:
    out = render_chat_template(
        builtin_chat_template("llama3"),
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        bos_token="<|begin_of_text|>",
    )
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_mistral_exact_string() -> None:
    out = render_chat_template(
        builtin_chat_template("mistral"),
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U2"},
        ],
        bos_token="<s>",
        eos_token="</s>",
    )
    assert out == "<s>[INST] S\n\nU1 [/INST]A1</s>[INST] U2 [/INST]"


def test_template_globals_and_named_selection() -> None:
    template = "{{ strftime_now('%Y') | length }}{{ {'k': 'é'} | tojson }}{% if add_generation_prompt %}!{% endif %}"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == '4{"k": "é"}!'
    named = [{"name": "default", "template": "d"}, {"name": "rag", "template": "r"}]
    assert select_chat_template(named) == "d"
    assert select_chat_template(named, "rag") == "r"
    with pytest.raises(ValueError, match="none is called 'tool_use'"):
        select_chat_template(named, "tool_use")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "messages is empty"),
        ("hi", "expected a list"),
        (["hi"], r"messages\[0\] is a str"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role is 'robot'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content is a int"),
        ([{"role": "user"}], r"messages\[0\]\.content is a NoneType"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            "only text parts",
        ),
    ],
)
def test_bad_messages_raise_value_error(messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_messages(messages)
    with pytest.raises(ValueError, match=match):
        _gemma(messages)  # type: ignore[arg-type]


def test_template_errors_become_value_errors() -> None:
    with pytest.raises(ValueError, match="alternate user/assistant"):
        _gemma([{"role": "assistant", "content": "first"}])
    with pytest.raises(ValueError, match="alternate user/assistant"):
        _gemma([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ValueError, match="does not parse"):
        render_chat_template("{% if %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="built-in templates exist for"):
        builtin_chat_template("vicuna")
