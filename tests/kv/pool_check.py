"""Helpers shared by the KV tests: request builders, a fake clock and the pool-is-clean check."""

from __future__ import annotations

from tidal.kv.manager import KVCacheManager
from tidal.request import Request
from tidal.sampling_params import SamplingParams


class FakeClock:
    """A settable clock: tests move time by hand instead of sleeping."""

    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_request(
    request_id: str, token_ids: list[int], session_id: str | None = None, **kwargs: object
) -> Request:
    return Request(
        request_id,
        list(token_ids),
        SamplingParams(temperature=0.0),
        arrival_time_s=0.0,
        session_id=session_id,
        **kwargs,  # type: ignore[arg-type]
    )


def step(
    kv: KVCacheManager, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
) -> list[list[int]]:
    """Allocate like the scheduler does, then advance num_computed_tokens past the step."""
    tables = kv.allocate_slots(request, num_new_tokens, num_cached_tokens)
    assert tables is not None
    request.num_computed_tokens += num_cached_tokens + num_new_tokens
    return tables


def assert_pool_clean(kv: KVCacheManager) -> None:
    """No request holds blocks, every ref count is zero and the whole pool is free."""
    assert kv.num_requests == 0
    assert [b.block_id for b in kv.pool.blocks if b.ref_cnt != 0] == []
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert kv.usage == 0.0
