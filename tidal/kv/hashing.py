"""Prefix-cache block hashes: a stable chain over (parent hash, block token ids, extra keys)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# 16-byte blake2b digests. Python's built-in hash of a tuple would be fast and deterministic for
# ints in-process, but it is 64 bits wide: a collision silently serves another prompt's KV, and
# its value changes across processes for str extra keys. 128 bits make a collision negligible
# and the hash stable across engine restarts; hashing 16 tokens costs about a microsecond.
BlockHash = bytes
_DIGEST_BYTES = 16
_ROOT = b"\x00" * _DIGEST_BYTES


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] = (),
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    `extra_keys` separate caches that must not share KV for equal tokens (a model or LoRA tag);
    they are encoded with repr(), so use str / int / bytes / tuples of those.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_keys: tuple[object, ...] = (),
) -> None:
    """Append hashes to `hashes` (the chain of the first blocks) until it holds `num_blocks`.

    `token_ids` must cover at least num_blocks * block_size tokens.
    """
    parent = hashes[-1] if hashes else None
    for b in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys)
        hashes.append(parent)
