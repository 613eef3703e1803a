"""Prompt truncation: vLLM's per-request truncate_prompt_tokens (the last k tokens, BOS kept in
front) and the server's truncation=left, on the tiny checkpoint's real (character) tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.loader.tokenizer import Tokenizer, load_tokenizer
from tidal.server.errors import APIError
from tidal.server.inputs import PromptInput, PromptLimits, chat_input, completion_inputs
from tidal.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

PROMPT = "The tide comes in and goes out"  # one token per character, BOS in front


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> Tokenizer:
    return load_tokenizer(tiny_checkpoint)


def _limits(tok: Tokenizer, max_input: int = 100, left: bool = False) -> PromptLimits:
    return PromptLimits(512, tok.vocab_size, max_input, left)


def _complete(tok: Tokenizer, limits: PromptLimits, **body: object) -> list[PromptInput]:
    return completion_inputs(parse_request(CompletionRequest, body), tok, limits)


def test_truncate_prompt_tokens_keeps_the_last_tokens_after_bos(tok: Tokenizer) -> None:
    full = tok.encode(PROMPT)
    assert full[0] == tok.bos_token_id and len(full) == len(PROMPT) + 1
    (inp,) = _complete(tok, _limits(tok), prompt=PROMPT, truncate_prompt_tokens=5, echo=True)
    assert inp.token_ids == [full[0], *full[-4:]] and inp.text == " out"
    (ids,) = _complete(tok, _limits(tok), prompt=full[1:], truncate_prompt_tokens=3)
    assert ids.token_ids == full[-3:]  # no BOS given, none kept
    (same,) = _complete(tok, _limits(tok), prompt=PROMPT, truncate_prompt_tokens=100)
    assert same.token_ids == full


def test_minus_one_keeps_what_fits_and_more_than_fits_is_refused(tok: Tokenizer) -> None:
    full = tok.encode(PROMPT)
    (inp,) = _complete(tok, _limits(tok, max_input=10), prompt=PROMPT, truncate_prompt_tokens=-1)
    assert inp.token_ids == [full[0], *full[-9:]]
    with pytest.raises(APIError) as info:
        _complete(tok, _limits(tok, max_input=10), prompt=PROMPT, truncate_prompt_tokens=20)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    # The server's truncation=left takes what fits, whatever the request asks for.
    (left,) = _complete(tok, _limits(tok, 10, left=True), prompt=PROMPT, truncate_prompt_tokens=20)
    assert left.token_ids == inp.token_ids
    (left,) = _complete(tok, _limits(tok, 10, left=True), prompt=PROMPT)
    assert left.token_ids == inp.token_ids
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, {"prompt": PROMPT, "truncate_prompt_tokens": 0})
    assert info.value.param == "truncate_prompt_tokens"


def test_chat_keeps_the_rendered_prompts_last_tokens(tok: Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}]}
    whole = chat_input(parse_request(ChatCompletionRequest, body), tok, _limits(tok)).token_ids
    req = parse_request(ChatCompletionRequest, {**body, "truncate_prompt_tokens": 8})
    cut = chat_input(req, tok, _limits(tok)).token_ids
    assert whole[0] == tok.bos_token_id and cut == [whole[0], *whole[-7:]]
