"""The beats between the brokers of a cluster (Note [beats]): which peers surely hold this one
up (`fresh`), which links are in use and which idle, and the count of requests that tells a
link that dropped some. Links' (links.py), whose sockets carry them.

Note [beats]

Each broker beats a peer every `beat` seconds, and takes one whose answers stopped for
`down_after` for down: BEAT and DOWN_AFTER, or with etcd ETCD_BEAT and ETCD_DOWN_AFTER. A
beat's answer says how long its sender waits before it takes this broker for down, and when
it last heard it: until when it surely holds this one up (`fresh`, the offers' safety: Note
[offers]). With etcd `fresh` also needs this broker's lease to surely run (`lease_until`):
while etcd is out of reach for over TTL less LEASE_MARGIN (2.5 s), it pulls nothing. One
whose lease expired gives back the offers it holds as it joins again, and its reads under way
are not sealed (cluster.py, `_members`); it reads nothing more of a peer's until the peer
answers a beat having seen its new entry in etcd (entries are numbered: `registration`), so
having seen the one before go: a peer that took it for down says so then, and each forgets
the other (what it lent them stays pinned until then).

With etcd (`quiet`) a node that leaves or dies is down once its entry goes (within about
3.5 s), so beats serve only the links in use, and an idle one is not beaten: N brokers with
nothing between them send each other nothing, where beating every pair cost each broker
2(N-1) messages every 2 s (what grew with N in bench/simulate.py). A link is in use while
requests sent on it are not yet confirmed by a beat's answer (`checked`, the tally below),
from its hello (or a send it did not take) until a beat after it is answered, and while
this broker reads from its node or holds what it offered (`busy`, Cluster._busy: pulls,
offers held, queue items lent here, and a pull that ended with no loan read, until a beat
after it names the pulls open). An idle link's silence says nothing: its `heard` is kept
at now (only ever later: what its answers promised, `heard_ago`, holds), so a broker takes
a peer for down only once it asked something of it. A broker that needs a peer fresh and
finds it not (a read that waits; a request after idling: that beat goes first, so that its
answer comes before the request's) beats it at once (`freshen`), at most every
FRESHEN_EVERY. Without etcd every peer up is beaten: beats are how the brokers see each
other go.

ZeroMQ drops what it holds for a link whose connection breaks and comes back (the route
stays: no hello follows). So each beat says how many requests its link carried since the
hello (`tally`); one short makes the node that counted drop what it reads of the
sender's memory, read nothing more of it until the sender forgot it (`relinking`: not
`fresh`), and answer `resync` (requests.py), and the sender take the link for down
and link again (answers.py): each forgets what it lent the other, the welcome says all
again. The node that counted lets go once it reads the sender's hello; the sender lets go
of its keys' loans and offers as it reads the answer, and of its queue items once a hello
or welcome of the other says it knows (QueueLinks.let_go, `hold`: the other may have read
one since the answer). So neither reads memory the other let go of."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from typing import Any

from .dealers import Peer

BEAT = 0.5  # seconds between beats (and hellos to a peer not up)
DOWN_AFTER = 2.0  # a peer not heard from for this long is down (at most 3 s, says issue 33)
ETCD_BEAT, ETCD_DOWN_AFTER = 2.0, 8.0  # the same with etcd (Note [beats])
FRESHEN_EVERY = 0.1  # seconds between the beats a peer not fresh is sent at once


class Beats:
    """What the beats tell (Note [beats]). Links' (links.py); what it uses of Links is
    named here."""

    def __init__(self, etcd: bool) -> None:
        self.beat = ETCD_BEAT if etcd else BEAT
        self.down_after = ETCD_DOWN_AFTER if etcd else DOWN_AFTER
        # Nodes whose requests this one found missing: nothing of theirs is read until
        # they forgot this node (they let go of what they lent it as they read the answer).
        self.relinking: set[str] = set()
        self.quiet = etcd  # idle links are not beaten
        self.lease_until: Callable[[], float] = lambda: math.inf  # (Membership's, with etcd)
        self.registration: Callable[[], int] = lambda: 0  # (Membership's: entries it put)
        self.registrations: dict[str, int] = {}  # node -> its entry in etcd, as seen here
        self._safe_until: dict[str, float] = {}  # node -> until when it holds this one up
        self._safe_seen: dict[str, Any] = {}  # node -> which of this one's entries it had seen
        self._heard: dict[bytes, int] = {}  # route -> the requests come on it since its hello
        self.stale: set[str] = set()  # nodes found not fresh: beaten at once (`freshen`)
        self.pulls: Callable[[], list[int]] = list  # (Pulls': those open, in each beat)

    _links_of: dict[str, list[Peer]]

    def peer(self, node: str) -> Peer | None:
        raise NotImplementedError

    def up(self, node: str) -> bool:
        raise NotImplementedError

    def send_to(self, peer: Peer, message: dict[str, Any]) -> bool:
        raise NotImplementedError

    # -- sending them --------------------------------------------------------------------------

    def beat_to(self, peer: Peer) -> None:
        """Beat `peer`, naming the pulls this node has open (Lending.open_pulls)."""
        now = time.monotonic()
        peer.tried = now
        message = {"op": "beat", "t": now, "n": peer.sent, "pulls": self.pulls()}
        if self.send_to(peer, message):
            peer.beat_t, peer.beat_n, peer.answered = now, peer.sent, False

    def beaten(self, peer: Peer, m: dict[str, Any]) -> None:
        """`peer` answered beat `m`: if it is the last one sent (since the link's hello), the
        requests before it came."""
        if m.get("t") == peer.beat_t:
            peer.checked, peer.answered = peer.beat_n, True

    def idle(self, peer: Peer, busy: Collection[str]) -> bool:
        """Whether nothing is asked of `peer` (up), so that it is not beaten (`quiet` only)."""
        return self.quiet and peer.answered and peer.sent == peer.checked and peer.node not in busy

    def freshen(self) -> None:
        """Beat the nodes found not fresh (`stale`), each at most every FRESHEN_EVERY."""
        stale, self.stale, now = self.stale, set(), time.monotonic()
        for node in stale:
            peer = self.peer(node)
            if peer is not None and _may_beat(peer, now):
                self.beat_to(peer)

    def beat_first(self, node: str, peer: Peer) -> None:
        """A request goes to `node` on `peer`: behind a beat if the node's last answer to one
        promised nothing of now (its answer, before the request's, makes the node fresh
        again: Note [beats]), at most every FRESHEN_EVERY."""
        now = time.monotonic()
        if now >= self._safe_until.get(node, 0.0) and _may_beat(peer, now):
            self.beat_to(peer)

    # -- what their answers say ----------------------------------------------------------------

    def kept(
        self, node: str, sent: Any, heard_ago: Any, down_after: Any = DOWN_AFTER, seen: Any = None
    ) -> None:
        """`node` answered a beat sent at `sent` (this broker's clock), having heard from this
        broker `heard_ago` seconds before, taking a peer for down after `down_after`, and
        having seen this broker's entry number `seen` in etcd: it will not take this one for
        down before sent + down_after - heard_ago (less BEAT, for the clocks' drift and the
        loops' delays)."""
        if not isinstance(down_after, (int, float)):
            down_after = DOWN_AFTER
        if isinstance(sent, float) and isinstance(heard_ago, (int, float)):
            until = sent + float(down_after) - float(heard_ago) - BEAT
            if until > self._safe_until.get(node, 0.0):
                self._safe_until[node], self._safe_seen[node] = until, seen

    def heard_ago(self, node: str) -> float:
        """Seconds since a link of this broker's last heard `node` answer (or was left
        alone); 0 if none is up: this broker cannot take it for down before DOWN_AFTER from
        now (a link must be up, then silent), and if it took it for down already, its
        `forgot` count, in the same answer, says so first (the node then forgets it, and
        reads nothing it offered)."""
        now = time.monotonic()
        ages = [now - p.heard for p in self._links_of.get(node, ()) if p.up]
        return min(ages) if ages else 0.0

    def fresh(self, node: str, freshen: bool = True) -> bool:
        """Whether `node` surely holds this broker up, as its last answer to a beat said
        (`kept`). A node takes a peer whose answers stopped DOWN_AFTER ago for down, and lets
        go what it offered it (Note [offers]): a broker must not read from those offers then
        (after a long pause of its loop, say, or a link that stalled one way); with etcd, one
        whose lease expired too, or whose peer had not seen its entry in etcd of now (it may
        yet take it for down as it sees the one before go: Note [beats]). If not, it is
        beaten at once (`freshen`: its answer may make it fresh), unless not `freshen`."""
        if node in self.relinking:  # (until it forgot this node: requests.py)
            return False
        now = time.monotonic()
        # The lease before the registration: etcd's thread sets the registration, then the
        # lease (Membership._register), so a lease of now read here comes with its
        # registration, never with the one before it.
        alive = now < self.lease_until()
        seen = self._safe_seen.get(node)  # (None: a peer without etcd, or that saw none)
        if now < self._safe_until.get(node, 0.0) and (
            not isinstance(seen, int) or seen >= self.registration()
        ):
            return alive and self.up(node)
        peer = self.peer(node) if freshen else None
        if peer is not None and _may_beat(peer, now):
            self.stale.add(node)  # (only then: the loop turns at once for `stale`)
        return False

    def tally(self, route: bytes, m: dict[str, Any]) -> bool:
        """Count request `m`, come on `route`. True if it is a beat that says more requests
        were sent on its link since the hello than came here (Note [beats])."""
        if m["op"] == "hello":
            self._heard[route] = 0
            return False
        heard, said = self._heard.get(route, 0), m.get("n")
        if m["op"] == "beat" and isinstance(said, int):
            self._heard[route] = said + 1
            return heard < said
        self._heard[route] = heard + 1
        return False


def _may_beat(peer: Peer, now: float) -> bool:
    """Whether a beat may go to `peer` at once: it is up, and none was tried within
    FRESHEN_EVERY (sent or not: a link that takes nothing is not tried at every turn)."""
    return peer.up and now - peer.tried >= FRESHEN_EVERY
