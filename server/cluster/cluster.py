"""One broker per node, the same keys everywhere: the links to the other brokers of a cluster
and the messages on them (what the others hold, and the pulls: replicas.py; this node's keys
announced and lent to theirs: lending.py).

Note [cluster]

    broker A (node a)                                   broker B (node b)
    ROUTER at --cluster  <──── DEALER ── hello(b, agent metadata, b's keys)
                         ──── welcome(a, agent metadata, a's keys) ───>  (and beats both ways)
    a put sealed on A  ── announce(k, version) ─> k's two homes if k is new on A (Note
                          [homes]), and the peers that follow k (Note [follows]): B's
                          index says k lives on a (a node that knows nothing of k asks a home)
                          (the puts of ANNOUNCE_EVERY in one message, each key's last)
                          (and keys(A's homed at the peer) to a peer as it comes up, in
                          case a put came between A's hello and the peer's welcome)
    client of B: get k ── not listed on B ──> B: lend k? ──> A pins it: lent(version, layout,
                                                              address of its bytes)
                          B allocates a block, NIXL READs the bytes from A's registered
                          memory, seals them as k's replica (A's version), answers the get,
                          and says `returned`: A unpins. From then on B's clients read k
                          from B's directory (microseconds), until a newer version is
                          announced: the replica is dropped (it is a cache, and evictable).
    a small version (at most 64 KiB) goes with its offer in its `key` message: B's first
    get reads it at once, without lend and lent (Note [offers] in offers.py).

With `serve --etcd`, the brokers find each other in etcd (Note [membership] in
membership.py): a broker that joins is linked to, one that leaves or dies is down once its
entry goes, whatever its beats say.

ZeroMQ carries only these control messages (msgpack, never pickle); the bytes go through NIXL
(transfers.py). Each direction of a pair talks over the link its sender opened: requests
(hello, beats, lend, returned, key) go out on this broker's DEALER to the peer, answers
(welcome, beat, lent) come back on it. A peer heard from within `down_after` seconds is
up (Note [beats] in links.py); a peer that restarts gets this broker's hello again (its
DEALER keeps trying; a broker that gets a message from a link that has not said hello
answers `hello_first`) and its keys are listed again from its welcome. A peer that goes
down: its keys raise PeerUnavailable, the replicas pulled from it stay readable, its loans
here are unpinned. A `lent` carries the lender's agent metadata of now: NIXL learns a
peer's registered memory from its metadata only, and a segment may be newer than the
welcome (an arena grows; a broker that restarted adopts segments after it joined).

A hello, welcome or beat answer carries the broker's incarnation (new at each start) and how
often it forgot the peer (took it for down, or found it restarted): the peer forgets what it
lent that broker, and what that broker offered it, once for each (and the broker, the same
of the peer's), not when a second link (two addresses of one broker) says hello. A node is
down once no link to it is up. A beat's answer also says how long ago its sender last heard
this broker: until when it will not take it for down, so not let go what it offered
(`Links.fresh`, Note [offers]). A `hello_first` names the offer it did not keep (its owner
unpins it) or the lend it did not answer (asked again behind the hello). A DEALER keeps its
route at its peer across reconnects (its routing id), so what it sends after one is still
known. What tells a peer of a change (a queue item taken, a loan returned) goes out after
the loop's replies, once the journal has the change (`Links.after`): else a broker killed
in between loses it, as its peer acted on it. The sockets, routes, incarnations and counts
are links.py's.

Queues across nodes have messages of their own (want, subs, qitem, qtaken, qback, qclose,
qremove, qleft, qhas): Note [queues across nodes] in queue_links.py. Not yet: GPU replicas.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from ...common.errors import BrokerError
from ..queues.queues import Queues
from ..store.devices import RECLAIM_POLL, DeviceChunk
from ..store.objects import Objects
from ..store.parking import ParkingLot
from .answers import Answers
from .dealers import Peer
from .joining import PROTOCOL, speaks
from .joining import Joining as Joining  # (the broker takes it from here)
from .links import BEAT, Links
from .membership import Member, Membership
from .queue_links import QueueLinks
from .records import Watched as Watched  # (the broker takes it from here)
from .replicas import Replicas
from .transfers import Transfers

log = logging.getLogger(__name__)


class Cluster(Answers):
    """The links to the peers (Note [cluster]) and the messages on them (their answers to this
    broker's requests: Answers, answers.py); what the peers hold and the pulls are
    `replicas`' (replicas.py). The broker registers `sockets` in its poller,
    calls `ready` for them and `tick` each loop; Objects asks `replicas` about keys not held
    here."""

    def __init__(
        self, joining: Joining, objects: Objects, queues: Queues, lot: ParkingLot,
        transfers: Transfers, poller: zmq.Poller,
    ) -> None:  # fmt: skip
        self.node, self.address, self.transfers = joining.node, joining.address, transfers
        self.links = links = Links(joining, poller)
        self.peers, fds = links.peers, {transfers.fd}  # (a read ended: Transfers.fd)
        poller.register(transfers.fd, zmq.POLLIN)
        self.replicas = Replicas(self.node, objects, lot, transfers, links, joining.prefetch)
        self.queues = QueueLinks(self.node, queues, transfers, links, self.replicas.session)
        self._next_tick = self._next_beat = 0.0
        self.membership: Membership | None = None
        if joining.etcd:  # (its threads start with `start`, once the broker has bound)
            record = {"address": self.address, "incarnation": links.incarnation}
            self.membership = Membership(joining.etcd, joining.etcd_prefix, self.node, record)
            links.lease_until = lambda: self.membership.alive_until  # type: ignore[union-attr]
            links.registration = lambda: self.membership.registration  # type: ignore[union-attr]
            poller.register(self.membership.fd, zmq.POLLIN)
            fds.add(self.membership.fd)
        self.sockets = links.sockets | fds  # (the peers' DEALERs: links.fd)

    def start(self) -> None:
        """Join the cluster's etcd, if it has one (Note [membership]): EtcdUnavailable if
        none answers."""
        if self.membership is not None:
            self.membership.start()

    @classmethod
    def join(
        cls, joining: Joining, queues: Queues, shm_dir: str, poller: zmq.Poller, last: Any = None
    ) -> Cluster:
        """This broker in a cluster: its NIXL agent, its links, and Objects and Queues told.
        `last`: the incarnation of the broker whose state it took over (journaled)."""
        transfers = Transfers(joining.node, shm_dir)
        objects = queues.objects
        cluster = cls(joining, objects, queues, queues.lot, transfers, poller)
        objects.registry.journal.meta("incarnation", cluster.links.follow(last))
        transfers.incarnation = cluster.links.incarnation  # (its metadata's versions)
        for segment in objects.registry.arena.segments:
            transfers.register(segment)
        devices = objects.registry.devices
        for arena in devices.arenas.values():
            for name in arena.segments:
                cluster.chunk(arena.chunk(name))
        devices.on_chunk = cluster.chunk
        objects.elsewhere, queues.elsewhere = cluster.replicas, cluster.queues
        return cluster

    def segment(self, name: str) -> None:
        """A new arena segment: registered with NIXL now, not per transfer, and the peers
        given this agent's metadata of now (an offer sent with an announcement, Note [offers]
        in offers.py, may lie in it; this message goes before any such on each link)."""
        self.transfers.register(name)
        self.links.everyone({"op": "agent", **self.transfers.agent_fields()})

    def chunk(self, chunk: DeviceChunk) -> None:
        """A new device chunk: registered with NIXL as VRAM now (or its objects are not lent:
        a NIXL built without CUDA), and the peers given this agent's metadata of now."""
        try:
            self.transfers.register_chunk(chunk.name, chunk.ptr, chunk.size, chunk.device)
        except OSError as exc:
            log.warning("%s: its objects stay on this node: %s", chunk.name, exc)
            return
        self.links.everyone({"op": "agent", **self.transfers.agent_fields()})

    @property
    def wake_in(self) -> float:
        """Seconds until the loop must look again: reads under way are polled (Replicas),
        announcements go once ANNOUNCE_EVERY passed; at once if messages wait for a flush
        (made after this loop's: an eviction, say)."""
        links = self.links  # (a move of keys: a slice a turn; answers a send found: Links.read)
        if links.holding or links.unread or self.replicas.homes.moving:
            return 0.0
        lending = self.replicas.lending
        announce = lending.announce_in(time.monotonic())
        unwritten = RECLAIM_POLL if lending.unwritten else BEAT  # (GPU copies still to run)
        return min(self.replicas.pulls.poll_in, self.queues.poll_in, BEAT, announce, unwritten)

    # -- the loop ------------------------------------------------------------------------------

    def ready(self, socket: Any) -> None:
        """Read what `socket` (one of `sockets`) has. A fault here is logged: a peer's
        message must never take the broker down."""
        try:
            self._read(socket)
        except Exception:
            log.exception("cluster: a message could not be handled")

    def _read(self, socket: Any) -> None:
        if self.membership is not None and socket == self.membership.fd:
            self._members(self.membership.take())
            return
        if socket == self.transfers.fd:  # (the reads are looked at in `tick`)
            self.transfers.mover.woken()
            return
        for route, peer, message in self.links.read(socket):
            if peer is None:
                self._request(route, message)  # type: ignore[arg-type]
            else:
                self._answer(peer, message)

    def _members(self, changes: list[Member]) -> None:
        """Brokers that joined etcd are linked to (their hello follows); those that left it
        are down now (Note [membership] in membership.py)."""
        for node, record in changes:
            if node == self.node:  # its lease expired: the others let go what they lent or
                for other in self.links.nodes():  # offered it (they say so at their next
                    self.replicas.held.give_back(other)  # beat, and forget it: what it lent
                    self.replicas.pulls.forget(other)  # them stays pinned until then)
                continue
            if record is not None:
                if isinstance(record.get("registration"), int):  # (said in its beat answers)
                    self.links.registrations[node] = record["registration"]
                address = str(record.get("address", ""))
                for peer in [p for p in self.peers if p.node == node and p.address != address]:
                    if not peer.up:  # (it restarted elsewhere: a pod's new IP, say)
                        self.links.unlink(peer)
                self.links.meet(address)
                continue
            for peer in self.peers:
                if peer.node == node and peer.up:
                    self._down(peer)

    def tick(self, now: float) -> None:
        """Beats (Note [beats] in links.py) and hellos, peers gone quiet, and reads that
        ended."""
        try:
            if now >= self._next_tick:
                self._next_tick, links = now + BEAT, self.links
                beat = now >= self._next_beat
                if beat:
                    self._next_beat = now + links.beat
                pulls = list(self.replicas.pulls.pulls)  # (loans of others: Lending.open_pulls)
                for peer in self.peers:
                    if peer.up and now - peer.heard > links.down_after:
                        self._down(peer)
                    if not peer.up:
                        links.send_to(peer, self._hello(to=peer.node))
                    elif beat:  # (`n`: what it sent on that link since its hello: Links.tally)
                        links.send_to(
                            peer, {"op": "beat", "t": now, "pulls": pulls, "n": peer.sent}
                        )
                self.queues.beat()
            if self.links.unread:  # (found by this turn's sends: Links)
                self.ready(self.links.fd)
            self.replicas.pulls.poll(now)
            self.replicas.homes.tick(now)
            self.queues.poll()
        except Exception:
            log.exception("cluster: the beat or a pull failed")

    def flush(self) -> None:
        """Send what the loop's batch left for after its replies (announcements, loans and
        offers given back): off the path of the replies."""
        try:
            self.replicas.flush()
            self.links.flush()
        except Exception:
            log.exception("cluster: the announcements could not be sent")

    # -- requests from peers (on the ROUTER) --------------------------------------------------

    def _request(self, route: bytes, m: dict[str, Any]) -> None:
        op, replicas, links = m["op"], self.replicas, self.links
        lost = links.tally(route, m)
        try:
            if op == "hello":
                if not speaks(m, links.refused):
                    return
                node = str(m["node"])
                self.transfers.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
                same = links.same(node, m)
                if same is None:  # from an incarnation that a newer one replaced
                    return
                if not same:  # restarted, or forgot this one: forgotten too
                    self._forget_node(node, mutual=True)
                links.route(route, node)
                links.reply(route, self._hello("welcome", to=node))
                links.meet(str(m.get("address", "")))
                return
            node = links.routes.get(route, "")
            if not node:  # this broker restarted (or forgot the peer): say hello first
                first: dict[str, Any] = {"op": "hello_first"}
                if op == "announce":  # the offers not kept: their owner unpins them
                    first["unoffered"] = [e[:2] for e in m["keys"] if isinstance(e[3], dict)]
                elif op == "lend":  # asked again after the hello, else its get waits it out
                    again = ("op", "pull", "key", "direct", "ask", "t")
                    first["again"] = {k: m[k] for k in again if k in m}
                elif op in ("where", "ls"):  # (so is a lookup, or a listing: Note [homes])
                    first["again"] = m
                elif op == "qitem":  # not read: its lender puts it back in its part
                    first["qback"] = [m["loan"]]
                links.reply(route, first)
            elif op == "beat":  # its answer: when this broker last heard it (links.py, `kept`)
                replicas.lending.open_pulls(node, m.get("pulls"), m.get("t"))
                heard, forgot = links.heard_ago(node), links.forgot.get(node, 0)
                answer = {"op": "beat", "t": m.get("t"), "heard_ago": heard, "forgot": forgot,
                          "down_after": links.down_after, "resync": lost,
                          "registration": links.registrations.get(node)}  # fmt: skip
                links.reply(route, {**answer, "incarnation": links.incarnation})
            elif op == "announce":
                acked = links.acked(node, m)
                for key, version, size, offer, *gone in m["keys"]:
                    offer = offer if isinstance(offer, dict) else None
                    if offer is not None and not acked:  # it will let it go
                        replicas.held.refuse(node, str(key), int(version))
                        offer = None
                    was, age = (gone + [0, None])[:2]  # (a claim's age: Note [homes])
                    replicas.listed(node, str(key), int(version), int(size), offer, int(was), age)
            elif op == "offers_back":  # (the reads first: a version read, then given back)
                for key, version in m.get("read", ()):
                    replicas.lending.offer_read(node, str(key), int(version))
                replicas.lending.offers_back(node, m["offers"])
            elif op == "agent":
                self.transfers.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
            elif op == "keys":  # (its link here is up: what this node follows is said again,
                replicas.welcome(node, m["keys"])  # as what went while it was not was lost)
                follows = replicas.follows(node)
                if follows is not None:
                    links.after(node, follows)
            elif op == "follow":
                replicas.lending.follow(
                    node, m.get("keys", []), m.get("prefixes", []), m.get("prefetch", 0)
                )
            elif op == "lend":
                pull, direct, ask = int(m["pull"]), bool(m.get("direct")), int(m.get("ask", 0))
                replicas.lending.lend(node, pull, str(m["key"]), direct, ask, m.get("t"))
            elif op == "returned":
                replicas.lending.returned(node, int(m["pull"]), int(m.get("ask", 0)))
            elif op == "delete":
                replicas.deleted(node, str(m["key"]))
            elif op in ("where", "dir", "ls", "renumber", "claimed"):  # (Note [homes])
                replicas.request(node, op, m)
            elif op.startswith("q") or op in ("want", "subs"):
                self.queues.request(node, op, m)
        except (KeyError, TypeError, ValueError, BrokerError) as exc:
            log.warning("a cluster message %r from %r could not be used: %s", op, route, exc)

    def _hello(self, op: str = "hello", to: str | None = None) -> dict[str, Any]:
        """This broker, its address, its agent, and the keys it holds homed at `to`;
        its incarnation, and how often it forgot node `to` (the node forgets it as often)."""
        keys, links = ([] if to is None else self.replicas.own(to)), self.links
        forgot = 0 if to is None else links.forgot.get(to, 0)
        return {
            "op": op, "node": self.node, "address": self.address, "keys": keys,
            "protocol": PROTOCOL,
            "incarnation": links.incarnation, "forgot": forgot, **self.transfers.agent_fields(),
        }  # fmt: skip

    def _forget_node(self, node: str, mutual: bool = False) -> None:
        """Unpin what `node` was lent or offered (it will not return it), drop what it
        offered, and forget its routes. Unless `mutual` (it forgot this one first), it is
        told, and forgets this one too."""
        self.links.forget_routes(node)
        self.replicas.let_go(node)
        self.queues.let_go(node)
        if not mutual:
            self.links.forgetting(node)

    def _down(self, peer: Peer) -> None:
        """A link whose peer stopped answering: its node is down once no link to it is up."""
        peer.up = False
        log.warning("cluster: node %r at %s is down", peer.node, peer.address)
        if peer.node is not None and not self.links.up(peer.node):
            self.replicas.changed()  # (keys' homes move: Note [homes])
            self.replicas.node_down(peer.node)
            self.queues.node_down(peer.node)
            self._forget_node(peer.node)

    # -- seeing it -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now, index, r = time.monotonic(), self.replicas.index, self.replicas
        peers = {
            (p.node or p.address): {
                "address": p.address,
                "state": "up" if p.up else "down",
                "heard_s_ago": round(now - p.heard, 3) if p.heard else None,
                "fresh": p.node is not None and self.links.fresh(p.node),  # (offers readable)
                "keys": sum(1 for k in index.values() if k.node == p.node),
            }  # fmt: skip
            for p in self.peers
        }
        return {
            "node": self.node, "address": self.address, "peers": peers,
            "bytes_sent": r.lending.bytes_sent + self.queues.bytes_sent,
            "bytes_received": r.pulls.bytes_received + self.queues.bytes_received,
            "pulls": len(r.pulls.pulls), "loans": len(r.lending.loans),
            "items_lent": len(self.queues.loans),
            "offered": len(r.lending.offered), "offers_held": len(r.held),
            "pulled": dict(r.pulls.done), "prefetched": r.prefetched,
            "lent_early": r.lending.lent_early, "followers": len(r.lending.followers),
            "lookers": len(r.homes.lookers), "lookups": r.homes.asked_count,
            "puts_lost": r.puts_lost,
        }  # fmt: skip

    def close(self) -> None:
        if self.membership is not None:  # (first: the others see this node leave now)
            self.membership.close()
        self.links.close()
        self.transfers.close()
