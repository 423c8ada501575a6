"""Where each key of a cluster lives, found in O(1) whatever the cluster's size (Note
[homes]).

Note [homes]

A key's claim (its first version on a node, Note [follows] in follows.py) and its delete
went to every node, so that each knew where every key lived: a new key cost each of N nodes
a message (at 16 brokers, 2.1 ms of the other brokers' CPU a key: bench/scaling.py). Now
each key has a home, the node with the highest score for the key among those up
(rendezvous hashing, rendezvous.py: each node finds the same home from the nodes it sees
up, and a join or a leave moves only the keys of the node that came or went), and a second
home, the node of the next score. A claim and a delete go to the key's two homes and to
its followers; no other node hears of them. A home that is not a follower of the key hears
of a claim once CLAIM_EVERY (10 ms) passed since the last announcement to it, or with the
next (a follower's hears at once; a delete goes at once): a stream of new keys costs each
home a wake-up every CLAIM_EVERY, not one a key, and a single put is told at once. With
more than 3 other nodes up, a home waits longer, one CLAIMS_A_SECOND-th (300th) of a second
for each (Lending.claim_every): a stream of new keys costs the cluster at most 300 wake-ups
a second whatever its size, up to 30 other nodes; beyond, CLAIM_WAIT_MAX
(0.1 s) bounds the wait. A get elsewhere that waits for a key of such a stream hears of it
that much later, at most.

- The homes list the claim in their index, as every node did. The second is there for when
  the first dies (or the owner, if it was its own home): it still knows where the key lives,
  and a get of it raises PeerUnavailable while its owner is down, not NotFound.
- A request of a key that this node knows nothing of (get, watch, exists, wait, delete)
  asks the key's home (`where`), and runs again with its answer. The home keeps the asker
  as a looker of the key: it tells it (`dir`) of each claim or delete that changes what the
  home knows of the key, and the node that owned the version a claim beat, too. Once told
  of a delete, the lookers are forgotten (one with a request still waiting asks again).
- A claim that loses at its home: its node is told of the winner (and drops its version).
  One that loses to its owner's later version (the home heard of its claim only): the owner
  claims again, to the home and to the loser (Replicas.listed).
- A put on a node that does not follow a key goes above the versions it heard of: none
  (its version is 1), or the first (its home's answer). It would lose to the owner's later
  versions, which it was not told of: a key put by one node, then by another that never
  read it. So a claim says how long ago it was put, and the owner decides: the home sends
  on a claim that loses there, or one that beat the owner's version there (`claimed`; if
  the owner is down, the claim's node is told the winner). The owner, if its version was
  sealed SETTLED (1 s) before that put, says `renumber`: the put came later, and goes on
  above the owner's version (the same object, relisted), claimed again. Puts within
  SETTLED of each other are ordered by version, then node name, and a claim that lost
  within SETTLED of its put is counted (`puts_lost`) and logged. A claim sent on to a node
  that no longer holds the key makes its node claim again (`renumber` above 0), so that
  its homes hear of it.
- `keys` and `ls` ask every node for its own keys (a scatter-gather: a listing costs O(N)).
- A join or a leave (`changed`): each node sends the claims of its keys whose home changed
  to the new home (a node that came up gets them with its welcome), asks the new home of the
  keys it asked of, and drops the claims it kept as their home that are not its to keep; in
  slices, a turn of the loop each (moves.py). Only the keys homed at a node that came or
  went move, found in a few hashes each (`homed_at`), not N.

While the nodes do not yet agree on who is up (within a beat of a join or a leave), a
request may ask a home that has not heard of its key yet: a get with no timeout may raise
NotFound then; a get that waits is told when the key's new home hears of it. So may a get
of a key whose owner died within `claim_every` of its put (its homes had not heard of it),
until the owner is back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..store.objects import Objects
from . import rendezvous
from .asking import Ask, Asking, Handler, Row
from .moves import _DONE, Moves
from .records import Links, Remote

log = logging.getLogger(__name__)

HOMES = 2  # the nodes that keep a key's claim: its home, and the next (Note [homes]; homes_of)
DELETING = 5.0  # seconds a delete sent to a key's owner outweighs its homes' word (`deleting`)


class Homes(Asking, Moves):
    """The homes of keys (Note [homes]): the lookers of those homed here, and the
    requests parked while a home, or every node, is asked (Asking, asking.py), and the keys
    moving to new homes (Moves, moves.py). `index` is Replicas' (where the
    other nodes' keys live); `listed` is how Replicas hears where a key lives."""

    def __init__(
        self, node: str, objects: Objects, links: Links, index: Mapping[str, Remote],
        own: Callable[[], list[list[Any]]], listed: Callable[[str, str, int, int], None],
    ) -> None:  # fmt: skip
        self.node, self.objects, self.links, self.index = node, objects, links, index
        self.own, self.listed = own, listed
        self.members: tuple[str, ...] = (node,)  # this node and those up: the homes
        self.lookers: dict[str, set[str]] = {}  # a key homed here -> the nodes that asked
        self.asked: dict[str, str] = {}  # a key this node asked of -> its home then
        self.asks: dict[int, Ask] = {}
        self.handlers: dict[str, Handler] = {  # (the broker's op table replaces these)
            "get": objects.get, "exists": objects.exists, "wait": objects.wait,
            "delete": objects.delete, "keys": objects.keys,
        }  # fmt: skip
        self.asked_count = 0  # lookups sent (stats)
        # key -> (node, version, until when): deletes this node sent to the key's owner, whose
        # homes may not have heard yet (`deleting`)
        self._deleting: dict[str, tuple[str, int, float]] = {}
        self._ids = itertools.count(1)
        self._again: set[int] = set()  # requests run again now: not asked twice
        self._rows: dict[int, dict[str, Row]] = {}  # a listing's rows, as it runs again
        self._moving: Iterator[None] = _DONE  # keys moving to their new homes (`changed`)
        self._queued = deque()

    def homes(self, key: str, members: tuple[str, ...] | None = None) -> list[str]:
        """`key`'s home, then its second home, among `members` (those up here if None)."""
        return self.homes_of(key, members or self.members)

    homes_of = staticmethod(rendezvous.homes_of)  # (key, members) -> its two homes
    homed_at = staticmethod(rendezvous.homed_at)  # (key, node, members) -> whether one

    def home(self, key: str, members: tuple[str, ...] | None = None) -> str:
        return self.homes(key, members)[0]

    def is_home(self, key: str) -> bool:
        return self.home(key) == self.node

    def heard(self, key: str, beaten: list[str]) -> bool:
        """Whether this node, as `key`'s home, tells others of a change of it: its lookers,
        the node whose version lost (`beaten`). (Its home is found only if there are.)"""
        return bool(beaten or key in self.lookers) and self.is_home(key)

    def told(self, key: str, deleted: bool = False) -> set[str]:
        """Who hears of a claim or a delete (`deleted`) of `key` here, besides its
        followers: its homes; its lookers too if this node is its home (forgotten once told
        of a delete: `deleted`)."""
        homes = self.homes(key)
        told = set(homes) - {self.node}
        if homes[0] == self.node:
            told.update(self.lookers.pop(key, ()) if deleted else self.lookers.get(key, ()))
        return told

    # -- the home's side ---------------------------------------------------------------------------

    def where(self, node: str, m: dict[str, Any]) -> None:
        """`node` asks where these keys live: answered with what this node knows, and `node`
        is a looker of each from now on; of a key not known here only if its request waits
        for it (`look`: a get with a timeout, a watch, a wait), so that an `exists` or a get
        of keys that never live leaves nothing behind here or there."""
        entries, look = [], m.get("look", True)
        for key in map(str, m["keys"]):
            remote, obj = self.index.get(key), self.objects.registry.objects.get(key)
            if remote is not None:
                entries.append([key, *remote])
            elif obj is not None:
                entries.append([key, self.node, obj.version, int(obj.nbytes)])
            else:
                entries.append([key, None, 0, 0])
                if not look:
                    continue
            self.lookers.setdefault(key, set()).add(node)
        answer = {"op": "where", "ask": m.get("ask", 0), "keys": entries, "look": look}
        self.links.answer(node, answer)

    def lost(
        self, key: str, winner: Remote, node: str, version: int, size: int, age: Any,
        relayed: bool,
    ) -> None:  # fmt: skip
        """`node`'s version of `key` (a claim put `age` seconds ago, if said) lost here to
        `winner`, another node's. As `key`'s home: sent on to the winner's node, which
        decides (`claimed`, Note [homes]); that node down, or this a node the claim was sent
        on to (`relayed`), its node is told of the winner."""
        home = self.is_home(key)
        claim = [key, node, version, size, 0, age]
        if age is not None and home and winner.node != node and self._send_on(winner.node, claim):
            return
        if home or relayed:
            self.tell([key, *winner, 0], to=[node])

    def won(
        self, key: str, beaten: list[str], node: str, version: int, size: int, age: Any
    ) -> None:
        """`node`'s version of `key` (a claim put `age` seconds ago, if said) is the one known
        here now, over `beaten`'s version if any. As its home: its lookers are told, and the
        node that lost (a claim with its age: sent on, as that node may beat it)."""
        if not self.heard(key, beaten):
            return
        claim = [key, node, version, size, 0, age]
        if age is not None and beaten and self._send_on(beaten[0], claim):
            beaten = []
        self.tell([key, node, version, size, 0], to=beaten, lookers=True)

    def _send_on(self, owner: str, claim: list[Any]) -> bool:
        """Send `claim` on to `owner` (`claimed`: it decides), if it is up."""
        if not self.links.up(owner):
            return False
        self.links.after(owner, {"op": "claimed", "keys": [claim]})
        return True

    def tell(self, entry: list[Any], to: Iterable[str] = (), lookers: bool = False) -> None:
        """Where a key lives now, `entry` ([key, owner, version (0: deleted there), size,
        the version put and deleted before]), told (`dir`) to `to`, and to the key's lookers
        if `lookers` (a home's change of what it knows)."""
        nodes = set(to)
        if lookers:
            nodes.update(self.lookers.get(entry[0], ()))
        for node in nodes - {self.node, entry[1]}:
            self.links.after(node, {"op": "dir", "keys": [entry]})

    def own_rows(self, node: str, m: dict[str, Any]) -> None:
        """`node` lists the cluster's keys: this node's own, as `m` names them (`ls`)."""
        prefix, after, limit = str(m.get("prefix", "")), m.get("after"), m.get("limit")
        rows = [
            r for r in self.own() if r[0].startswith(prefix) and (after is None or r[0] > after)
        ]  # fmt: skip
        if limit is not None:
            by_size = m.get("by") == "size"
            pick = heapq.nlargest if by_size else heapq.nsmallest
            rows = pick(int(limit) + 1, rows, key=lambda r: r[2] if by_size else r[0])
        self.links.answer(node, {"op": "ls", "ask": m.get("ask", 0), "keys": rows})

    def deleted(self, key: str) -> None:
        """`key` was deleted (its lookers were told): they are forgotten here, and this node
        forgets it asked of it, unless a request here waits for it (it asks again, so that
        its home tells it of the key's next put). So neither grows with every key that
        ever lived."""
        self.lookers.pop(key, None)
        if self.asked.pop(key, None) is not None and self._waited(key):
            home = self.home(key)  # (its home of now: a move may be under way)
            if home != self.node:
                self.asked[key] = home
                self.links.after(home, {"op": "where", "ask": 0, "keys": [key]})

    def deleting(self, key: str, node: str, version: int) -> None:
        """This node sent a delete of `key`'s `version` to its owner `node`: for DELETING
        seconds a home that says it lives there (it had not heard of the delete yet: an
        `exists` right after the delete asks it) is not believed."""
        now = time.monotonic()
        if len(self._deleting) > 1000:  # (those whose time is up go)
            self._deleting = {k: d for k, d in self._deleting.items() if d[2] > now}
        self._deleting[key] = (node, version, now + DELETING)

    def _deleted(self, key: str, owner: str, version: int) -> bool:
        d = self._deleting.get(key)
        if d is None or time.monotonic() > d[2]:
            return False
        return owner == d[0] and version <= d[1]

    def _waited(self, key: str) -> bool:
        """Whether a request here waits for `key` (a get, a watch, a wait)."""
        return bool(self.objects.lot.line(("get", key))) or self.objects.waits(key)

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: it looks at nothing until it asks again."""
        for key in [k for k, nodes in self.lookers.items() if node in nodes]:
            self.lookers[key].discard(node)
            if not self.lookers[key]:
                del self.lookers[key]
        for ask in self.asks.values():
            ask.nodes.discard(node)  # (run at the next tick)
        keys = [k for k, home in self.asked.items() if home == node]
        if keys and self.links.up(node):  # (it restarted: it forgot this one's asks)
            self.links.after(node, {"op": "where", "ask": 0, "keys": keys})
