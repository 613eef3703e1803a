"""KVCacheManager: per-request block tables over one BlockPool, with prefix hits and sliding windows."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tidal.config.cache import CacheConfig
from tidal.kv.block_pool import NULL_BLOCK, BlockPool
from tidal.kv.hashing import BlockHash, extend_block_hashes
from tidal.kv.layout import KVLayout
from tidal.request import Request


def num_skipped_blocks(next_query_pos: int, window: int, block_size: int) -> int:
    """Leading blocks no query at position >= next_query_pos can see through a sliding window.

    A query at q sees keys q-W+1 .. q (W keys, itself included: HF's `kv_idx > q_idx - W`).
    Every future query has q >= next_query_pos, so token t is dead once t <= next_query_pos - W,
    and block b (tokens b*bs .. (b+1)*bs-1) is dead once (b+1)*bs <= next_query_pos - W + 1:

        W=8, bs=4, next_query_pos=13: the query at 13 sees keys 6..13
        tokens  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 ..
        block      0    |    1    |     2     |   3
                  dead    6,7 live
        skipped = (13 - 8 + 1) // 4 = 6 // 4 = 1
    """
    return max(0, (next_query_pos - window + 1) // block_size)


@dataclass(slots=True)
class _RequestBlocks:
    # Per KV group, the block table; sliding groups hold NULL_BLOCK for dead leading entries.
    tables: list[list[int]]
    # Per group, how many leading entries were already considered for hash registration.
    num_registered: list[int]
    # Per group, how many leading entries were already replaced by the null block.
    num_skipped: list[int]
    session_id: str | None
    session_turn: int


# Session bookkeeping is pruned once it holds at least this many sessions (and twice as many as
# after the last prune).
SESSION_PRUNE_MIN = 1024


class KVCacheManager:
    """Block tables per request and KV group; `None` from allocate_slots means "does not fit".

    Blocks are allocated as tokens are scheduled (no reservation of the max length). Full blocks
    are registered in the prefix cache when they are allocated for a step that computes their
    last token. NOTE: so a request admitted later in the same step may hit a block that is
    written in that very step; it always comes later in SchedulerOutput.scheduled, so the runner
    must write a layer's new K/V of earlier requests before later requests read that layer.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        extra_keys: tuple[object, ...] = (),
    ) -> None:
        if layout.block_size != config.block_size:
            raise ValueError(
                f"layout.block_size={layout.block_size} is invalid: expected config.block_size={config.block_size}"
            )
        self.layout = layout
        self.config = config
        self.block_size = layout.block_size
        self.extra_keys = extra_keys
        self.pool = BlockPool(num_blocks, clock, config.session_turns)
        self._windows = [g.sliding_window for g in layout.groups]
        self._reqs: dict[str, _RequestBlocks] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._queried: set[str] = set()
        # Per session: next turn number, and request id -> turn of its latest turns. Sessions
        # that no block and no live request refers to are pruned (see _prune_sessions).
        self._sessions: dict[str, tuple[int, OrderedDict[str, int]]] = {}
        self._sessions_after_prune = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- stats ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks referenced by requests (idle cached blocks are free)."""
        usable = self.pool.num_blocks - 1
        return (usable - self.pool.num_free) / usable

    @property
    def evictions_by_reason(self) -> dict[str, int]:
        return self.pool.evictions_by_reason

    # ---- prefix hits --------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> int:
        """Tokens of the request already in the prefix cache; records the query once per admission.

        A multiple of block_size, and at most num_tokens - 1: the last token is always computed
        so that there are logits to sample.
        """
        num_hit_tokens = self.peek_computed_tokens(request)
        if self.config.enable_prefix_caching and request.request_id not in self._queried:
            # A waiting request asked again next step (it did not fit) is counted once.
            self._queried.add(request.request_id)
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def peek_computed_tokens(self, request: Request) -> int:
        """Like get_computed_blocks without recording stats (for queue ordering estimates)."""
        if not self.config.enable_prefix_caching:
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position must be computed to score it (echo + logprobs)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)[:max_blocks]
        return self._longest_hit(hashes) * self.block_size

    def _longest_hit(self, hashes: list[BlockHash]) -> int:
        """Most leading blocks k such that every group has the blocks that position k*bs needs.

        Full groups need blocks 0..k-1; a sliding group needs blocks skipped(k*bs)..k-1. Start
        from the longest run cached in all full groups, then shrink k until every sliding group
        is satisfied; shrinking for one sliding group can break another, so loop to a fixpoint.
        """
        k = len(hashes)
        for g, window in enumerate(self._windows):
            if window is None:
                n = 0
                while n < k and self.pool.lookup((g, hashes[n])) is not None:
                    n += 1
                k = n
        # run[g][b] = length of the run of cached blocks of group g ending at block b.
        runs: dict[int, list[int]] = {}
        for g, window in enumerate(self._windows):
            if window is not None:
                run, length = [], 0
                for b in range(k):
                    length = length + 1 if self.pool.lookup((g, hashes[b])) is not None else 0
                    run.append(length)
                runs[g] = run
        changed = True
        while changed and k > 0:
            changed = False
            for g, run in runs.items():
                window = self._windows[g]
                assert window is not None
                while k > 0:
                    needed = k - num_skipped_blocks(k * self.block_size, window, self.block_size)
                    if needed <= 0 or run[k - 1] >= needed:
                        break
                    k -= 1
                    changed = True
        return k

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            extend_block_hashes(
                hashes, request.all_token_ids, self.block_size, num_blocks, self.extra_keys
            )
        return hashes

    # ---- allocation ---------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> list[list[int]] | None:
        """Make room for this step's tokens; returns the per-group block tables, or None.

        None means the blocks do not fit and nothing was allocated (the sliding-window release of
        dead blocks may still have happened: those are never needed again).

            |<-------- num_computed -------->|<-- num_cached -->|<-- num_new_tokens -->|
            |  KV exists (earlier steps)     | prefix-cache hit | computed this step   |
            0                                                 start                   end
            |<- null (sliding, dead) ->|<------ blocks kept / hit ------>|<- new blocks ->|

        num_cached_tokens (a multiple of block_size, from get_computed_blocks) is only passed on
        a request's first call, when num_computed is 0: those blocks are taken by reference.
        Blocks are appended until the table covers [0, end); the scheduler then advances
        request.num_computed_tokens to end.
        """
        bs = self.block_size
        state = self._reqs.get(request.request_id)
        if num_new_tokens < 0 or num_cached_tokens < 0 or num_cached_tokens % bs:
            raise ValueError(
                f"num_new_tokens={num_new_tokens}, num_cached_tokens={num_cached_tokens} are invalid: "
                f"expected counts >= 0 and num_cached_tokens a multiple of {bs}"
            )
        if state is not None and num_cached_tokens:
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} is invalid for request {request.request_id!r}: "
                "cached blocks are only taken on its first allocate_slots call"
            )
        start = request.num_computed_tokens + num_cached_tokens
        end = start + num_new_tokens
        if state is None:
            tables = self._hit_tables(request, num_cached_tokens // bs)
            hit_ids = {b for t in tables for b in t if b != NULL_BLOCK}
            num_idle_hits = sum(1 for b in hit_ids if self.pool.blocks[b].ref_cnt == 0)
        else:
            self._release_dead(state, start)
            tables = state.tables
            num_idle_hits = 0
        blocks_needed = [max(0, -(-end // bs) - len(t)) for t in tables]
        if sum(blocks_needed) + num_idle_hits > self.pool.num_free:
            return None
        if state is None:
            self.pool.touch(b for t in tables for b in t if b != NULL_BLOCK)
            state = self._new_state(request, tables, num_cached_tokens // bs)
        for table, n in zip(tables, blocks_needed, strict=True):
            if n:
                table.extend(self.pool.take(n))
        self._register_full_blocks(request, state, min(end, request.num_tokens) // bs)
        return self.block_tables(request)

    def _hit_tables(self, request: Request, num_hit_blocks: int) -> list[list[int]]:
        if not num_hit_blocks:
            return [[] for _ in self._windows]
        hashes = self._block_hashes(request, num_hit_blocks)
        tables = []
        for g, window in enumerate(self._windows):
            skipped = (
                0
                if window is None
                else num_skipped_blocks(num_hit_blocks * self.block_size, window, self.block_size)
            )
            table = [NULL_BLOCK] * skipped
            for b in range(skipped, num_hit_blocks):
                block_id = self.pool.lookup((g, hashes[b]))
                if block_id is None:
                    raise ValueError(
                        f"num_cached_tokens={num_hit_blocks * self.block_size} is invalid for request "
                        f"{request.request_id!r}: block {b} of group {g} is no longer cached; call "
                        "get_computed_blocks right before allocate_slots"
                    )
                table.append(block_id)
            tables.append(table)
        return tables

    def _new_state(
        self, request: Request, tables: list[list[int]], num_hit_blocks: int
    ) -> _RequestBlocks:
        skipped = [next((i for i, b in enumerate(t) if b != NULL_BLOCK), len(t)) for t in tables]
        state = _RequestBlocks(
            tables, [num_hit_blocks] * len(tables), skipped, request.session_id, 0
        )
        if request.session_id is not None:
            state.session_turn = self._session_turn(request.session_id, request.request_id)
        self._reqs[request.request_id] = state
        return state

    def _session_turn(self, session_id: str, request_id: str) -> int:
        """Number the turns of a session; a preempted request keeps its turn when it resumes."""
        next_turn, recent = self._sessions.get(session_id, (0, OrderedDict()))
        if request_id in recent:
            return recent[request_id]
        recent[request_id] = next_turn
        while len(recent) > self.config.session_turns + 1:
            recent.popitem(last=False)
        self._sessions[session_id] = (next_turn + 1, recent)
        self.pool.latest_turn[session_id] = next_turn
        return next_turn

    def release_out_of_window(self, request: Request) -> None:
        """Give back the sliding-window blocks no query at position >= num_computed_tokens sees.

        The scheduler calls this for every running request before it builds a step, so a
        request that gets no tokens this step does not keep the blocks its last chunk needed
        (kv/block_pool.py sliding_window_blocks counts on it). allocate_slots does the same for
        the request it allocates for."""
        state = self._reqs.get(request.request_id)
        if state is not None:
            self._release_dead(state, request.num_computed_tokens)

    def _release_dead(self, state: _RequestBlocks, next_query_pos: int) -> None:
        for g, window in enumerate(self._windows):
            if window is None:
                continue
            table = state.tables[g]
            dead = min(num_skipped_blocks(next_query_pos, window, self.block_size), len(table))
            for b in range(state.num_skipped[g], dead):
                if table[b] != NULL_BLOCK:
                    self.pool.release([table[b]], state.session_id, state.session_turn)
                    table[b] = NULL_BLOCK
            state.num_skipped[g] = max(state.num_skipped[g], dead)

    def _register_full_blocks(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        if not self.config.enable_prefix_caching:
            return
        if num_full > min(state.num_registered):
            hashes = self._block_hashes(request, num_full)
            for g, table in enumerate(state.tables):
                for b in range(state.num_registered[g], num_full):
                    if table[b] != NULL_BLOCK:
                        self.pool.register(table[b], (g, hashes[b]))
                state.num_registered[g] = max(state.num_registered[g], num_full)

    # ---- release ------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; full hashed ones stay cached for reuse. Idempotent."""
        self._hashes.pop(request.request_id, None)
        self._queried.discard(request.request_id)
        state = self._reqs.pop(request.request_id, None)
        if state is None:
            return
        # Tail blocks first, so they reach the LRU end before the shared heads of the prefix.
        for b in range(max(map(len, state.tables)) - 1, -1, -1):
            ids = [t[b] for t in state.tables if b < len(t) and t[b] != NULL_BLOCK]
            if ids:
                self.pool.release(ids, state.session_id, state.session_turn)
        if len(self._sessions) >= max(SESSION_PRUNE_MIN, 2 * self._sessions_after_prune):
            self._prune_sessions()

    def _prune_sessions(self) -> None:
        """Forget sessions that no block and no live request refers to, so the bookkeeping does
        not grow with every session id a long-running server has seen. A forgotten session that
        returns starts its turns again at 0: it has no blocks left to rank. One scan of the pool,
        run when the count has doubled since the last prune (amortized O(1) per request)."""
        live = {b.session_id for b in self.pool.blocks if b.session_id is not None}
        live.update(st.session_id for st in self._reqs.values() if st.session_id is not None)
        for session_id in [s for s in self._sessions if s not in live]:
            del self._sessions[session_id]
            self.pool.latest_turn.pop(session_id, None)
        self._sessions_after_prune = len(self._sessions)

    def block_tables(self, request: Request) -> list[list[int]]:
        """Copies of the request's per-group block tables (empty lists before its first allocation)."""
        state = self._reqs.get(request.request_id)
        if state is None:
            return [[] for _ in self._windows]
        return [list(t) for t in state.tables]

    def evict_expired(self) -> int:
        """Drop idle cached blocks older than config.prefix_ttl_s (reason "ttl"); returns how many."""
        return self.pool.evict_expired(self.config.prefix_ttl_s)

    @property
    def num_requests(self) -> int:
        """Requests that hold blocks."""
        return len(self._reqs)
