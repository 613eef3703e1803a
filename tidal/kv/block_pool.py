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


def num_blocks_for_tokens(layout: KVLayout, tokens: int) -> int:
    """How many blocks (the null block included) hold `tokens` tokens in every layer group.

    Each group keeps its own block table, so a token costs one page slot per group; sliding
    groups give back pages that leave their window, so the pool then holds more than `tokens`."""
    if tokens <= 0:
        raise ValueError(f"tokens={tokens} is invalid: expected a positive number of tokens")
    pages_per_group = -(-tokens // layout.block_size)
    return 1 + pages_per_group * len(layout.groups)
