"""The keys of a cluster's other nodes (Note [cluster] in cluster.py): the index of what each
holds, and the pulls of their objects into this node's memory as replicas (this node's
objects lent to their pulls: lending.py). Which version wins, the same on every node: the
highest, then the one of the greatest node name.

A replica is listed in this node's directory under its key and its owner's version, so that
its readers read it as any object (microseconds); it is evictable, and dropped when another
version wins. It is never announced: the index keeps its key, which is how this room tells a
replica from a put of this node's.

"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from ..common.errors import BrokerError, NotFound, PeerUnavailable
from ..common.protocol import Request, reply_error
from .lending import Lending
from .objects import Objects
from .offers import Held, Offer
from .parking import ParkingLot, Waiter
from .records import Session
from .transfers import Transfers

PULL_WAIT = 30.0  # a get that pulls waits this long at least, whatever its own timeout
SPIN = 0.002  # seconds a read is polled without sleeping, from when it may be over (poll_due)
POLL = 0.001  # and then every POLL seconds
ASK_AGAIN = 0.01  # a lend that could not go out (its link not connected) is sent again so often


def poll_due(ends: float, now: float) -> float:
    """Seconds until a read that may be over at `ends` (Transfers.ends) is looked at: every
    POLL until then (a broker that spun through each 1 MiB read of a stream took CPU its
    peer needed), then at once for SPIN (a small one ends within microseconds: a loop that
    slept 1 ms would make a 4 KiB pull take milliseconds), then every POLL again."""
    if now < ends:
        return min(ends - now, POLL)
    return 0.0 if now - ends < SPIN else POLL


class Links(Protocol):
    """The links to the other nodes (cluster.py's Cluster)."""

    def send(self, node: str, message: dict[str, Any]) -> bool: ...
    def answer(self, node: str, message: dict[str, Any]) -> None: ...
    def everyone(self, message: dict[str, Any]) -> None: ...
    def up(self, node: str) -> bool: ...
    def fresh(self, node: str) -> bool: ...
    def nodes(self) -> list[str]: ...


class Remote(NamedTuple):
    """A key that lives on another node, at `version`, `size` bytes."""

    node: str
    version: int
    size: int


@dataclass(slots=True)
class Pull:
    """A key being pulled: its owner `node`, asked (or `source`, a node it sent this one to)
    to lend it (handle None), then read. `lends`: pulls of other nodes sent here meanwhile."""

    id: int
    key: str
    node: str
    seen: int  # the version the index named when it was asked for
    started: float
    source: str = ""
    version: int = 0  # the version lent
    put: int = 0  # the put lease of the replica's block
    handle: Any = None
    read_at: float = 0.0  # when the read started
    size: int = 0
    offer: Offer | None = None  # read from the offer its announcement carried (offers.py)
    asked: bool = True  # its lend went out (else sent again as the loop polls: not connected)
    waiters: list[Waiter] = field(default_factory=list)
    lends: list[tuple[str, int]] = field(default_factory=list)  # (node, its pull id)


class Replicas:
    """The index of the other nodes' keys, the pulls under way and the loans out."""

    def __init__(
        self, node: str, objects: Objects, lot: ParkingLot, transfers: Transfers, links: Links
    ) -> None:
        self.node, self.objects, self.registry, self.lot = node, objects, objects.registry, lot
        self.transfers, self.links = transfers, links
        self.session = Session(f"cluster:{node}", None)  # holds the replicas' puts
        self.index: dict[str, Remote] = {}  # key -> where it lives (other nodes only)
        self.pulls: dict[int, Pull] = {}  # pull id -> pull
        self._pulling: dict[str, Pull] = {}  # key -> its pull under way
        self.lending = Lending(node, self.registry, transfers, links, self.index, self._pulling)
        self.held = Held()  # the offers of other nodes' versions (Note [offers] in offers.py)
        self._later: list[tuple[str, dict[str, Any]]] = []  # (node, message), sent by `flush`
        self._ids = 0
        self.bytes_received = 0
        self.pulled = {"offered": 0, "lent": 0}  # pulls done: read from an offer, or lent

    # -- what Objects asks (the Elsewhere protocol) ----------------------------------------------

    def announce(self, key: str, version: int) -> None:
        """A key sealed here (version > 0) or deleted (0): every peer is told (Lending)."""
        if key in self._pulling and version:  # a replica being listed: not ours to announce
            return
        if version:
            self.index.pop(key, None)  # put here: this node holds it now
            self.held.drop(key)
        self.lending.announce(key, version)

    def flush(self) -> None:
        """Send what this loop left for after its replies: announcements, loans returned,
        offers read or given back (Note [offers])."""
        self.lending.flush()
        if self.held.give_back_in(time.monotonic()) == 0.0:
            for node, offers in self.held.take_due().items():
                self.links.send(node, {"op": "offers_back", "offers": offers})
        later, self._later = self._later, []
        for node, message in later:
            self.links.send(node, message)

    def get(self, session: Session, route: bytes, req: Request) -> bool:
        """A get of a key another node has, in a version newer than the get's `after` (a
        watch's): pulled, the get waits for the pull. False if no node has one (a watch
        then waits in its key's line: `listed` pulls for it when one is announced).
        PeerUnavailable if its node is down."""
        key, after = req.fields["key"], req.fields.get("after", 0)
        remote = self.index.get(key)
        if remote is None or remote.version <= after:
            return False
        timeout = req.fields.get("timeout", 0.0)
        if not self.links.up(remote.node):  # a get that may wait, waits for it to be back
            down = f"{key!r} lives on node {remote.node!r}, which is down"
            if timeout == 0.0:
                raise PeerUnavailable(
                    f"{down}: try again once it is back, or pass timeout= to wait for it "
                    "(`tensorbroker stats` shows the cluster's peers)"
                )
            self.lot.park(session, route, req, timeout, ("get", key), f"{down}, and stayed down")
            return True  # (its welcome lists the key again: `listed` pulls it for this get)
        wait = None if timeout is None else max(timeout, PULL_WAIT)
        message = f"the pull of {key!r} from node {remote.node!r} did not end within {wait}s"
        w = self.lot.park(session, route, req, wait, ("get", key), message)
        pull = self._pulling.get(key)
        if pull is None:
            self._ask(key, remote.node, [w])
        else:
            pull.waiters.append(w)
        return True

    def keys(self) -> list[str]:
        return list(self.index)

    def where(self) -> Mapping[str, tuple[str, int, int]]:
        """The other nodes' keys: key -> (node, version, size), a view (no copy: `list`
        asks for it at each page)."""
        return MappingProxyType(self.index)

    def delete(self, key: str) -> bool:
        """A delete of another node's key: sent to it (False if no other node has `key`).
        Its replica here and its place in the index go now; the other nodes forget it when
        its owner announces the delete. PeerUnavailable if its node is down."""
        remote = self.index.get(key)
        if remote is None:
            return False
        if not self.links.send(remote.node, {"op": "delete", "key": key}):
            raise PeerUnavailable(
                f"{key!r} lives on node {remote.node!r}, which is down: delete it once it is back"
            )
        self._forget(key)
        return True

    def deleted(self, node: str, key: str) -> None:
        """`node` deleted `key`, which this node holds (not a replica): deleted here too."""
        if key in self.registry.objects and key not in self.index:
            self.objects.forget(key)

    def holds(self, key: str) -> bool:
        return key in self.index

    # -- what the other nodes hold ---------------------------------------------------------------

    def own(self) -> list[list[Any]]:
        """The keys this node holds, not its replicas: [[key, version, size], ...]."""
        return [
            [k, o.version, int(o.nbytes)]
            for k, o in self.registry.objects.items()
            if o.device == "cpu" and k not in self.index and k not in self._pulling
        ]

    def welcome(self, node: str, keys: list[Any]) -> None:
        """What `node` holds, as it (re)joined: its keys known from before and gone are
        forgotten."""
        listed = set()
        for key, version, size in keys:
            listed.add(str(key))
            self.listed(node, str(key), int(version), int(size))
        for key in [k for k, r in self.index.items() if r.node == node and k not in listed]:
            self._forget(key)

    def listed(
        self, node: str, key: str, version: int, size: int, offer: dict[str, Any] | None = None
    ) -> None:
        """`node` holds `key` at `version` now (0: deleted there), and may offer it."""
        here = self.registry.objects.get(key)
        known = self.index.get(key)
        if version == 0:
            if known is not None and known.node == node:
                self._forget(key)
            return
        mine = here is not None and known is None  # put here (a replica's key is indexed)
        if (known is not None and (known.version, known.node) > (version, node)) or (
            mine and (here.version, self.node) > (version, node)  # type: ignore[union-attr]
        ):
            if offer is not None:  # a version that lost here: its offer is not wanted
                self.held.refuse(node, key, version)
            return
        self.index[key] = Remote(node, version, size)
        if offer is not None:
            self.held.keep(node, key, version, offer)
        elif self.held.of(key, node, version) is None:
            self.held.drop(key)
        if known is None or (known.node, known.version) != (node, version):  # heard once
            self.registry.seen_version(key, version)  # a put here from now on goes above it
            self.objects.arrived(key, version)  # an event for watch_prefix; waits for keys told
        stale = known is not None and (known.node != node or known.version < version)
        if here is not None and (mine or stale):  # a put that lost, or a replica of a loser's
            self.registry.delete(key)
        # Gets and watches waiting for a version: pulled now. So is the new version of a key
        # read here before (a weight-sync reader does not pay the pull at its next get).
        line = self.lot.line(("get", key))
        waiting = [w for w in line if w.request.fields.get("after", 0) < version]
        if (waiting or (here is not None and stale)) and self.links.up(node):
            pull = self._pulling.get(key)
            if pull is None:
                self._ask(key, node, waiting)
            else:
                pull.waiters.extend(w for w in waiting if w not in pull.waiters)

    def _forget(self, key: str) -> None:
        """`key` is no other node's now: its replica here goes too, as a delete (its watchers
        are told; else it would pass for a put of this node's)."""
        version = self.index.pop(key).version
        self.held.drop(key)
        if key in self.registry.objects and key not in self._pulling:
            self.objects.forget(key)
        else:
            self.objects.events.record("delete", key, version)

    def node_down(self, node: str) -> None:
        for pull in [p for p in self.pulls.values() if node in (p.node, p.source)]:
            if pull.node != node and pull.handle is None:  # a borrower sent to: the owner
                self._ask_at(pull, pull.node, direct=True)
            else:
                self._fail(pull, PeerUnavailable(f"node {node!r} went down during the pull"))
        self.let_go(node)

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: what it was lent or offered is unpinned (it will not
        say), and what it offered is void (its addresses are new, if it restarted)."""
        self.lending.let_go(node)
        self.held.forget(node)

    # -- pulls ------------------------------------------------------------------------------------

    @property
    def poll_in(self) -> float:
        """Seconds until the reads under way are polled again (poll_due), or the offers due
        are given back."""
        now = time.monotonic()
        due = self.held.give_back_in(now)
        for p in self.pulls.values():
            if p.handle is not None:
                due = min(due, poll_due(self.transfers.ends(p.read_at, p.size), now))
            elif not p.asked:
                due = min(due, ASK_AGAIN)
        return due

    def _ask(
        self, key: str, node: str, waiters: Sequence[Waiter], lends: Sequence[tuple[str, int]] = ()
    ) -> Pull:
        """Pull `key` from `node` for `waiters` (and `lends`, pulls of other nodes sent here):
        read at once if it offered the version listed (so they are its before, in case it
        fails at once: no room here, say), else asked to lend it."""
        self._ids += 1
        pull = Pull(self._ids, key, node, self.index[key].version, time.monotonic(), node)
        pull.waiters, pull.lends = list(waiters), list(lends)
        self.pulls[pull.id] = self._pulling[key] = pull
        offer = self.held.of(key, node, pull.seen)
        if offer is not None and not self.links.fresh(node):  # it may have let it go
            self.held.drop(key)
            offer = None
        if offer is None:
            pull.asked = self.links.send(node, {"op": "lend", "pull": pull.id, "key": key})
        else:
            offer.reading, pull.offer = True, offer
            self._take(pull, offer.fields, offer.version)
        return pull

    def _unoffered(self, pull: Pull, exc: Exception) -> None:
        """A read from an offer failed (a segment of its owner's that this node's NIXL does
        not know yet, say): the offer is given back, and its owner asked to lend it instead."""
        offer, pull.offer = pull.offer, None
        if offer is not None:
            self.held.read(pull.key, offer, failed=True)
        if pull.put:
            self.registry.abort(self.session, pull.put, False)
        pull.put = pull.version = 0
        if not self.links.up(pull.node):
            self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))
            return
        pull.started = time.monotonic()
        pull.asked = self.links.send(pull.node, {"op": "lend", "pull": pull.id, "key": pull.key})

    def _ask_at(self, pull: Pull, source: str, direct: bool = False) -> None:
        """Ask `source` to lend `pull`'s key instead (the owner sent it there; or, `direct`,
        the owner again, after `source` failed it)."""
        pull.source, pull.started = source, time.monotonic()
        message = {"op": "lend", "pull": pull.id, "key": pull.key}
        if direct:
            message["direct"] = True
        pull.asked = self.links.send(source, message)
        if not pull.asked and source != pull.node:
            self._ask_at(pull, pull.node, direct=True)

    def _again(self, pull: Pull, error: BrokerError) -> None:
        """Pull it again from where the index says it is now (another version won, or it was
        deleted there, meanwhile), for the same gets; `error` for them if no node has it."""
        self._end(pull)
        remote = self.index.get(pull.key)
        if remote is not None and self.links.up(remote.node):
            self._ask(pull.key, remote.node, pull.waiters, pull.lends)
            pull.lends = []
        else:
            self._fail(pull, error)

    def lent(self, m: dict[str, Any]) -> None:
        pull = self.pulls.get(int(m["pull"]))
        if pull is None:
            return
        if "redirect" in m:  # its owner lent it enough: one of those borrowers lends it
            to = str(m["redirect"])
            self._ask_at(pull, to) if self.links.up(to) else self._ask_at(pull, pull.node, True)
            return
        if "error" in m and pull.source != pull.node:  # a borrower failed it: the owner lends
            self._ask_at(pull, pull.node, direct=True)
            return
        if "error" in m:  # it had no such key: another node's won, or it was deleted there
            if "at" in m and m["at"][0] != self.node:  # where it won, heard here before its own
                self.listed(str(m["at"][0]), pull.key, int(m["at"][1]), int(m["at"][2]))
            remote = self.index.get(pull.key)
            gone = NotFound(f"no object {pull.key!r}: {m['error']}")
            if remote is not None and (remote.node, remote.version) != (pull.node, pull.seen):
                self._again(pull, gone)
            else:
                self._fail(pull, gone)
            return
        self._take(pull, m, int(m["version"]))

    def _take(self, pull: Pull, m: dict[str, Any], version: int) -> None:
        """Start reading `version`, lent or offered (`m`), into a block of a replica's."""
        pull.version = version
        try:
            specs, bundle = self.transfers.layout(pull.source, m)
            pull.put, obj = self.registry.begin_put(self.session, pull.key, specs, bundle)
            obj.evictable = True  # a replica is a cache
            pull.handle, pull.size = self.transfers.take(pull.source, m, obj)
            pull.read_at = time.monotonic()
        except BrokerError as exc:  # no room here for it (CapacityError), say
            self._fail(pull, exc)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            if pull.offer is not None:
                self._unoffered(pull, exc)
            else:
                self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))

    def poll(self, now: float) -> None:
        """Reads that ended (sealed as replicas), and lends never answered."""
        for pull in list(self.pulls.values()):
            if pull.handle is not None:
                self._poll(pull)
            elif not pull.asked:  # its link was not connected (its owner restarting, say)
                again = {"op": "lend", "pull": pull.id, "key": pull.key}
                pull.asked = self.links.send(pull.source, again)
            elif now - pull.started > PULL_WAIT:
                self._fail(pull, PeerUnavailable(f"node {pull.node!r} did not lend {pull.key!r}"))

    def _poll(self, pull: Pull) -> None:
        try:
            if not self.transfers.done(pull.handle):
                return
        except OSError as exc:
            pull.handle = None
            if pull.offer is not None:
                self._unoffered(pull, exc)
            else:
                self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))
            return
        pull.handle = None
        self.transfers.took(pull.size, time.monotonic() - pull.read_at)
        self.bytes_received += pull.size
        self.pulled["lent" if pull.offer is None else "offered"] += 1
        if pull.offer is not None:  # its owner counts the bytes it sent
            read = {"op": "offer_read", "key": pull.key, "version": pull.version}
            self._later.append((pull.node, read))
        remote = self.index.get(pull.key)
        if remote is not None and (remote.node, remote.version) == (pull.node, pull.version):
            self.objects.seal(self.session, pull.put, False, version=pull.version)
            self._end(pull)
            obj = self.registry.objects.get(pull.key)
            for node, their in pull.lends:  # pulls sent here meanwhile: lent the replica
                if obj is not None:
                    self.links.answer(node, self.lending.loan(node, their, obj))
            return
        self.registry.abort(self.session, pull.put, False)  # deleted, or another version won
        pull.put = 0
        self._again(pull, NotFound(f"no object {pull.key!r}: it went while it was pulled"))

    def _fail(self, pull: Pull, error: BrokerError) -> None:
        if pull.handle is not None:  # still reading: its block must outlive the read
            return
        self._end(pull)
        for node, their in pull.lends:  # sent here: their owner lends it to them instead
            gone = f"node {self.node!r} could not pull {pull.key!r}"
            self.links.answer(node, {"op": "lent", "pull": their, "error": gone})
        if pull.put:
            self.registry.abort(self.session, pull.put, False)
        for w in pull.waiters:
            if not w.done:
                self.objects.answer(w, reply_error(w.request.id, error))

    def _end(self, pull: Pull) -> None:
        """The pull is over: the lender unpins its object (after this loop's replies); an
        offer read is given back if it was dropped meanwhile."""
        self.pulls.pop(pull.id, None)
        if self._pulling.get(pull.key) is pull:
            del self._pulling[pull.key]
        if pull.offer is not None:
            self.held.read(pull.key, pull.offer)
        elif pull.version:
            self._later.append((pull.source, {"op": "returned", "pull": pull.id}))
