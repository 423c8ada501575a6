"""One broker per node, the same keys everywhere: the links to the other brokers of a cluster
and the messages on them (what the others hold, and the pulls: replicas.py; this node's keys
announced and lent to theirs: lending.py).

Note [cluster]

    broker A (node a)                                   broker B (node b)
    ROUTER at --cluster  <──── DEALER ── hello(b, agent metadata, b's keys)
                         ──── welcome(a, agent metadata, a's keys) ───>  (and beats both ways)
    a put sealed on A  ── key(k, version) ───> every peer: B's index says k lives on a
                          (and keys(all of A's) to a peer as it comes up, in case a put
                          came between A's hello and the peer's welcome)
    client of B: get k ── not listed on B ──> B: lend k? ──> A pins it: lent(version, layout,
                                                              address of its bytes)
                          B allocates a block, NIXL READs the bytes from A's registered
                          memory, seals them as k's replica (A's version), answers the get,
                          and says `returned`: A unpins. From then on B's clients read k
                          from B's directory (microseconds), until a newer version is
                          announced: the replica is dropped (it is a cache, and evictable).
    a small version (at most 64 KiB) goes with its offer in its `key` message: B's first
    get reads it at once, without lend and lent (Note [offers] in offers.py).

ZeroMQ carries only these control messages (msgpack, never pickle); the bytes go through NIXL
(transfers.py). Each direction of a pair talks over the link its sender opened: requests
(hello, beats, lend, returned, key) go out on this broker's DEALER to the peer, answers
(welcome, beat, lent) come back on it. A peer heard from within DOWN_AFTER seconds is up; a
peer that restarts gets this broker's hello again (its DEALER keeps trying; a broker that
gets a message from a link that has not said hello answers `hello_first`) and its keys are
listed again from its welcome. A peer that goes down: its keys raise PeerUnavailable, the
replicas pulled from it stay readable, its loans here are unpinned. A `lent` carries the
lender's agent metadata of now: NIXL learns a peer's registered memory from its metadata
only, and a segment may be newer than the welcome (an arena grows; a broker that restarted
adopts segments after it joined).

Queues across nodes have messages of their own (want, subs, qitem, qtaken, qback, qclose,
qremove, qleft, qhas): Note [queues across nodes] in queue_links.py. Not yet: GPU replicas.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from ..common.errors import BrokerError, InvalidRequest
from .joining import Joining as Joining  # (the broker takes it from here)
from .joining import loopback, tcp_host
from .objects import Objects
from .parking import ParkingLot
from .queue_links import QueueLinks
from .queues import Queues
from .replicas import Replicas
from .transfers import Transfers

log = logging.getLogger(__name__)

BEAT = 0.5  # seconds between beats (and hellos to a peer not up)
DOWN_AFTER = 2.0  # a peer not heard from for this long is down (at most 3 s, says issue 33)
FRESH = DOWN_AFTER - 2 * BEAT  # a peer answered within this long holds this node up (`fresh`)
MAX_MESSAGE = 64 * 2**20  # a peer's message (a welcome lists its keys): at most this


class Watched:
    """The broker's ready items that are not its endpoint's: pidfds, and the cluster's sockets."""

    def __init__(self, *parts: Container[Any]) -> None:
        self.parts = parts

    def __contains__(self, item: object) -> bool:
        return any(item in part for part in self.parts)


@dataclass(slots=True)
class Peer:
    """A broker this one links to at `address`; `node` once it answered."""

    address: str
    socket: zmq.Socket[bytes]
    node: str | None = None
    up: bool = False
    heard: float = 0.0  # when it last answered (monotonic)


def _pack(message: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(message, use_bin_type=True)
    return packed


def _unpack(data: bytes) -> dict[str, Any] | None:
    try:  # (ZeroMQ refused messages over MAX_MESSAGE already)
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # whatever a peer sent that is not msgpack: dropped
        return None
    return message if isinstance(message, dict) and isinstance(message.get("op"), str) else None


class Cluster:
    """The links to the peers (Note [cluster]) and the messages on them; what the peers hold
    and the pulls are `replicas`' (replicas.py). The broker registers `sockets` in its poller,
    calls `ready` for them and `tick` each loop; Objects asks `replicas` about keys not held
    here."""

    def __init__(
        self, joining: Joining, objects: Objects, queues: Queues, lot: ParkingLot,
        transfers: Transfers, poller: zmq.Poller,
    ) -> None:  # fmt: skip
        node, address, keys = joining.node, joining.address, joining.keys
        self.node, self.address, self.transfers, self._keys = node, address, transfers, keys
        self._ctx = zmq.Context()
        self._authenticator: Any = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        if keys is not None:
            keys.apply(self._router)
            if keys.clients is not None:  # ZeroMQ asks this thread about each peer
                from zmq.auth.thread import ThreadAuthenticator

                self._authenticator = ThreadAuthenticator(self._ctx, log=log)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=keys.clients)
        self._router.bind(address)
        self.peers = [self._link(a) for a in joining.peers if a != address]
        self.sockets = {self._router, *(p.socket for p in self.peers)}
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        self._poller = poller
        self.replicas = Replicas(node, objects, lot, transfers, self)
        self.queues = QueueLinks(node, queues, transfers, self, self.replicas.session)
        self._routes: dict[bytes, str] = {}  # a peer's route to this ROUTER -> its node
        self._answered: dict[str, float] = {}  # node -> when this loop last answered its beat
        # A broker's incarnation (new at each start) tells a peer that restarted from one that
        # said hello on a second link, or again.
        self.incarnation = int.from_bytes(os.urandom(8), "big") >> 1
        self._incarnations: dict[str, int] = {}  # node -> its incarnation, as last heard
        self._next_beat = 0.0

    @classmethod
    def join(cls, joining: Joining, queues: Queues, shm_dir: str, poller: zmq.Poller) -> Cluster:
        """This broker in a cluster: its NIXL agent, its links, and Objects and Queues told."""
        transfers = Transfers(joining.node, shm_dir)
        objects = queues.objects
        cluster = cls(joining, objects, queues, queues.lot, transfers, poller)
        for segment in objects.registry.arena.segments:
            transfers.register(segment)
        objects.elsewhere, queues.elsewhere = cluster.replicas, cluster.queues
        return cluster

    def _link(self, address: str) -> Peer:
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a peer not connected
        if self._keys is not None:  # the pair every broker of the cluster serves
            socket.curve_serverkey = self._keys.public
            socket.curve_publickey = self._keys.public
            socket.curve_secretkey = self._keys.secret
        socket.connect(address)
        return Peer(address, socket)

    def segment(self, name: str) -> None:
        """A new arena segment: registered with NIXL now, not per transfer, and the peers
        given this agent's metadata of now (an offer sent with an announcement, Note [offers]
        in offers.py, may lie in it; this message goes before any such on each link)."""
        self.transfers.register(name)
        self.everyone({"op": "agent", "agent": self.transfers.metadata})

    @property
    def wake_in(self) -> float:
        """Seconds until the loop must look again: reads under way are polled (Replicas)."""
        return min(self.replicas.poll_in, self.queues.poll_in, BEAT)

    # -- the loop ------------------------------------------------------------------------------

    def ready(self, socket: Any) -> None:
        """Read what `socket` (one of `sockets`) has. A fault here is logged: a peer's
        message must never take the broker down."""
        try:
            self._read(socket)
        except Exception:
            log.exception("cluster: a message could not be handled")

    def _read(self, socket: Any) -> None:
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = socket.recv_multipart()
            if socket is self._router:
                message = _unpack(frames[1]) if len(frames) == 2 else None
                if message is not None:
                    self._request(frames[0], message)
                continue
            message = _unpack(frames[0]) if len(frames) == 1 else None
            peer = next((p for p in self.peers if p.socket is socket), None)
            if message is not None and peer is not None:
                self._answer(peer, message)

    def tick(self, now: float) -> None:
        """Beats and hellos, peers gone quiet, and reads that ended."""
        try:
            if now >= self._next_beat:
                self._next_beat = now + BEAT
                for peer in self.peers:
                    if peer.up and now - peer.heard > DOWN_AFTER:
                        self._down(peer)
                    beat = {"op": "beat"}
                    self._send(peer, beat if peer.up else self._hello(lost=peer.node is not None))
                self.queues.beat()
            self.replicas.poll(now)
            self.queues.poll()
        except Exception:
            log.exception("cluster: the beat or a pull failed")

    def flush(self) -> None:
        """Send what the loop's batch left for after its replies (announcements, loans and
        offers given back): off the path of the replies."""
        try:
            self.replicas.flush()
        except Exception:
            log.exception("cluster: the announcements could not be sent")

    # -- requests from peers (on the ROUTER) --------------------------------------------------

    def _request(self, route: bytes, m: dict[str, Any]) -> None:
        op, replicas = m["op"], self.replicas
        try:
            if op == "hello":
                node = str(m["node"])
                self.transfers.add_peer(node, bytes(m["agent"]))
                same = self._same(node, m)
                if m.get("lost", True) or not same:  # restarted, or took this one for down:
                    self._forget_node(node)  # its loans, offers and routes before go
                self._routes[route] = node
                self._reply(route, self._hello("welcome"))
                self._answered[node] = time.monotonic()
                self._meet(str(m.get("address", "")))
                return
            node = self._routes.get(route, "")
            if not node:  # this broker restarted (or forgot the peer): say hello first
                first: dict[str, Any] = {"op": "hello_first"}
                if op == "key" and isinstance(m.get("offer"), dict):  # not kept: not pinned
                    first["unoffered"] = [[m["key"], m["version"]]]
                elif op == "lend":  # asked again after the hello, else its get waits it out
                    first["again"] = {k: m[k] for k in ("op", "pull", "key", "direct") if k in m}
                self._reply(route, first)
            elif op == "beat":
                self._reply(route, {"op": "beat"})
                self._answered[node] = time.monotonic()
            elif op == "key":
                offer = m.get("offer")
                offer = offer if isinstance(offer, dict) else None
                replicas.listed(node, str(m["key"]), int(m["version"]), int(m["size"]), offer)
            elif op == "offers_back":
                replicas.lending.offers_back(node, m["offers"])
            elif op == "offer_read":
                replicas.lending.offer_read(node, str(m["key"]), int(m["version"]))
            elif op == "agent":
                self.transfers.add_peer(node, bytes(m["agent"]))
            elif op == "keys":
                replicas.welcome(node, m["keys"])
            elif op == "lend":
                direct = bool(m.get("direct"))
                replicas.lending.lend(node, int(m["pull"]), str(m["key"]), direct)
            elif op == "returned":
                replicas.lending.returned(node, int(m["pull"]))
            elif op == "delete":
                replicas.deleted(node, str(m["key"]))
            elif op.startswith("q") or op in ("want", "subs"):
                self._queue_request(node, op, m)
        except (KeyError, TypeError, ValueError, BrokerError) as exc:
            log.warning("a cluster message %r from %r could not be used: %s", op, route, exc)

    def _queue_request(self, node: str, op: str, m: dict[str, Any]) -> None:
        """The messages of queues across nodes (Note [queues across nodes])."""
        links, name = self.queues, str(m.get("queue", ""))
        if op in ("want", "subs"):
            links.want(node, name, int(m["n"]), op)
        elif op == "qitem":
            links.arrivals.arrived(node, m)
        elif op == "qtaken":
            links.taken(node, int(m["loan"]))
        elif op == "qback":
            links.back(node, int(m["loan"]))
        elif op == "qclose":
            links.close_from(node, name)
        elif op == "qremove":
            q = links.queues.by_name.get(name)
            if q is not None:
                links.queues.remove_part(q)
        elif op == "qleft":
            links.left(node, name)
        elif op == "qhas":
            links.has(node, name, int(m["left"]))

    def _hello(self, op: str = "hello", lost: bool = False) -> dict[str, Any]:
        """This broker, its address, its agent, and the keys it holds (not its replicas);
        `lost`: on a link that knew its peer (which must then forget what it lent it)."""
        agent, keys = self.transfers.metadata, self.replicas.own()
        return {
            "op": op, "node": self.node, "address": self.address, "agent": agent, "keys": keys,
            "incarnation": self.incarnation, "lost": lost,
        }  # fmt: skip

    def _same(self, node: str, m: dict[str, Any]) -> bool:
        """Whether `node`'s hello or welcome `m` comes from the broker heard before (not one
        that restarted since): then what it lent or offered this one still holds."""
        incarnation, known = m.get("incarnation"), self._incarnations.get(node)
        if isinstance(incarnation, int):
            self._incarnations[node] = incarnation
        return known is not None and known == incarnation

    def _meet(self, address: str) -> None:
        """A broker said hello from `address`: link to it too, if this one has no link there
        (it joined later than this broker's --peers were resolved: a new node, say)."""
        if address == self.address or any(p.address == address for p in self.peers):
            return
        try:
            host = tcp_host(address, "a peer's address")
        except InvalidRequest:
            return
        if self._keys is None and not loopback(host):
            return  # without keys, loopback only
        peer = self._link(address)
        self.peers.append(peer)
        self.sockets.add(peer.socket)
        self._poller.register(peer.socket, zmq.POLLIN)
        log.info("cluster: a broker at %s joined; linked to it", address)

    def _forget_node(self, node: str) -> None:
        """Unpin what `node` was lent (it will not return it), and forget its route."""
        self.replicas.let_go(node)
        self.queues.let_go(node)
        for route in [r for r, n in self._routes.items() if n == node]:
            del self._routes[route]

    # -- answers from peers (on our DEALERs) ---------------------------------------------------

    def _answer(self, peer: Peer, m: dict[str, Any]) -> None:
        peer.heard = time.monotonic()
        op = m["op"]
        try:
            if op == "welcome":
                node = str(m["node"])
                self.transfers.add_peer(node, bytes(m["agent"]))
                heard = node in self._incarnations
                if not self._same(node, m) and heard:  # it restarted, and said so here first
                    self._forget_node(node)
                peer.node, peer.up = node, True
                self.replicas.welcome(node, m["keys"])
                # What this node holds now, again: a put sealed while the peer was not up
                # yet here was announced to the others only (its hello went before it).
                self._send(peer, {"op": "keys", "keys": self.replicas.own()})
                self.queues.node_up(node)
                log.info("cluster: node %r at %s is up", node, peer.address)
            elif op == "hello_first":
                if peer.node is not None and m.get("unoffered"):  # an announcement it dropped
                    self.replicas.lending.offers_back(peer.node, m["unoffered"])
                self._send(peer, self._hello(lost=True))
                if isinstance(m.get("again"), dict) and m["again"].get("op") == "lend":
                    self._send(peer, m["again"])  # (after the hello, on the same link)
            elif op == "lent":
                self.replicas.lent(m)
        except (KeyError, TypeError, ValueError, BrokerError, OSError) as exc:
            log.warning("a cluster answer %r from %s could not be used: %s", op, peer.address, exc)

    def _down(self, peer: Peer) -> None:
        peer.up = False
        log.warning("cluster: node %r at %s is down", peer.node, peer.address)
        if peer.node is not None:
            self.replicas.node_down(peer.node)
            self.queues.node_down(peer.node)
            self._forget_node(peer.node)

    # -- sending (the Links of replicas.py) ------------------------------------------------------

    def up(self, node: str) -> bool:
        peer = self._peer(node)
        return peer is not None and peer.up

    def fresh(self, node: str) -> bool:
        """Whether `node` surely holds this node up: this loop answered its beat (or hello)
        within FRESH seconds. A node takes a peer whose answers stopped DOWN_AFTER ago for
        down, and lets go what it offered it (Note [offers]): a broker whose loop stalled that
        long (a long pause, say) must not read from those offers before it hears again."""
        answered = self._answered.get(node)
        return answered is not None and time.monotonic() - answered < FRESH and self.up(node)

    def send(self, node: str, message: dict[str, Any]) -> bool:
        peer = self._peer(node)
        return peer is not None and self._send(peer, message)

    def answer(self, node: str, message: dict[str, Any]) -> None:
        """Answer a request of `node`'s (on the link it opened to this broker)."""
        route = next((r for r, n in self._routes.items() if n == node), None)
        if route is not None:
            self._reply(route, message)

    def everyone(self, message: dict[str, Any]) -> None:
        for peer in self.peers:
            if peer.up:
                self._send(peer, message)

    def nodes(self) -> list[str]:
        """The peers' node names (those that answered once)."""
        return list(dict.fromkeys(p.node for p in self.peers if p.node is not None))

    def _peer(self, node: str) -> Peer | None:
        return next((p for p in self.peers if p.node == node), None)

    def _send(self, peer: Peer, message: dict[str, Any]) -> bool:
        try:
            peer.socket.send(_pack(message), zmq.NOBLOCK)
        except zmq.Again:  # not connected (IMMEDIATE), or its queue is full: beats retry
            return False
        return True

    def _reply(self, route: bytes, message: dict[str, Any]) -> None:
        try:
            self._router.send_multipart([route, _pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("a cluster reply to %r was dropped: %s", self._routes.get(route), exc)

    # -- seeing it -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        now, index, r = time.monotonic(), self.replicas.index, self.replicas
        peers = {
            (p.node or p.address): {
                "address": p.address,
                "state": "up" if p.up else "down",
                "heard_s_ago": round(now - p.heard, 3) if p.heard else None,
                "keys": sum(1 for k in index.values() if k.node == p.node),
            }  # fmt: skip
            for p in self.peers
        }
        return {
            "node": self.node, "address": self.address, "peers": peers,
            "bytes_sent": r.lending.bytes_sent + self.queues.bytes_sent,
            "bytes_received": r.bytes_received + self.queues.bytes_received,
            "pulls": len(r.pulls), "loans": len(r.lending.loans),
            "items_lent": len(self.queues.loans),
            "offered": len(r.lending.offered), "offers_held": len(r.held),
            "pulled": dict(r.pulled),
        }  # fmt: skip

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()
        self.transfers.close()
