"""Who hears of a version put here (Note [follows]).

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
