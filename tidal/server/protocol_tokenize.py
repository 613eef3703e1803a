"""POST /tokenize and /detokenize: their request bodies (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from tidal.server.protocol import (
    ChatMessage,
    _check_messages,
    _Request,
    _token_ids,
    decode_json,
    parse_request,
)
from tidal.server.tools import check_tools


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """POST /tokenize with messages, rendered through the chat template first."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # the template already holds BOS
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None  # listed as a chat request with them would

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return _check_messages(v)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tools(v)


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        if not _token_ids(v):
            raise ValueError("must be a list of token ids >= 0")
        return v


def parse_tokenize_request(
    body: bytes | str | object,
) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """/tokenize takes either shape; the presence of `messages` decides which."""
    if isinstance(body, bytes | str):
        body = decode_json(body)
    if isinstance(body, dict) and "messages" in body:
        return parse_request(TokenizeChatRequest, body)
    return parse_request(TokenizeCompletionRequest, body)
