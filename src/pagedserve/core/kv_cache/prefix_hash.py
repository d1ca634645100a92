"""Chained, collision-resistant hashes of full KV blocks.

hash(block i) = SHA-256(hash(block i-1) || extra keys || token ids of block i). Two blocks share a
hash only if their whole prefix and the extra keys (a tenant's cache_salt) are equal, so tenants
with different salts never share a block. Python's hash() is not used: it is salted per process
and collides far too easily for content addressing.

The salt enters every block's hash, not only the first (vLLM mixes it into the first only, which
is enough as each hash chains its parent); either way no block of one salt matches another's.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from pagedserve.core.errors import InvalidRequest

ROOT_HASH = b"pagedserve-prefix-v1"


def check_cache_salt(value: Any, field: str = "cache_salt") -> str | None:
    """A client's cache_salt, as vLLM's OpenAI server takes it: None (no salt) or a non-empty string.
    An empty salt is refused rather than read as none: it hashes as no salt at all, so a tenant
    sending one would share blocks with every unsalted request."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{field}={value!r}: expected a string (a tenant's prefix-cache salt) or null",
                             param=field)
    if not value:
        raise InvalidRequest(f"{field} is empty: send a non-empty string (only requests with the same salt "
                             "share cached prompt blocks), or omit it", param=field)
    return value


def hash_block(parent_hash: bytes, token_ids: list[int], cache_salt: str | None) -> bytes:
    h = hashlib.sha256(parent_hash)
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    h.update(struct.pack("<I", len(salt)))  # length-prefixed so salt bytes cannot pose as tokens
    h.update(salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int, cache_salt: str | None
) -> None:
    """Append the hashes of every full block of token_ids not yet in `hashes` (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], cache_salt))
