"""Who hears of a version put here, and what this node follows of the other nodes' keys
(Note [follows]).

Note [follows]

Every put was announced to every node, and each node paid about 50 us to hear it: a cluster
of N spent O(N) on each put, though most nodes never read most keys. Now a key's first
version on its node (its claim: the key is this node's now) and its delete go to the key's
homes (Note [homes] in homes.py), which tell the nodes that ask where it lives; the
versions after it go only to the nodes that follow the key:

- a node that read the key from here (its lend, or the offer it read): it holds a replica,
  and pulls the next version as it is announced;
- a node where a get or watch waits for a version newer than it heard of (`follow`);
- a node that follows a prefix the key starts with: where `watch_prefix` was asked for it;
- for a version of at most its `--prefetch` size, every node that prefetches.

A node that follows nothing of a key knows the version of its claim at most (its home's
answer); its first get is lent the version of now, and the index moves up to it. A
follower stays one until it (or this node) restarts or goes down, or the key is deleted here
or goes to another node; it asks again as it comes back (`follow` after its welcome), or
asks the key's new owner, whose claim it heard.

Which version wins is as before (the highest, then the greatest node name), but a node that
does not follow a key puts above the versions it heard of, its claim, not above the later
ones it was not told of. The owner of a version that wins over a claim it hears claims the
key again, to its homes and to the claim's node, so all converge on it; unless the claim
was put over a second after the owner's version: then it goes above it (`renumber`, Note
[homes] in homes.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..store.registry import Registry
from .records import Links, Remote

PREFIXES = 64  # prefixes followed (watch_prefix) before this node follows every key


class Followers:
    """The nodes that follow this node's keys, and the keys claimed (heard of by every
    node)."""

    def __init__(self) -> None:
        self.keys: dict[str, set[str]] = {}  # key -> the nodes that follow it
        self.prefixes: dict[str, set[str]] = {}  # node -> the prefixes it follows
        self.small: dict[str, int] = {}  # node -> the versions it prefetches: at most this big
        self.claimed: dict[str, int] = {}  # this node's keys whose claim went to their
        # homes -> the version claimed

    def follow(self, node: str, key: str) -> None:
        self.keys.setdefault(key, set()).add(node)

    def follow_prefixes(self, node: str, prefixes: list[str], prefetch: int = 0) -> None:
        self.prefixes.setdefault(node, set()).update(prefixes)
        if prefetch:
            self.small[node] = prefetch

    def of(self, key: str, size: int) -> set[str]:
        """The nodes that hear of a version of `key` of `size` bytes after its claim."""
        nodes = set(self.keys.get(key, ()))
        nodes.update(node for node, most in self.small.items() if size <= most)
        for node, prefixes in self.prefixes.items():
            if node not in nodes and any(key.startswith(p) for p in prefixes):
                nodes.add(node)
        return nodes

    def drop(self, key: str) -> None:
        """`key` is not this node's now (deleted, or another node's version won): its next
        version here is a claim again."""
        self.keys.pop(key, None)
        self.claimed.pop(key, None)

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: it follows nothing until it says so again."""
        self.prefixes.pop(node, None)
        self.small.pop(node, None)
        for key in [k for k, nodes in self.keys.items() if node in nodes]:
            self.keys[key].discard(node)
            if not self.keys[key]:
                del self.keys[key]

    def __len__(self) -> int:
        """The (key, node) pairs followed, and the (prefix, node) pairs."""
        keys = sum(len(nodes) for nodes in self.keys.values())
        return keys + sum(len(prefixes) for prefixes in self.prefixes.values())


class Following:
    """Replicas' side of what this node follows of the other nodes' keys (Note [follows]):
    the keys where a get or watch waited (`following`: key -> the node asked), besides those
    held here as replicas, and the prefixes; what it uses of Replicas is named here."""

    links: Links
    registry: Registry
    index: Mapping[str, Remote]
    following: dict[str, str]
    prefixes: set[str]
    prefetch: int

    def follow_prefix(self, prefix: str) -> None:
        """`watch_prefix` was asked for `prefix` here: every node tells this one of each
        version of its keys under it, from when it hears (Note [follows]). Past PREFIXES
        of them, this node follows every key (a prefix is never let go: each node matches
        each put against those it keeps)."""
        if not any(prefix.startswith(p) for p in self.prefixes):
            if len(self.prefixes) >= PREFIXES:
                prefix = ""
            self.prefixes.add(prefix)
            self.links.everyone_after({"op": "follow", "keys": [], "prefixes": [prefix]})

    def follows(self, node: str) -> dict[str, Any] | None:
        """What this node follows of `node`'s, to tell it again (it came up, or forgot this
        node): the keys of its that a get or watch waited for here, those held here as
        replicas, the prefixes, and the small versions prefetched. None if nothing."""
        keys = [
            [k, r.version] for k, r in self.index.items()
            if r.node == node and (k in self.following or k in self.registry.objects)
        ]  # fmt: skip
        if not keys and not self.prefixes and not self.prefetch:
            return None
        prefixes = sorted(self.prefixes)
        return {"op": "follow", "keys": keys, "prefixes": prefixes, "prefetch": self.prefetch}

    def _follow(self, key: str, remote: Remote) -> None:
        if self.following.get(key) != remote.node:
            self.following[key] = remote.node
            follow = {"op": "follow", "keys": [[key, remote.version]], "prefixes": []}
            self.links.after(remote.node, follow)  # (kept while its link reconnects)
