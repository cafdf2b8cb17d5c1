"""The block-hash chain: a prompt as the keys a paged-KV prefix cache gives its blocks.

Block i's hash is `xxh64(hash of block i-1 as 8 little-endian bytes + block i's token ids as
int64)`, so one hash names the whole prefix up to the end of its block, and two prompts share
the hashes of exactly the blocks they share from the start. Only full blocks get a hash (a KV
cache only reuses full blocks). The engine keys its prefix cache with it and the gateway's
routers key their indexes with it, so a router's keys are the engine's cache keys.
"""
from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = 0          # the parent hash of a chain's first block
_h64 = xxhash.xxh64_intdigest


def salted_root(cache_salt: str | None) -> int:
    """The parent hash of the first block of a request carrying vLLM's `cache_salt`: the salt
    is folded into the first block's hash, so requests share cached blocks only when their
    salts are equal (no salt, or an empty one: ROOT_HASH, the unsalted chain)."""
    return _h64(b"cache_salt\0" + cache_salt.encode()) if cache_salt else ROOT_HASH


def hash_block(parent_hash: int, token_ids) -> int:
    """The chained hash of one full block."""
    return _h64(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


def block_hash_chain(tokens, block_tokens: int, max_blocks: int | None = None,
                     parent: int = ROOT_HASH) -> list[int]:
    """The hashes of the full `block_tokens`-sized blocks of `tokens` (at most `max_blocks`).

    `parent` continues a chain: the hash of the block just before `tokens[0]`."""
    n = len(tokens) // block_tokens
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return []
    head = tokens[:n * block_tokens]
    # a numpy int64 array (the fleet simulator's) already has the bytes array("q") would make
    data = head.tobytes() if getattr(head, "dtype", None) == "int64" else array("q", head).tobytes()
    return chain_bytes(data, 8 * block_tokens, n, parent)


def chain_bytes(data: bytes, step: int, n: int, parent: int) -> list[int]:
    """h[i] = xxh64(h[i-1] as 8 little-endian bytes + data[i*step:(i+1)*step]), i < n."""
    view = memoryview(data)
    out = []
    h = parent
    for i in range(0, n * step, step):
        h = _h64(h.to_bytes(8, "little") + view[i:i + step])
        out.append(h)
    return out
