"""Naming blocks of prompt tokens: a block's name is a chain hash of its tokens and its parent's
name, so it names the whole prefix up to its end (as paged engines name their shared blocks).
The simulated engine names its blocks this way, and the ``trtllm`` engine renames TensorRT-LLM's
blocks this way from the tokens its KV-cache events carry, so a prompt's blocks can be looked up
without the engine's own hash function."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Container

ChainHash = Callable[[int | None, list[int]], int]


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    seed = b"" if parent is None else parent.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(seed + array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def block_hashes(token_ids: list[int], block_tokens: int, blocks: int | None = None,
                 chain: ChainHash = chain_hash, known: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The names of the first ``blocks`` full blocks of ``token_ids`` (all of them by default),
    chained with ``chain`` (an engine's own, where it has one); ``known``: the names of the first
    blocks, already worked out."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for b in range(len(hashes), len(token_ids) // block_tokens if blocks is None else blocks):
        parent = chain(parent, token_ids[b * block_tokens:(b + 1) * block_tokens])
        hashes.append(parent)
    return tuple(hashes)


def leading_held(hashes: tuple[int, ...], held: Container[int]) -> int:
    """How many of the first blocks are held: what a prompt of these blocks reuses."""
    hit = 0
    while hit < len(hashes) and hashes[hit] in held:
        hit += 1
    return hit
