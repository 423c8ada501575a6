"""The keys of a cluster's other nodes (Note [cluster] in cluster.py): the index of what each
holds, and which of their versions this node pulls into its memory as replicas (the pulls:
pulls.py; this node's objects lent to theirs: lending.py). Which version wins, the same on
every node: the highest, then the one of the greatest node name.

A replica is listed in this node's directory under its key and its owner's version, so that
its readers read it as any object (microseconds); it is evictable, and dropped when another
version wins. It is never announced: the index keeps its key, which is how this room tells a
replica from a put of this node's.

Note [prefetch]

A first get of another node's small version cost a read from its owner, even with the offer
that came with its announcement (Note [offers]): 566 us for 4 KiB, ten ZeroMQ round trips,
nearly all of it Python and NIXL calls on both brokers. So a version offered (at most
OFFER_MAX bytes, 64 KiB) is read as soon as it is listed, while a quarter of this node's
memory would still be free after it (prefetches do not crowd out this node's own puts): its
first get here is then a local read.
`serve --prefetch SIZE` turns it on (at most OFFER_MAX). It costs each small put one read by
every node that asked, and each of them the memory of the small versions: a cache, evicted as
any replica. Off by default since the etcd membership (bench/scaling.py, 4 KiB puts to keys
no other node reads, the other brokers' CPU per put): with every node prefetching, 1.37 ms
at 4 brokers, 3.6 ms at 8 and 15.2 ms at 16; without, 0.33, 0.87 and 1.77 ms.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ...common.errors import PeerUnavailable
from ...common.protocol import Request
from ..store.objects import Objects
from ..store.parking import ParkingLot
from ..store.records import Session
from .follows import Following
from .homes import Homes
from .lending import Lending
from .offers import Held
from .ordering import Ordering
from .pulls import PULL_WAIT, Pulls
from .records import Links, Remote
from .transfers import Transfers

log = logging.getLogger(__name__)


class Replicas(Ordering, Following):
    """The index of the other nodes' keys; the pulls under way (`pulls`: Pulls) and the
    loans out (`lending`: Lending)."""

    def __init__(
        self, node: str, objects: Objects, lot: ParkingLot, transfers: Transfers, links: Links,
        prefetch: int = 0,
    ) -> None:  # fmt: skip
        self.node, self.objects, self.registry, self.lot = node, objects, objects.registry, lot
        self.transfers, self.links = transfers, links
        self.prefetch = prefetch  # versions offered of at most this many bytes: read as listed
        self.prefetched = 0  # pulls started as a version was listed, for no get
        self.puts_lost = 0  # puts here that lost to another node's version (`listed`)
        self.index: dict[str, Remote] = {}  # key -> where it lives (other nodes only)
        self.held = Held()  # the offers of other nodes' versions (Note [offers] in offers.py)
        self.pulls = Pulls(
            node, objects, transfers, links, self.index, self.held, self.listed,
            lambda node, pull, obj, ask: self.lending.loan(node, pull, obj, ask),
            lambda node, pull, key, ask: self.lending.lend(node, pull, key, ask=ask),
        )  # fmt: skip
        self.session, self._pulling = self.pulls.session, self.pulls.pulling
        # Where keys live (Note [homes] in homes.py): their homes, asked by lookups.
        self.homes = Homes(node, objects, links, self.index, self.own, self.listed)
        self.lending = Lending(
            node, self.registry, transfers, links, self.index, self._pulling, self.homes.told
        )
        # What this node follows (Note [follows] in follows.py): keys where a get or watch
        # waited (key -> the node asked), besides those it holds replicas of; and prefixes.
        self.following: dict[str, str] = {}
        self.prefixes: set[str] = set()

    # -- what Objects asks (the Elsewhere protocol) ----------------------------------------------

    def announce(self, key: str, version: int) -> None:
        """A key sealed here (version > 0) or deleted (0): its homes and followers are told
        (Lending)."""
        if key in self._pulling and version:  # a replica being listed: not ours to announce
            return
        if not version and key in self.index:  # a replica dropped (evicted, say): the key
            return  # lives on (its owner announces its delete)
        if version:
            known = self.index.pop(key, None)  # put here: this node holds it now
            if known is not None:  # (the node whose version this one beats hears its claim)
                self.lending.beaten[key] = known.node
            self.held.drop(key)
            self.following.pop(key, None)
        self.lending.announce(key, version)

    def flush(self) -> None:
        """Send what this loop left for after its replies: announcements, and offers given
        back (Note [offers]); Links sends the rest (`after`)."""
        self.lending.flush()
        if self.lending.unwritten:
            self.lending.lend_written()
        if self.held.give_back_in(time.monotonic()) == 0.0:
            for node, said in self.held.take_due().items():
                self.links.after(node, {"op": "offers_back", **said})

    def get(self, session: Session, route: bytes, req: Request) -> bool:
        """A get of a key another node has, in a version newer than the get's `after` (a
        watch's): pulled, the get waits for the pull. False if no node has one (a watch
        then waits in its key's line: `listed` pulls for it when one is announced).
        PeerUnavailable if its node is down."""
        key, after = req.fields["key"], req.fields.get("after", 0)
        remote = self.index.get(key)
        if remote is None or remote.version <= after:
            if remote is not None:  # it waits for a version: its owner tells this node
                self._follow(key, remote)
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
        again = "until" in req.fields  # a get whose pull failed (Pulls._get_again): its
        if not again:  # own deadline kept, no PULL_WAIT added
            req.fields["until"] = None if timeout is None else time.monotonic() + timeout
        wait = None if timeout is None else timeout if again else max(timeout, PULL_WAIT)
        message = f"the pull of {key!r} from node {remote.node!r} did not end within {wait}s"
        w = self.lot.park(session, route, req, wait, ("get", key), message)
        self.pulls.want(key, remote.node, [w])
        return True

    def keys(self) -> list[str]:
        return list(self.index)

    def lookup(self, session: Session, route: bytes, req: Request, keys: list[str]) -> bool:
        """A request of keys this node knows nothing of: their homes are asked (Homes)."""
        return self.homes.lookup(session, route, req, keys)

    def gather(self, session: Session, route: bytes, req: Request, query: dict[str, Any]) -> bool:
        """A listing: every node is asked for its keys (Homes); then `rows`."""
        return self.homes.gather(session, route, req, query)

    def rows(self, req: Request) -> Mapping[str, tuple[str, int, int]]:
        return self.homes.rows(req)

    def request(self, node: str, op: str, m: dict[str, Any]) -> None:
        """A message of the homes' from `node` (Note [homes]): `where` (a lookup),
        `dir` (where keys live now, from their home), `ls` (a listing)."""
        if op == "where":
            self.homes.where(node, m)
        elif op == "ls":
            self.homes.own_rows(node, m)
        elif op == "renumber":
            self.renumber(node, str(m["key"]), int(m["above"]))
        elif op == "claimed":  # (a claim its home sent on to this node, the key's owner)
            for key, owner, version, size, _, age in m["keys"]:
                if owner != self.node:
                    self.listed(str(owner), str(key), int(version), int(size), None, 0, age, True)
        else:
            for key, owner, version, size, gone in m["keys"]:
                if owner != self.node:
                    self.listed(str(owner), str(key), int(version), int(size), None, int(gone))

    def again(self, node: str, m: dict[str, Any]) -> bool:
        """Whether request `m`, which `node` did not take (it said hello_first), is still
        wanted: a lend of a pull still waiting for it, or a lookup (Note [homes])."""
        if m.get("op") == "where" and not m.get("ask"):  # (a looker's: its keys still asked)
            return any(self.homes.asked.get(str(k)) == node for k in m.get("keys", ()))
        if m.get("op") in ("where", "ls"):
            return int(m.get("ask", 0)) in self.homes.asks
        return m.get("op") == "lend" and self.pulls.waits_for(node, int(m["pull"]), m.get("ask"))

    def changed(self) -> None:
        """The nodes up changed: the keys' homes move (Homes.changed)."""
        links = self.links
        up = [n for n in links.nodes() if links.up(n)]
        self.lending.peers = len(up)  # (how long claims wait: Lending.claim_every)
        self.homes.changed(up, self.lending.claim_to, self._kept, self._drop)

    def _kept(self, key: str) -> bool:
        """Whether this node keeps `key`'s place in its index although it is not its home:
        a replica here, a pull, a get or watch waiting, a follow."""
        return (
            key in self.registry.objects or key in self._pulling or key in self.following
            or bool(self.lot.line(("get", key)))
        )  # fmt: skip

    def _drop(self, key: str) -> None:
        self.index.pop(key, None)
        self.held.drop(key)

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
        self.homes.deleting(key, remote.node, remote.version)
        self._forget(key)
        return True

    def deleted(self, node: str, key: str) -> None:
        """`node` deleted `key`, which this node holds (not a replica): deleted here too."""
        if key in self.registry.objects and key not in self.index:
            self.objects.forget(key)

    def holds(self, key: str) -> bool:
        return key in self.index

    # -- what the other nodes hold ---------------------------------------------------------------

    def own(self, home: str | None = None) -> list[list[Any]]:
        """The keys this node holds, not its replicas: [[key, version, size], ...]; those
        whose home is node `home` (up with the nodes up here), if named."""
        own = [
            [k, o.version, int(o.nbytes)]
            for k, o in self.registry.objects.items()
            if k not in self.index and k not in self._pulling
        ]
        if home is None:
            return own
        members = tuple(sorted({*self.homes.members, home}))
        return [e for e in own if self.homes.homed_at(str(e[0]), home, members)]

    def welcome(self, node: str, keys: list[Any]) -> None:
        """What `node` holds of the keys homed here, as it (re)joined: those known from
        before and gone are forgotten (the others' owners tell their followers: `follow`)."""
        listed = set()
        for key, version, size in keys:
            listed.add(str(key))
            self.listed(node, str(key), int(version), int(size))
        homes = self.homes.homes
        gone = [k for k, r in self.index.items() if r.node == node and k not in listed]
        for key in gone:
            kept = key in self.following or key in self.registry.objects
            if self.node in homes(key) and not kept:
                self._forget(key)
            elif key in self.index and key not in self._pulling:  # gets that waited for it
                line = self.lot.line(("get", key))  # to be back are pulled now
                after = self.index[key].version
                waiting = [w for w in line if w.request.fields.get("after", 0) < after]
                if waiting:
                    self.pulls.want(key, node, waiting)

    def listed(
        self, node: str, key: str, version: int, size: int,
        offer: dict[str, Any] | None = None, gone: int = 0, age: Any = None,
        relayed: bool = False,
    ) -> None:  # fmt: skip
        """`node` holds `key` at `version` now (0: deleted there; `gone`: the version it put
        and deleted before announcing it, if it did), and may offer it. `age`: a claim's,
        how long ago it was put (None: not said); `relayed`: a claim its home sent on here,
        to its owner (Note [homes])."""
        here = self.registry.objects.get(key)
        known = self.index.get(key)
        tell = self.homes.tell  # (a key's home tells its lookers: Note [homes])
        if version == 0:  # (`gone`: as if told of that put, then of the delete)
            if gone:
                self.registry.seen_version(key, gone)
            put = (gone, node)  # what beat a version, or this node's own, goes too
            beaten = []  # (the node whose version the put deleted beat: told by the home)
            done = known is None and here is None  # (else: if it deleted what is known here)
            if known is not None and (known.node == node or (known.version, known.node) < put):
                self._forget(key)
                beaten, done = ([known.node] if known.node != node else []), True
            elif here is not None and known is None:
                if (here.version, self.node) > put:  # this node's version wins: the home
                    self.lending.claim_again(key, here.version, node)  # (which forgot it) hears
                    return
                self.objects.forget(key)
                done = True
            if done:  # (the key's lookers are told, then forgotten)
                if self.homes.heard(key, beaten):
                    tell([key, node, 0, 0, gone], to=beaten, lookers=True)
                self.homes.deleted(key)
            return
        mine = here is not None and known is None  # put here (a replica's key is indexed)
        if (known is not None and (known.version, known.node) > (version, node)) or (
            mine and (here.version, self.node) > (version, node)  # type: ignore[union-attr]
        ):
            if offer is not None:  # a version that lost here: its offer is not wanted
                self.held.refuse(node, key, version)
            if mine:  # a claim that loses to this node's version
                self._beats(node, key, version, here, age)  # type: ignore[arg-type]
            else:
                self.homes.lost(key, known, node, version, size, age, relayed)  # type: ignore[arg-type]
            return
        self.index[key] = Remote(node, version, size)
        if offer is not None:
            self.held.keep(node, key, version, offer)
        elif self.held.of(key, node, version) is None:
            self.held.drop(key)
        if known is None or (known.node, known.version) != (node, version):  # heard once
            self.registry.seen_version(key, version)  # a put here from now on goes above it
            self.objects.arrived(key, version)  # an event for watch_prefix; waits for keys told
            beaten = [known.node] if known is not None and known.node != node else []
            self.homes.won(key, beaten, node, version, size, age)
        stale = known is not None and (known.node != node or known.version < version)
        if here is not None and (mine or stale):  # a put that lost, or a replica of a loser's
            if mine:
                self._lost(key, here, node, version)
            self.registry.delete(key)
        if mine:  # (its followers follow it on `node` now)
            to = self.lending.followers.of(key, size)
            tell([key, node, version, size, 0], to=to)
            self.lending.followers.drop(key)
        if relayed and known is None and here is None and not self.homes.is_home(key):
            self.links.after(node, {"op": "renumber", "key": key, "above": 0})  # a claim sent
            # on here, which let go of the key meanwhile: it claims again (its homes hear)
        if key in self.following and self.following[key] != node:
            self._follow(key, Remote(node, version, size))
        # Gets and watches waiting for a version: pulled now. So is the new version of a key
        # read here before (a weight-sync reader does not pay the pull at its next get), and
        # a small version offered (Note [prefetch]).
        line = self.lot.line(("get", key))
        waiting = [w for w in line if w.request.fields.get("after", 0) < version]
        early = not waiting and offer is not None and self._room_for(size)
        if (waiting or early or (here is not None and stale)) and self.links.up(node):
            if early and key not in self._pulling:
                self.prefetched += 1
            self.pulls.want(key, node, waiting)

    def _room_for(self, size: int) -> bool:
        """Whether a version of `size` bytes is prefetched: at most `prefetch` bytes, and
        a quarter of this node's memory still free after it (a prefetch never evicts)."""
        arena = self.registry.arena
        return size <= self.prefetch and arena.free_bytes >= arena.capacity // 4 + size

    def _forget(self, key: str) -> None:
        """`key` is no other node's now: its replica here goes too, as a delete (its watchers
        are told; else it would pass for a put of this node's)."""
        version = self.index[key].version
        self.held.drop(key)
        self.following.pop(key, None)
        if key in self.registry.objects and key not in self._pulling:
            self.objects.forget(key)  # (still indexed: not announced as this node's delete)
        else:
            self.objects.gone(key, version)
        self.index.pop(key, None)

    def node_down(self, node: str) -> None:
        self.pulls.node_down(node)
        self.let_go(node)

    def drop_reads(self, node: str) -> None:
        """What this node reads of `node`'s memory, and the offers it holds of it, are
        dropped (`node` is about to let go of them: Note [beats])."""
        self.held.forget(node)
        self.pulls.forget(node)

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: what it was lent or offered is unpinned (it will not
        say), and what it offered is void (its addresses are new, if it restarted)."""
        self.lending.let_go(node)
        self.homes.let_go(node)
        self.drop_reads(node)
        follows = self.follows(node)  # (it forgot what this node follows, or will)
        if follows is not None and self.links.up(node):
            self.links.after(node, follows)
