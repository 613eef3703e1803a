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
from collections.abc import Sequence

from tidal.kv.hashing import BlockHash, extend_block_hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash chain of the prompt's full blocks (a partial last block is never cached)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size)
    return hashes


class PrefixIndex:
    """Per replica, the block hashes it was sent, least recently used first."""

    def __init__(self, num_replicas: int, capacity_blocks: Sequence[int]) -> None:
        if num_replicas < 1 or len(capacity_blocks) != num_replicas:
            raise ValueError(
                f"capacity_blocks={list(capacity_blocks)!r} is invalid: expected one block "
                f"count per replica ({num_replicas})"
            )
        self._blocks: list[OrderedDict[BlockHash, None]] = [
            OrderedDict() for _ in range(num_replicas)
        ]
        self._capacity = [max(1, c) for c in capacity_blocks]

    def num_blocks(self, replica: int) -> int:
        return len(self._blocks[replica])

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Per replica, how many leading blocks of `hashes` it holds (a chain: stop at the first
        miss, since a block's hash names its whole prefix)."""
        out = []
        for held in self._blocks:
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            out.append(n)
        return out

    def add(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        """The replica was sent these blocks: mark them most recently used, evict past capacity."""
        held = self._blocks[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self._capacity[replica]:
            held.popitem(last=False)

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        self._capacity[replica] = max(1, capacity_blocks)
        self.add(replica, ())

    def forget(self, replica: int) -> None:
        """The replica's engine restarted with an empty cache."""
        self._blocks[replica].clear()
