"""BlockPool: KV block ids, reference counts, the LRU free queues and the prefix-cache hash map."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tidal.kv.hashing import BlockHash
from tidal.kv.layout import KVLayout

NULL_BLOCK = 0

# (KV group index, block hash): one token content has one hash, but each group owns its own
# block for it, so the group is part of the key.
HashKey = tuple[int, BlockHash]

EVICTION_REASONS = ("lru", "ttl", "pressure")


@dataclass(slots=True)
class Block:
    """One page of the pool. Free blocks have ref_cnt 0; cached ones also keep their hash_key."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix-cache map.
    hash_key: HashKey | None = None
    # Clock time of the last hit or release; TTL and LRU order read it.
    last_used_s: float = 0.0
    # The session turn that last released this block (see BlockPool eviction order).
    session_id: str | None = None
    session_turn: int = 0


class BlockPool:
    """All block ids of the pool (id 0 is the null block and never handed out).

    Free blocks live in one of three queues, each in release order (front = least recently used):
      - `_uncached`: no hash, handed out first, most recently released first (a stack);
      - `_cached_anon`: hashed, released by a request without session;
      - `_cached_session`: hashed, last released by a session request.
    Eviction order when `_uncached` runs dry (one tier after the other, LRU inside each):
      1. anonymous cached blocks                                     (reason "lru")
      2. session blocks of turns older than their session's last N   (reason "lru")
      3. session blocks of the last N turns: memory pressure forced out a block that the
         retention policy promised to keep                           (reason "pressure")
    where N = session_turns and a block's turn is the turn of the request that last released it.

    NOTE: `_uncached` is a stack (LIFO), block 1 on top at start: the pages of a block that was
    just released are still resident, while a never-used block's pages are not (the KV tensors
    are lazily backed on the CPU, see tidal.attention.page_memory), so handing out the most
    recent one first keeps the resident memory at the peak number of blocks in use rather than
    letting it creep up to the whole pool. Which block a request gets never changes its output.
    """

    def __init__(self, num_blocks: int, clock: Callable[[], float], session_turns: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks} is invalid: expected >= 2 (block 0 is the null block)"
            )
        self.num_blocks = num_blocks
        self._clock = clock
        self._session_turns = session_turns
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The top of the stack is the right end: block 1 first, then 2, 3, ...
        self._uncached: deque[int] = deque(range(num_blocks - 1, 0, -1))
        self._cached_anon: OrderedDict[int, None] = OrderedDict()
        self._cached_session: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[HashKey, int] = {}
        # The newest turn number seen per session (the manager numbers turns).
        self.latest_turn: dict[str, int] = {}
        self.evictions_by_reason: dict[str, int] = dict.fromkeys(EVICTION_REASONS, 0)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-used ones plus evictable cached ones)."""
        return len(self._uncached) + len(self._cached_anon) + len(self._cached_session)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix-cache map (in use or not)."""
        return len(self._by_hash)

    def lookup(self, key: HashKey) -> int | None:
        return self._by_hash.get(key)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit (out of the free queue if idle)."""
        now = self._clock()
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._free_queue_of(block).pop(block_id)
            block.ref_cnt += 1
            block.last_used_s = now

    def take(self, n: int) -> list[int]:
        """Hand out n blocks with ref_cnt 1: unhashed ones first (the most recently released
        first), then evicted cached ones (least recently used first)."""
        if n > self.num_free:
            raise RuntimeError(
                f"asked for {n} blocks with only {self.num_free} free; check num_free first"
            )
        ids = [self._uncached.pop() for _ in range(min(n, len(self._uncached)))]
        if len(ids) < n:
            ids.extend(self._evict(n - len(ids)))
        now = self._clock()
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt = 1
            block.last_used_s = now
        return ids

    def release(
        self, block_ids: Iterable[int], session_id: str | None = None, turn: int = 0
    ) -> None:
        """Drop one reference each; idle blocks join the most recent end of a free queue (the
        top of the `_uncached` stack, the tail of a cached LRU queue)."""
        now = self._clock()
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block_id == NULL_BLOCK or block.ref_cnt <= 0:
                raise RuntimeError(f"release of block {block_id} with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if session_id is not None:
                block.session_id, block.session_turn = session_id, turn
            if block.ref_cnt > 0:
                continue
            block.last_used_s = now
            if block.hash_key is None:
                block.session_id = None
                self._uncached.append(block_id)
            else:
                self._free_queue_of(block)[block_id] = None

    def register(self, block_id: int, key: HashKey) -> bool:
        """Put a full, computed block in the hash map; False if that content is cached already."""
        if key in self._by_hash:
            return False
        self._by_hash[key] = block_id
        self.blocks[block_id].hash_key = key
        return True

    def evict_expired(self, ttl_s: float) -> int:
        """Drop idle cached blocks not used for more than ttl_s; returns how many."""
        now = self._clock()
        count = 0
        for queue in (self._cached_anon, self._cached_session):
            # Each queue is in release order, so last_used_s grows from the front.
            while queue:
                block_id = next(iter(queue))
                if now - self.blocks[block_id].last_used_s <= ttl_s:
                    break
                queue.pop(block_id)
                self._drop_hash(block_id)
                self._uncached.append(block_id)
                count += 1
        self.evictions_by_reason["ttl"] += count
        return count

    def is_retained(self, block: Block) -> bool:
        """Whether a session block belongs to one of its session's last `session_turns` turns."""
        if block.session_id is None:
            return False
        return self.latest_turn[block.session_id] - block.session_turn < self._session_turns

    def _evict(self, n: int) -> list[int]:
        ids: list[int] = []
        while self._cached_anon and len(ids) < n:
            ids.append(self._cached_anon.popitem(last=False)[0])
        self.evictions_by_reason["lru"] += len(ids)
        if len(ids) < n:
            # One pass over the session queue collects the stale blocks in LRU order.
            stale = [b for b in self._cached_session if not self.is_retained(self.blocks[b])]
            stale = stale[: n - len(ids)]
            for block_id in stale:
                self._cached_session.pop(block_id)
            ids.extend(stale)
            self.evictions_by_reason["lru"] += len(stale)
        while len(ids) < n:
            ids.append(self._cached_session.popitem(last=False)[0])
            self.evictions_by_reason["pressure"] += 1
        for block_id in ids:
            self._drop_hash(block_id)
        return ids

    def _drop_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash_key is not None and self._by_hash.get(block.hash_key) == block_id:
            del self._by_hash[block.hash_key]
        block.hash_key = None
        block.session_id = None

    def _free_queue_of(self, block: Block) -> OrderedDict[int, None]:
        return self._cached_session if block.session_id is not None else self._cached_anon


def num_blocks_for_budget(layout: KVLayout, kv_bytes: int) -> int:
    """How many blocks (the null block included) a KV pool of kv_bytes holds for this layout."""
    if kv_bytes <= 0:
        raise ValueError(f"kv_bytes={kv_bytes} is invalid: expected a positive number of bytes")
    num_blocks = kv_bytes // layout.page_bytes
    if num_blocks < 2:
        raise ValueError(
            f"kv_bytes={kv_bytes} is invalid: it holds {num_blocks} blocks of {layout.page_bytes} bytes; "
            f"expected at least {2 * layout.page_bytes} bytes (the null block and one usable block)"
        )
    return num_blocks


def num_blocks_for_tokens(
    layout: KVLayout, tokens: int, max_num_seqs: int, max_step_tokens: int
) -> int:
    """How many blocks (the null block included) always hold `tokens` tokens of KV in total,
    over at most max_num_seqs sequences, each step computing at most max_step_tokens tokens.

    A full-attention group needs a page for every token of every sequence, a partial last page
    per sequence included: at most k + (tokens - k) // bs pages for k = min(max_num_seqs,
    tokens) sequences (each of k sequences starts a page with its first token; every bs more
    tokens start at most one more). A sliding group never needs more than that either (its
    table is as long, with null entries), nor more than `sliding_window_blocks` (the pages
    that can be live in its window), whichever is less: so llama.cpp's -c N without
    --swa-full, rather than N tokens in every layer."""
    if tokens <= 0:
        raise ValueError(f"tokens={tokens} is invalid: expected a positive number of tokens")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} is invalid: expected an integer >= 1")
    if max_step_tokens < 1:
        raise ValueError(f"max_step_tokens={max_step_tokens} is invalid: expected an integer >= 1")
    bs = layout.block_size
    k = min(max_num_seqs, tokens)
    full_pages = k + (tokens - k) // bs
    num_blocks = 1
    for group in layout.groups:
        pages = full_pages
        if group.sliding_window is not None:
            live = sliding_window_blocks(group.sliding_window, bs, max_num_seqs, max_step_tokens)
            pages = min(pages, live)
        num_blocks += pages
    return num_blocks


def sliding_window_blocks(
    window: int, block_size: int, max_num_seqs: int, max_step_tokens: int
) -> int:
    """The most pages one sliding-window group can hold at once (kv/manager.py's allocation).

    Before each step the scheduler gives back every running sequence's pages that no query at
    position >= num_computed can see (KVCacheManager.release_out_of_window), so between steps
    a sequence holds the pages of its last W - 1 tokens, and during a step the pages of the
    W - 1 + C tokens from num_computed - W + 1 to the end of its chunk of C tokens; a prefix
    hit takes only the pages the hit position's window sees. L consecutive tokens touch at
    most span(L) = ceil((L - 1) / bs) + 1 pages (when the first sits at the end of a page):

        W=8, bs=4, C=1: tokens 3..10 (W - 1 + C = 8 of them) touch pages 0, 1, 2
        tokens  0 1 2 3 | 4 5 6 7 | 8 9 10 11
        span(8) = ceil(7 / 4) + 1 = 3,  idle span(7) = ceil(6 / 4) + 1 = 3

    A chunk of C tokens then costs e(C) = span(W - 1 + C) - span(W - 1) pages more than the
    idle ones; e is 0 up to C = c1 - 1 (the room left in the last page), then grows by one
    page per bs tokens. The step's chunks sum to at most max_step_tokens = T over at most
    max_num_seqs = S sequences, so the extra pages are at most k + (T - k * c1) // bs with
    k = min(S, T // c1) sequences taking c1 tokens each and the rest going to one of them.
    """
    bs = block_size

    def span(num_tokens: int) -> int:
        return -(-(num_tokens - 1) // bs) + 1

    idle = span(max(1, window - 1))
    # e(C) = ceil((a + C) / bs) - ceil(a / bs) with a = W - 2; c1 is the least C with e(C) = 1.
    a = window - 2
    c1 = bs * -(-a // bs) - a + 1
    k = min(max_num_seqs, max_step_tokens // c1)
    return max_num_seqs * idle + k + (max_step_tokens - k * c1) // bs
