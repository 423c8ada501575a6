"""This node's keys announced to the other nodes (Note [cluster] in cluster.py): a claim to
its homes (Note [homes] in homes.py), a later version to its followers (Note [follows] in
follows.py), a small version with its offer (Note [offers] in offers.py), batched: one
message to each peer per ANNOUNCE_EVERY, and to a home that follows nothing one per
`claim_every`. lending.py lends what they then ask for.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..store.records import StoredObject
from ..store.registry import Registry
from .follows import Followers
from .offers import Lent
from .records import Links, Pull, Remote
from .transfers import Transfers

log = logging.getLogger(__name__)

ANNOUNCE_EVERY = 0.001  # seconds: announcements made sooner after the last batch wait for it
# seconds: a claim to a node that does not follow the key (its homes, the node it beat)
# waits until this long after the last announcement to that node (Note [homes]), or longer
# in a cluster of more than CLAIMS_A_SECOND * CLAIM_EVERY nodes: peers / CLAIMS_A_SECOND,
# so that a stream of new keys sends at most CLAIMS_A_SECOND claim messages a second,
# whatever the cluster's size; never longer than CLAIM_WAIT_MAX (`claim_every`)
CLAIM_EVERY = 0.01
CLAIMS_A_SECOND = 300
CLAIM_WAIT_MAX = 0.1


class Announcing:
    """Lending's side that announces (what it uses of Lending is named here)."""

    node: str
    registry: Registry
    transfers: Transfers
    links: Links
    index: Mapping[str, Remote]
    pulling: Mapping[str, Pull]
    told: Callable[[str, bool], set[str]]
    offered: Lent
    followers: Followers
    announcing: list[tuple[str, int]]
    beaten: dict[str, str]
    peers: int
    _announced_at: float
    _told_at: dict[str, float]
    _held: dict[str, list[tuple[float, list[Any]]]]

    def announce(self, key: str, version: int) -> None:
        """`key` sealed here at `version` (0: deleted): the peers are told (its claim and
        delete, its homes; a later version, its followers: Note [follows]), once this loop's
        replies are out (a put's reply does not wait for the messages to its peers)."""
        self.announcing.append((key, version))

    def announce_in(self, now: float) -> float:
        """Seconds until the announcements waiting go out (inf: none wait)."""
        due = math.inf
        if self.announcing:
            due = self._announced_at + ANNOUNCE_EVERY
        if self._held:
            told = min(self._told_at.get(n, -math.inf) for n in self._held)
            due = min(due, told + self.claim_every)
        return max(0.0, due - now)

    def flush(self) -> None:
        """The announcements, once ANNOUNCE_EVERY passed since the last went: one message to
        each peer, [key, version, size, offer] of each key's latest version, or [key, 0, 0,
        None, the version put and deleted since the last batch, if one was] for a delete; a
        small version goes with its offer, pinned for the peers it reached (Note [offers]).
        What a node hears only as a key's home (a claim) waits for the next message to it
        or `claim_every` after the last: a stream of new keys costs each home at most one
        wake-up per `claim_every`, not one per key (Note [homes])."""
        now = time.monotonic()
        out: dict[str, list[list[Any]]] = {}  # node -> what it hears now
        offered: list[tuple[StoredObject, set[str]]] = []  # a version, its followers
        if self.announcing and now >= self._announced_at + ANNOUNCE_EVERY:
            self._announced_at = now
            self._batch(now, out, offered)
        self._held.pop(self.node, None)
        for node in [n for n in self._held if n in out or self._due(n, now)]:
            out.setdefault(node, [])  # (its held entries go first: `_announce_to`)
        out.pop(self.node, None)
        told = set()  # (sent after the loop's replies, and kept while a link reconnects:
        for node, entries in out.items():  # Links.after; the offers say which incarnation
            if self.links.up(node):  # of their receiver they are for, and how often this
                self._announce_to(node, entries)  # one forgot it: Links.acked)
                told.add(node)
            else:  # (a home down: its keys are claimed again as it comes up)
                self._held.pop(node, None)
        for obj, to in offered:
            self.offered.pin(obj, told & to)

    @property
    def claim_every(self) -> float:
        """Seconds a claim to a node that does not follow its key waits after the last
        announcement to it: CLAIM_EVERY, longer in a large cluster (CLAIMS_A_SECOND)."""
        return max(CLAIM_EVERY, min(CLAIM_WAIT_MAX, self.peers / CLAIMS_A_SECOND))

    def _due(self, node: str, now: float) -> bool:
        return now >= self._told_at.get(node, -math.inf) + self.claim_every

    def _batch(
        self, now: float, out: dict[str, list[list[Any]]],
        offered: list[tuple[StoredObject, set[str]]],
    ) -> None:  # fmt: skip
        """The announcements made since the last batch, each key's last: to `out` for its
        followers, held (`_held`) for the nodes that hear of it only as its homes."""
        announcing, self.announcing = self.announcing, []
        latest: dict[str, int] = {}  # key -> its last version, the last put first
        put: dict[str, int] = {}  # key -> its last put's version
        for key, version in reversed(announcing):
            latest.setdefault(key, version)
            if version:
                put.setdefault(key, version)
        held = self._held
        for key, version in reversed(latest.items()):
            claim = key not in self.followers.claimed
            told: set[str] = set()  # a claim or a delete goes to the key's homes too (Note
            if claim or not version:  # [homes]), and to the node whose version it beat
                told = self.told(key, not version)
            beaten = self.beaten.pop(key, None)
            if beaten is not None:
                told.add(beaten)
            if not version:  # deleted (the version it put and deleted since: it beat others')
                entry = [key, 0, 0, None, put.get(key, 0)]  # (at once, to all: a node that
                for node in told | self.followers.of(key, 0):  # asks a home right after
                    out.setdefault(node, []).append(entry)  # must not hear it lives)
                self.followers.drop(key)
                continue
            obj = self.registry.objects.get(key)
            if obj is None or obj.version != version or key in self.index:
                continue  # not this node's now: another node's version won here meanwhile
            size, to = int(obj.nbytes), self.followers.of(key, int(obj.nbytes))
            offer = None
            try:  # (to its followers only: the others ask the owner, who lends the newest)
                if to and self.offered.offerable(obj):
                    offer = self.transfers.offer(obj, agent=False)
            except Exception as exc:  # (its segment could not be registered): lent when asked
                log.warning("could not offer %r with its announcement: %s", key, exc)
            # A claim says how long ago it was put (it may go above an older version on
            # another node that it had not heard of: Note [homes]).
            age = [0, now - obj.sealed_at] if claim else []
            for node in to:
                out.setdefault(node, []).append([key, version, size, offer, *age])
            if claim:  # (Note [homes])
                self.followers.claimed[key] = version
                for node in told - to:
                    held.setdefault(node, []).append((now, [key, version, size, None, *age]))
            if offer is not None:
                offered.append((obj, to))

    def _announce_to(self, node: str, entries: list[list[Any]]) -> None:
        """An `announce` of `entries` to `node`, after the loop's replies (kept while its
        link reconnects: Links.after), for its incarnation as this broker knows it; what was
        held for it goes first (a claim's age counts the time it was held)."""
        now = time.monotonic()
        held = [entry for made, entry in self._held.pop(node, ()) if self._still(entry, now - made)]
        if held:
            entries = held + entries
        self._told_at[node] = now
        self.links.after(node, {"op": "announce", "keys": entries, **self.links.ack(node)})

    def _still(self, entry: list[Any], held: float) -> bool:
        """Whether held `entry` is still to be sent: not a claim of a key whose version on
        another node won here meanwhile (its homes hear of that one); a claim's age counts
        the `held` seconds it waited."""
        if len(entry) < 6:  # (a delete)
            return True
        if entry[0] in self.index:
            return False
        entry[5] += held
        return True

    def follow(self, node: str, keys: list[Any], prefixes: list[Any], prefetch: int = 0) -> None:
        """`node` follows these keys ([[key, the version it heard of], ...]), prefixes and
        versions of at most `prefetch` bytes (Note [follows]): told at once of the version of
        a key here newer than it heard of."""
        self.followers.follow_prefixes(node, [str(p) for p in prefixes], int(prefetch))
        newer, moved = [], []
        for key, heard in keys:
            obj, remote = self.registry.objects.get(key), self.index.get(key)
            if remote is not None and remote.node != node:  # another node's now: where
                moved.append([key, *remote, 0])  # (`node` may not have heard: Note [homes])
            elif obj is None and remote is None and key not in self.pulling:
                newer.append([key, 0, 0, None])  # deleted here (said while `node` was away)
            if obj is None or remote is not None or key in self.pulling:
                continue
            self.followers.follow(node, key)
            if obj.version > heard:
                newer.append([key, obj.version, int(obj.nbytes), None])
        if newer:
            self._announce_to(node, newer)
        if moved:
            self.links.after(node, {"op": "dir", "keys": moved})

    def claim_again(self, key: str, version: int, loser: str) -> None:
        """Node `loser` claimed `key` with a version that loses to this node's `version`:
        it and the key's home are told of this one (Note [homes]), so all converge on
        it."""
        self.followers.claimed.pop(key, None)
        self.announce(key, version)
        obj = self.registry.objects.get(key)
        if obj is not None and obj.version == version:
            self._announce_to(loser, [[key, version, int(obj.nbytes), None]])

    def claim_to(self, node: str, entries: list[list[Any]]) -> None:
        """Claims ([key, version, size, None], ...) of keys now homed at `node`."""
        self._announce_to(node, entries)
