"""Automatic prefix caching: the hash of a full KV block, chained over its tokens and its prefix.

A full block's hash is ``sha256(parent hash || key || token ids)``: the parent is the hash of the
block before it (none for the first), ``key`` is the sequence's cache key -- its ``cache_salt``
(tenants with different salts never share a block) and the KV key of the executor that computed it
(``kv_key``: the brownout threshold, since brownout changes what the experts compute and so the KV
of every later layer). Two blocks with the same hash hold the KV of the same tokens after the same
prefix, computed the same way, so a new sequence may read one instead of computing it. SHA-256
(not Python's ``hash``) keeps collisions -- a tenant steering another's prompt into its cached KV --
out of reach.

Which blocks are cached, looked up, and evicted is ``BlockManager``'s business (one hash index per
attention instance: a block lives on one instance); the scheduler looks up a new sequence's prompt
when it admits it and registers blocks once they are full and computed.
"""

from __future__ import annotations

import hashlib

import numpy as np


def cache_key(cache_salt: str | None, kv_key) -> bytes:
    """What the first block's hash is seeded with: the salt and the executor's KV key."""
    return repr((cache_salt, kv_key)).encode()


def block_hash(parent: bytes | None, key: bytes, token_ids) -> bytes:
    """The hash of one full block of ``token_ids`` after the prefix whose last block hashed to ``parent``."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"root:" + key)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, key: bytes) -> list[bytes]:
    """``hashes`` (of the first full blocks of ``token_ids``) extended to every full block of it."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(block_hash(parent, key, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes
