"""Rendezvous hashing (Note [homes] in homes.py): a key's two homes are the two nodes with
the highest scores for it. A score mixes the node's hash with the key's (splitmix64's
finalizer over their xor), so a key costs one blake2b and the nodes' hashes are made once:
a key's homes among 1,000 nodes took 684 us with a blake2b per node; numpy scores them
all at once past VECTOR nodes. Every broker of a cluster must score alike: the hash is part
of the protocol."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

VECTOR = 32  # more nodes than this: scored by numpy (fewer: Python is quicker)
_MASK = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

_SEEDS: dict[str, int] = {}  # node -> its hash
_ARRAYS: list[tuple[tuple[str, ...], Any]] = []  # (members, their hashes as uint64): the last


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _seed(node: str) -> int:
    seed = _SEEDS.get(node)
    if seed is None:
        seed = _SEEDS[node] = _hash(node)
    return seed


def score(node: str, key: int) -> int:
    """Node `node`'s score for a key whose hash is `key` (`key_hash`)."""
    z = _seed(node) ^ key
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def key_hash(key: str) -> int:
    return _hash(key)


def homes_of(key: str, members: Iterable[str]) -> list[str]:
    """The two nodes of `members` with the highest scores for `key`, highest first (ties:
    the first in `members`)."""
    nodes = members if isinstance(members, tuple) else tuple(members)
    k = key_hash(key)
    if len(nodes) > VECTOR:
        return _vector(nodes, k)
    best = second = -1
    first = after = ""
    for node in nodes:
        s = score(node, k)
        if s > best:
            second, after, best, first = best, first, s, node
        elif s > second:
            second, after = s, node
    return [first, after] if after else [first]


def homed_at(key: str, node: str, members: Iterable[str]) -> bool:
    """Whether `node` is one of `key`'s two homes among `members`: whether at most one
    other member's score beats its own. It stops at the second that does, so it takes
    about 2 ln N scores a key, not N (a welcome's keys, a move)."""
    k = key_hash(key)
    mine, beaten = score(node, k), False
    for other in members:
        if other != node and score(other, k) > mine:
            if beaten:
                return False
            beaten = True
    return True


def _vector(nodes: tuple[str, ...], k: int) -> list[str]:
    import numpy as np

    seeds = next((a for m, a in _ARRAYS if m is nodes), None)
    if seeds is None:  # (the members up rarely change: the last four kept, by identity)
        seeds = np.array([_seed(n) for n in nodes], dtype=np.uint64)
        _ARRAYS[:] = [(nodes, seeds), *_ARRAYS[:3]]
    z = seeds ^ np.uint64(k)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    z ^= z >> np.uint64(31)
    i = int(z.argmax())
    z[i] = 0
    return [nodes[i], nodes[int(z.argmax())]]
