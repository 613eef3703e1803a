"""StreamClient: sends one trace request as a streaming OpenAI call on a pooled session and times its tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.bench.trace import TraceRequest


@dataclass(slots=True)
class RequestRecord:
    """What one request did, on the load generator's clock (seconds since the run started).

    `chunk_times_s` are arrival times of SSE chunks that carried text; one chunk may hold more
    than one token, so inter-token latencies are chunk gaps and TPOT uses token counts."""

    index: int
    scheduled_s: float  # when the arrival process wanted it sent
    sent_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None  # from usage; None when the server sent none
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token after the first: (E2E - TTFT) / (tokens - 1)."""
        if self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Fields every request of a run shares."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = (
        True  # fixed output lengths, so targets do the same work (vLLM/llama.cpp know it)
    )
    api_key: str | None = None


def request_body(req: TraceRequest, opts: RequestOptions) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the streaming call for `req`."""
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": req.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if req.is_chat:
        body["messages"] = [{"role": r, "content": c} for r, c in req.messages]
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return "/v1/completions", body


def _carries_token(chunk: dict[str, Any]) -> bool:
    """Whether an SSE chunk holds output. Text counts; so does an empty text with no finish
    reason (a token that decodes to nothing yet, e.g. half a UTF-8 character), but not a chat
    chunk that only announces the role, nor an empty closing chunk. A reasoning model's thought
    (`delta.reasoning_content`, streamed before its answer) is output too."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("reasoning_content"):
            return True
        part = delta if isinstance(delta, dict) else choice
        key = "content" if isinstance(delta, dict) else "text"
        text = part.get(key)
        if text:
            return True
        if text is not None and choice.get("finish_reason") is None and "role" not in part:
            return True
    return False


_STALE_RETRIES = 3  # sends lost to pooled connections the server had closed, before giving up


class StreamClient:
    """Sends requests on one aiohttp session (keep-alive connection pool) and records timings."""

    def __init__(
        self, base_url: str, opts: RequestOptions, clock: Callable[[], float], session: Any
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.opts = opts
        self.clock = clock
        self.session = session  # aiohttp.ClientSession

    async def send(self, req: TraceRequest, record: RequestRecord) -> RequestRecord:
        path, body = request_body(req, self.opts)
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        record.sent_s = self.clock()
        num_text_chunks = 0
        try:
            resp_cm = await self._post(path, body, headers)
            async with resp_cm as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    record.error = f"HTTP {resp.status}: {text}"
                    return record
                buffer = b""
                async for data in resp.content.iter_any():
                    buffer += data
                    # SSE events end with a blank line; a network read may hold several or half.
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        num_text_chunks += self._on_event(event, record)
        except Exception as e:  # a refused or dropped connection is a failed request, not a crash
            record.error = f"{type(e).__name__}: {e}"
        finally:
            record.finished_s = self.clock()
        if record.error is None and record.num_output_tokens == 0:
            record.num_output_tokens = num_text_chunks  # no usage: one token per chunk
        return record

    async def _post(self, path: str, body: dict, headers: dict) -> Any:
        """The response of one POST. A pooled keep-alive connection the server closed while idle
        fails before any response (ServerDisconnectedError, or an OSError writing the body); such
        a request never reached the server, so it is sent once more on a fresh connection
        (llama-server closes idle connections; without this, 2 of 12 requests failed there). Only
        these errors before any response are retried; anything later fails the request."""
        import aiohttp

        for _ in range(_STALE_RETRIES):
            try:
                return await self.session.post(self.base_url + path, json=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                pass  # the pool may hold several closed connections: take the next
        return await self.session.post(self.base_url + path, json=body, headers=headers)

    def _on_event(self, event: bytes, record: RequestRecord) -> int:
        """Handle one SSE event; 1 when it carried text."""
        for line in event.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return 0
            now = self.clock()
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                record.error = f"bad SSE payload: {payload[:100]!r}"
                return 0
            if "error" in chunk:
                record.error = f"stream error: {str(chunk['error'])[:200]}"
                return 0
            usage = chunk.get("usage")
            if usage:
                record.num_prompt_tokens = usage.get("prompt_tokens")
                record.num_output_tokens = int(usage.get("completion_tokens") or 0)
            if _carries_token(chunk):
                if record.first_token_s is None:
                    record.first_token_s = now
                record.chunk_times_s.append(now)
                return 1
        return 0
