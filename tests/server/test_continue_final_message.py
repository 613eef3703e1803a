"""continue_final_message: the prompt ends inside the last assistant message, or the request is
refused; it never goes out with the template's end-of-turn still after the message."""

from __future__ import annotations

import pytest

from tidal.loader.chat_template import builtin_chat_template, render_chat_template
from tidal.server.errors import APIError
from tidal.server.inputs import _cut_after_final_message


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
    assert _cut_after_final_message(text, "Hello, how").endswith("<|im_start|>assistant\nHello, how")


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
