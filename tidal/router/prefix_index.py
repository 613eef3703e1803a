"""PrefixIndex: which prompt blocks the router has sent to each replica, an LRU per replica as big as its KV pool.

Why the router remembers rather than asks: a replica's prefix cache holds exactly the full blocks
of the prompts it was sent (and their outputs), so the API process, which sends every prompt,
can keep the same picture without any traffic from the engines. The picture is approximate in
one direction only: a replica may have evicted a block the index still lists. Bounding each
replica's set by its KV pool's block count and refreshing a block on every use make the index
evict in the order the replica's own LRU free queue does (SGLang's cache-aware router keeps the
same kind of approximate tree). A replica that restarts starts empty, and so does its set
(`forget`). The hashes are kv/hashing.py's chain, so one block hash names one prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from tidal.kv.hashing import BlockHash, extend_block_hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of the prompt's full blocks (a partial last block is never cached)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size)
    return hashes


class PrefixIndex:
    """Per replica (any hashable key: an index, a Ray Serve replica id), the block hashes it was
    sent, least recently used first; a replica not seen yet holds nothing."""

    def __init__(self, default_capacity_blocks: int = 1 << 20) -> None:
        if default_capacity_blocks < 1:
            raise ValueError(
                f"default_capacity_blocks={default_capacity_blocks!r} is invalid: expected >= 1"
            )
        self._blocks: dict[Hashable, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[Hashable, int] = {}
        self._default_capacity = default_capacity_blocks

    def num_blocks(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def match(self, replicas: Sequence[Hashable], hashes: Sequence[BlockHash]) -> list[int]:
        """Per replica, how many leading blocks of `hashes` it holds (a chain: stop at the first
        miss, since a block's hash names its whole prefix)."""
        out = []
        for replica in replicas:
            held = self._blocks.get(replica, {})
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            out.append(n)
        return out

    def add(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """The replica was sent these blocks: mark them most recently used, evict past capacity."""
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        capacity = self._capacity.get(replica, self._default_capacity)
        while len(held) > capacity:
            held.popitem(last=False)

    def set_capacity(self, replica: Hashable, capacity_blocks: int) -> None:
        """Its KV pool's block count (EngineReady.num_blocks)."""
        self._capacity[replica] = max(1, capacity_blocks)
        self.add(replica, ())

    def forget(self, replica: Hashable) -> None:
        """The replica's engine restarted with an empty cache (or is gone)."""
        self._blocks.pop(replica, None)
