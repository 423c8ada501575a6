"""The pulls of other nodes' versions into this node's memory as replicas (Note [cluster] in
cluster.py): each asked for (`lend`; or read at once from the offer its announcement carried,
Note [offers] in offers.py), read by NIXL into a block of this node's, and sealed as its key's
replica, which answers the gets that wait for it. replicas.py says which are wanted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ...common.errors import BrokerError, InvalidRequest, NotFound, PeerUnavailable
from ..store.arena import Growing
from ..store.objects import Objects
from ..store.parking import Waiter
from ..store.records import Session, StoredObject
from .offers import Held
from .pull_failures import Failing
from .records import Links, Pull, Remote
from .transfers import CHUNK, Transfers

PULL_WAIT = 30.0  # a lend unanswered this long is asked of the owner again (a get waits as long)
POLL = 0.001  # seconds between looks at what waits on something else (a slot, a fresh peer)
# A pull whose reads (or pushed pieces) failed, its owner up, is read again so often, then
# fails: a piece's request or answer lost with a connection (Note [pushes] in pushes.py), or
# a read NIXL refused (a get failed so once, with nixlNotFoundError, after its owner's
# restart in a fresh-clone CI run of test_etcd; the cause was not found).
READ_AGAIN = 2
ASK_AGAIN = 0.01  # a lend that could not go out (its link not connected) is sent again so often


class Pulls(Failing):
    """The pulls under way, by id and by key. `index` is Replicas' (where each key lives: a
    read is sealed only if it still names the version read), `listed(node, key, version,
    size)` tells it of a version a lender said won, and `loan(node, pull, obj)` lends a
    replica just pulled to the pulls of other nodes sent here meanwhile."""

    def __init__(
        self, node: str, objects: Objects, transfers: Transfers, links: Links,
        index: dict[str, Remote], held: Held, listed: Callable[[str, str, int, int], None],
        loan: Callable[[str, int, StoredObject, int], dict[str, Any]],
        lend: Callable[[str, int, str, int], None],
    ) -> None:  # fmt: skip
        self.node, self.objects, self.registry = node, objects, objects.registry
        self.transfers, self.links, self.index, self.held = transfers, links, index, held
        self.listed, self.loan = listed, loan  # loan: Lending.loan (a replica lent on)
        self.lend = lend  # Lending.lend (a version lent on while it is read)
        self.session = Session(f"cluster:{node}", None)  # holds the replicas' puts
        self.pulls: dict[int, Pull] = {}  # pull id -> pull
        self.pulling: dict[str, Pull] = {}  # key -> its pull under way
        self._ids = time.time_ns()  # (ids of a restarted broker's pulls are new to its peers)
        self.bytes_received = 0
        self.done = {"offered": 0, "lent": 0}  # pulls done: read from an offer, or lent
        # node -> when a pull that asked it to lend ended with no loan read (a `lent` lost
        # may pin one there: its link stays in use, Cluster._busy)
        self.ended: dict[str, float] = {}

    def want(self, key: str, node: str, waiters: Sequence[Waiter]) -> None:
        """`waiters` want `key` from `node`: they join its pull under way, or start one."""
        pull = self.pulling.get(key)
        if pull is None:
            self.ask(key, node, waiters)
        else:
            pull.waiters.extend(w for w in waiters if w not in pull.waiters)

    def node_down(self, node: str) -> None:
        self.transfers.abandon(node, f"node {node!r} went down")  # (Note [pushes])
        for pull in [p for p in self.pulls.values() if node in (p.node, p.source)]:
            if pull.room is not None and pull.node != node:  # a relay's loan, waiting here
                pull.room = None
                self._read_again(pull, PeerUnavailable(f"node {node!r} went down"))
                continue
            pull.room = None
            if pull.node != node and pull.handle is None:  # a borrower sent to: the owner
                self._ask_at(pull, pull.node, direct=True)
            else:
                self._fail(pull, PeerUnavailable(f"node {node!r} went down during the pull"))

    @property
    def poll_in(self) -> float:
        """Seconds until a lend that did not go out is sent again, or the offers due are given
        back (a read that ended wakes the loop itself: Transfers.fd)."""
        now = time.monotonic()
        due = self.held.give_back_in(now)
        for p in self.pulls.values():
            if p.handle is None and not p.asked and self.links.fresh(p.source):
                due = min(due, ASK_AGAIN)  # (a beat answer wakes the loop)
            if p.room is not None:  # (read once its memory is in: Broker's GROW_POLL)
                due = min(due, POLL)
        return due

    def ask(
        self,
        key: str,
        node: str,
        waiters: Sequence[Waiter],
        lends: Sequence[tuple[str, int, int]] = (),
    ) -> Pull:
        """Pull `key` from `node` for `waiters` (and `lends`, pulls of other nodes sent here):
        read at once if it offered the version listed (so they are its before, in case it
        fails at once: no room here, say), else asked to lend it."""
        self._ids += 1
        pull = Pull(self._ids, key, node, self.index[key].version, time.monotonic(), node)
        pull.waiters, pull.lends = list(waiters), list(lends)
        self.pulls[pull.id] = self.pulling[key] = pull
        offer = self.held.of(key, node, pull.seen)
        if offer is not None and not self.links.fresh(node):  # it may have let it go
            self.held.drop(key)
            offer = None
        if offer is None:
            self._lend(pull)
        else:
            offer.reading, pull.offer = True, offer
            self._take(pull, offer.fields, offer.version)
        return pull

    def _lend(self, pull: Pull, source: str | None = None, direct: bool = False) -> None:
        """Ask `source` (else the pull's) to lend its key: lend number `ask`, the only one
        whose answer is read."""
        pull.source = pull.source if source is None else source
        pull.ask, pull.direct = pull.ask + 1, direct
        message = {"op": "lend", "pull": pull.id, "key": pull.key, "ask": pull.ask,
                   "t": time.monotonic()}  # fmt: skip
        if direct:
            message["direct"] = True
        pull.asked = self.links.send(pull.source, message)

    def forget(self, node: str) -> None:
        """`node` forgot this one, or this one it: what it lent or offered may be let go
        already. A read of it under way is not sealed; a loan waiting for memory here is not
        read; a lend not answered yet is asked again, once `node` is fresh."""
        for pull in list(self.pulls.values()):
            if pull.source == node and pull.room is not None:
                pull.room = None
                self._read_again(pull, OSError(f"node {node!r} forgot this one"))
            elif pull.source == node and pull.handle is not None:
                pull.suspect = pull.cut = True  # (a relay's rest will not come)
            elif pull.source == node and not pull.version:
                pull.ask, pull.asked = pull.ask + 1, False  # (an answer to the last: not read)

    def _ask_at(self, pull: Pull, source: str, direct: bool = False) -> None:
        """Ask `source` to lend `pull`'s key instead (the owner sent it there; or, `direct`,
        the owner again, after `source` failed it)."""
        pull.started = time.monotonic()  # (PULL_WAIT for each node asked)
        self._lend(pull, source, direct)
        if not pull.asked and source != pull.node:
            self._ask_at(pull, pull.node, direct=True)

    def waits_for(self, node: str, pull_id: int, ask: Any = None) -> bool:
        """Whether pull `pull_id` still waits for `node` to answer its lend `ask` (the last)."""
        pull = self.pulls.get(pull_id)
        if pull is None or pull.source != node or pull.handle is not None or pull.version:
            return False
        return ask is None or ask == pull.ask

    def lent(self, node: str, m: dict[str, Any]) -> None:
        """`node`'s answer to a lend: where the bytes are, or where to ask, or an error. A
        loan no pull takes goes back; so does one `node` may have let go already (it took
        this broker for down, or forgot it: not `fresh`, or not `acked`), asked again."""
        pull_id, ask = int(m["pull"]), m.get("ask")
        pull = self.pulls.get(pull_id)
        if pull is None or not self.waits_for(node, pull_id, ask):
            if "version" in m:
                self._return(node, pull_id, ask or 0)
            return
        if "version" in m and not (self.links.fresh(node) and self.links.acked(node, m)):
            self._return(node, pull_id, ask or 0)
            pull.asked = False  # asked again once fresh
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
                if remote is not None and remote.node == pull.node and "at" not in m:
                    self.listed(pull.node, pull.key, 0, 0)  # its owner has none: forgotten
            return
        version, remote = int(m["version"]), self.index.get(pull.key)
        if remote is not None and remote.node == pull.node and remote.version < version:
            # A version this node was not told of (it did not follow the key: Note [follows])
            self.index[pull.key] = remote._replace(version=version)
            self.registry.seen_version(pull.key, version)
        self._take(pull, m, version)

    def _take(self, pull: Pull, m: dict[str, Any], version: int) -> None:
        """Start reading `version`, lent or offered (`m`), into a block of a replica's."""
        pull.version = version
        try:
            specs, bundle, device = self.transfers.layout(pull.source, m)
            try:
                pull.put, obj = self.registry.begin_put(
                    self.session, pull.key, specs, bundle, device=device, wait=True
                )
            except Growing as growing:  # read once there is room (Note [growing], arena.py)
                pull.room = (m, version, growing.growth)
                return
            except InvalidRequest as exc:  # a device this broker does not serve
                where = f"{pull.key!r} lives on {device} of node {pull.source!r}"
                raise InvalidRequest(f"{where}; a replica here needs that device: {exc}") from None
            obj.evictable = True  # a replica is a cache (of host memory: eviction.py)
            pull.obj = obj
            lent = pull.offer is None  # (its lender pushes it: Note [pushes] in pushes.py)
            pull.handle, pull.size = self.transfers.take(pull.source, m, obj, lent)
            pull.reading = pull.handle
            if pull.lends and pull.lendable(CHUNK):  # (asked here before its read began)
                lends, pull.lends = pull.lends, []
                for node, their, ask in lends:  # lent now, read as it comes (Note [relays])
                    self.lend(node, their, pull.key, ask)
        except BrokerError as exc:  # no room here for it (CapacityError), say
            self._fail(pull, exc)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            if pull.offer is not None:
                self._read_again(pull, exc)
            else:
                self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))

    def poll(self, now: float) -> None:
        """Reads that ended (sealed as replicas), lends never answered, and reads from a relay
        that said nothing more for PULL_WAIT (its `more` lost: read again, from the owner)."""
        for pull in list(self.pulls.values()):
            if pull.room is not None:
                self._roomy(pull)
            elif pull.handle is not None:
                if now - pull.started > PULL_WAIT and pull.handle.limit < pull.size:
                    pull.cut = True
                self._poll(pull)
            elif now - pull.started > PULL_WAIT:
                self._unanswered(pull)
            elif not pull.asked and self.links.fresh(pull.source):  # (not connected, say)
                self._lend(pull, direct=pull.direct)

    def _roomy(self, pull: Pull) -> None:
        """A loan that waited for this node's memory to grow is read once it did; if the
        segment could not be made, it is read if it fits now, else the pull fails as that
        did (Note [growing] in server/store/arena.py)."""
        assert pull.room is not None
        m, version, growth = pull.room
        if not growth.over:
            return
        pull.room = None
        pull.started = time.monotonic()  # (PULL_WAIT from its read's start)
        with self.registry.arena.after(growth):
            try:
                self._take(pull, m, version)
            except Exception as exc:  # (taking the segment in failed: NIXL's registration)
                self._fail(pull, BrokerError(f"the pull of {pull.key!r} failed: {exc!r}"))

    def more(self, node: str, m: dict[str, Any]) -> None:
        """The relay `node` that lent a version it was still pulling has more of it (`ready`
        bytes), or failed it (`error`: read again, from the owner). Note [relays] in
        lending.py."""
        pull = self.pulls.get(int(m["pull"]))
        if pull is None or pull.source != node or pull.ask != m.get("ask"):
            return
        if pull.room is not None:  # (its read waits for memory here: Note [growing])
            pull.started = time.monotonic()
            if "error" in m:
                pull.room = None
                self._read_again(pull, OSError(f"node {node!r} failed {pull.key!r}"))
            else:
                pull.room[0]["ready"] = int(m["ready"])  # (its read begins with that much)
            return
        if pull.handle is None:
            return
        pull.started = time.monotonic()  # (PULL_WAIT from each `more`)
        if "error" in m:
            pull.cut = True
        else:
            try:
                self.transfers.extend(pull.handle, int(m["ready"]))
            except OSError:
                pull.cut = True
        self._poll(pull)

    def _tell(self, pull: Pull, **fields: Any) -> None:
        """Tell the borrowers `pull` was lent to while it was read (Note [relays])."""
        for node, their, ask in pull.partial:
            self.links.answer(node, {"op": "more", "pull": their, "ask": ask, **fields})

    def _cut(self, pull: Pull, why: str) -> None:
        """The borrowers lent `pull` meanwhile read it from its owner instead."""
        self._tell(pull, error=why)
        pull.partial = []

    def _poll(self, pull: Pull) -> None:
        try:
            if not self.transfers.done(pull.handle):
                if pull.cut and pull.handle.ended():  # (its relay will not say more)
                    pull.handle = None
                    self._read_again(pull, OSError(f"node {pull.source!r} failed {pull.key!r}"))
                    return
                ready = pull.handle.ready()
                if pull.partial and pull.told < ready < pull.size:
                    pull.told = ready
                    self._tell(pull, ready=ready)
                return
        except OSError as exc:
            pull.handle = None
            if pull.reads_failed < READ_AGAIN and self.links.up(pull.node):
                pull.reads_failed += 1
                self._read_again(pull, exc)
            elif pull.offer is not None or pull.cut or pull.source != pull.node:  # (a relay's:
                self._read_again(pull, exc)  # its owner lends it)
            else:
                self._fail(pull, PeerUnavailable(f"the pull of {pull.key!r} failed: {exc}"))
            return
        if not (pull.suspect or pull.cut) and not self._vouched(pull):
            return  # (read: sealed once its source's answer to a beat vouches for it)
        pull.handle = None
        # Its source forgot this node, or may have (what was read may be torn), or a relay
        # failed it or said no more (Note [relays]): asked again.
        if pull.suspect or pull.cut or not self.links.fresh(pull.source):
            why = (
                "its source forgot this node during the read" if pull.suspect
                else "its relay said no more of it" if pull.cut
                else "its source did not say it kept this node up during the read"
            )  # fmt: skip
            pull.suspect = False
            self._read_again(pull, OSError(why))
            return
        self.bytes_received += pull.size
        self.done["lent" if pull.offer is None else "offered"] += 1
        if pull.offer is not None:  # its owner counts the bytes it sent
            self.held.was_read(pull.node, pull.key, pull.version)
        remote = self.index.get(pull.key)
        if remote is not None and (remote.node, remote.version) == (pull.node, pull.version):
            self.objects.seal(self.session, pull.put, False, version=pull.version)
            pull.reading = None
            obj = self.registry.objects.get(pull.key)
            if obj is not None:  # lent while read: pinned now, and told the rest is here
                for node, their, ask in pull.partial:
                    self.loan(node, their, obj, ask)
                self._tell(pull, ready=pull.size)
                pull.partial = []
            self._end(pull)
            for node, their, ask in pull.lends:  # pulls sent here meanwhile: lent the replica
                if obj is not None:
                    self.links.answer(node, self.loan(node, their, obj, ask))
            return
        self._drop(pull)  # deleted, or another version won
        self._again(pull, NotFound(f"no object {pull.key!r}: it went while it was pulled"))

    def _vouched(self, pull: Pull) -> bool:
        """Whether `pull`, read, may be sealed or thrown away now. Its source may have let go
        of what it lent only if it took this node for down, and then its next answer says
        it forgot this node (`forget`: the pull is suspect). So a read that ends once the
        source's last answer to a beat no longer vouches for now (not `fresh`: the loop was
        slow, or the links busy) waits for the answer to the beat that `fresh` sends, rather
        than being read again, which cost the owner a third copy of a 512 MiB version
        (2.20-2.40 copies a version in 2 weight-sync runs of about 10). It waits at most
        PULL_WAIT from the end of its read, and not for a source that is down."""
        if self.links.fresh(pull.source) or not self.links.up(pull.source):
            return True
        now = time.monotonic()
        if pull.read_at == 0.0:
            pull.read_at = now
        return now - pull.read_at > PULL_WAIT

    def _end(self, pull: Pull) -> None:
        """The pull is over: the lender unpins its object (after this loop's replies); an
        offer read is given back if it was dropped meanwhile."""
        self.pulls.pop(pull.id, None)
        if self.pulling.get(pull.key) is pull:
            del self.pulling[pull.key]
        self._cut(pull, f"node {self.node!r} could not pull {pull.key!r}")  # (if lent)
        if pull.offer is not None:
            self.held.read(pull.key, pull.offer)
        elif pull.version:
            self._return(pull.source, pull.id, pull.ask)
        else:
            self.ended[pull.source] = self.ended[pull.node] = time.monotonic()

    def _return(self, node: str, pull: int, ask: int) -> None:
        """Say to `node` that the loan of lend `ask` of `pull` is through (after the replies)."""
        self.links.after(node, {"op": "returned", "pull": pull, "ask": ask})
