"""How chat messages become the template's input: continue_final_message ends the prompt inside
the last assistant message (or is refused, never sent with the end-of-turn after it), and an
assistant turn's reasoning reaches templates that replay it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.loader.chat_template import builtin_chat_template, render_chat_template
from tidal.loader.tokenizer import load_tokenizer
from tidal.server.errors import APIError
from tidal.server.inputs import PromptLimits, _cut_after_final_message, _message_dict, chat_input
from tidal.server.protocol import ChatCompletionRequest, parse_request
from tidal.server.tools import tool_mode


def _rendered(family: str, messages: list[dict]) -> str:
    return render_chat_template(
        builtin_chat_template(family), messages, add_generation_prompt=False, bos_token="<bos>"
    )


def test_a_template_that_trims_the_content_is_cut_after_the_trimmed_text() -> None:
    # Gemma's template writes `content | trim`: the trailing space is gone from the prompt.
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is "},
    ]
    text = _rendered("gemma", messages)
    assert "The colour is \n" not in text and "The colour is<end_of_turn>" in text
    cut = _cut_after_final_message(text, messages[-1]["content"])
    assert cut.endswith("<start_of_turn>model\nThe colour is")
    assert "<end_of_turn>" not in cut[cut.rfind("<start_of_turn>model") :]


def test_the_content_as_written_is_cut_exactly() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, how"},
    ]
    text = _rendered("chatml", messages)
    assert _cut_after_final_message(text, "Hello, how").endswith(
        "<|im_start|>assistant\nHello, how"
    )


def test_a_template_that_rewrites_the_message_is_refused_with_the_field() -> None:
    # R1's template keeps only what follows `</think>` of an assistant message.
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them</think>"},
    ]
    text = _rendered("deepseek_r1", messages)
    assert "add them" not in text
    with pytest.raises(APIError) as info:
        _cut_after_final_message(text, messages[-1]["content"])
    assert info.value.status == 400 and info.value.param == "continue_final_message"


# Qwen3's way of replaying the reasoning of an assistant turn (its template, reduced).
_REPLAYS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content is string %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistant_turns_reasoning_reaches_the_template(field: str) -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", field: "two and two make four"},
            ],
        }
    )
    messages = [_message_dict(m) for m in req.messages]
    assert messages[1]["reasoning_content"] == "two and two make four"
    text = render_chat_template(_REPLAYS_REASONING, messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\ntwo and two make four\n</think>\n\n4" in text


def test_reasoning_on_a_user_message_is_refused() -> None:
    with pytest.raises(ValidationError, match="only assistant messages carry reasoning"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi", "reasoning": "x"}]}
        )


def test_a_request_names_a_chat_template_but_cannot_send_one(tiny_checkpoint) -> None:
    # Template text is a program the server would run for any client; a name picks one of the
    # checkpoint's own, at the top level or in chat_template_kwargs (as transformers takes it).
    tok = load_tokenizer(tiny_checkpoint)
    limits = PromptLimits(512, tok.vocab_size, 500, False)
    base = {"messages": [{"role": "user", "content": "hi"}]}
    plain = chat_input(parse_request(ChatCompletionRequest, base), tok, limits).token_ids
    named = {**base, "chat_template": "default"}
    assert chat_input(parse_request(ChatCompletionRequest, named), tok, limits).token_ids == plain
    loop = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
    for body in (
        {**base, "chat_template": loop},
        {**base, "chat_template_kwargs": {"chat_template": loop}},
    ):
        with pytest.raises(APIError) as info:
            chat_input(parse_request(ChatCompletionRequest, body), tok, limits)
        assert info.value.param == "chat_template" and "template text" in info.value.message


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_elsewhere(
    tiny_checkpoint,
) -> None:
    tok = load_tokenizer(tiny_checkpoint)
    limits = PromptLimits(512, tok.vocab_size, 500, False)
    base = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as info:  # Gemma's template reads no effort
        chat_input(
            parse_request(ChatCompletionRequest, {**base, "reasoning_effort": "low"}), tok, limits
        )
    assert info.value.param == "reasoning_effort" and "enable_thinking" in info.value.message
    # One that does (as gpt-oss's): the effort is in the prompt; the char-level vocabulary
    # makes "high" one token longer than "low".
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}effort:{{ reasoning_effort }}"
    )
    lengths = [
        len(chat_input(parse_request(ChatCompletionRequest, {**base, "reasoning_effort": e}), tok, limits).token_ids)
        for e in ("low", "high")
    ]  # fmt: skip
    assert lengths[1] == lengths[0] + 1


def test_tools_go_through_the_tool_use_template_without_a_second_listing(tiny_checkpoint) -> None:
    # A checkpoint whose default template knows no tools and whose "tool_use" template lists
    # them (as Hermes-style checkpoints ship): a request with tools renders with tool_use, and
    # the plain-text fallback, meant for templates that never read tools, must not be added too.
    tok = load_tokenizer(tiny_checkpoint)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    tok.named_chat_templates = {
        "tool_use": "{% for t in tools %}T:{{ t['function']['name'] }};{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};"
        "{% for c in m.get('tool_calls') or [] %}C:{{ c['function']['name'] }};{% endfor %}"
        "{% endfor %}"
    }
    limits = PromptLimits(512, tok.vocab_size, 500, False)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": "sum"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ],
        "tools": tools,
    }
    req = parse_request(ChatCompletionRequest, body)
    ids = chat_input(req, tok, limits, tool_mode(tools, None, None)).token_ids
    text = tok.decode(ids)
    assert text.startswith("T:add;") and "C:add;" in text and "tool:3;" in text
    assert "You can call these functions" not in text and "<tool_call>" not in text
