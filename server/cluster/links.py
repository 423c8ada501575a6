"""The links between the brokers of a cluster (Note [cluster] in cluster.py): this broker's
ROUTER, where the peers' requests come in, and a DEALER to each peer, where their answers
come back (dealers.py); which peers are up, the routes back to each, and sending. ZeroMQ
carries msgpack only, never pickle. What the messages mean is cluster.py's."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq

from ...common.errors import InvalidRequest
from .beats import Beats
from .dealers import MAX_MESSAGE, Dealers, Peer, readable
from .joining import Joining, loopback, tcp_host

log = logging.getLogger(__name__)

Message = dict[str, Any] | Callable[[], dict[str, Any]]  # (`after`: made as it is sent)


def _pack(message: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(message, use_bin_type=True)
    return packed


def _unpack(data: bytes) -> dict[str, Any] | None:
    try:  # (ZeroMQ refused messages over MAX_MESSAGE already)
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # whatever a peer sent that is not msgpack: dropped
        return None
    return message if isinstance(message, dict) and isinstance(message.get("op"), str) else None


class Links(Beats):
    """The sockets to the peers (the broker registers `sockets` in its poller), and what is
    known of each node: its routes to this ROUTER, its incarnation, how often each of the two
    forgot the other; and what the beats tell (Beats: Note [beats] in beats.py). The Links
    of pulls.py."""

    def __init__(self, joining: Joining, poller: zmq.Poller) -> None:
        super().__init__(bool(joining.etcd))
        self.address, self._keys = joining.address, joining.keys
        self._ctx = zmq.Context()  # (a DEALER a peer: more than ZeroMQ's default 1,023)
        self._ctx.set(zmq.MAX_SOCKETS, self._ctx.get(zmq.SOCKET_LIMIT))
        self._authenticator: Any = None
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a dead route raises: `answer`
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a link that reconnected: its route
        keys = joining.keys
        if keys is not None:
            keys.apply(self.router)
            if keys.clients is not None:  # ZeroMQ asks this thread about each peer
                from zmq.auth.thread import ThreadAuthenticator

                self._authenticator = ThreadAuthenticator(self._ctx, log=log)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=keys.clients)
        self.router.bind(self.address)
        self.dealers = Dealers(self._ctx, keys)
        self.fd = self.dealers.fd  # (all the DEALERs: dealers.py)
        self.peers = [self.dealers.link(a) for a in joining.peers if a != self.address]
        self.sockets = {self.router, self.fd}
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        self.routes: dict[bytes, str] = {}  # a peer's route to this ROUTER -> its node
        # (node -> its routes, the newest last; its links: each found in O(1) at a send)
        self._routes_of: dict[str, list[bytes]] = {}
        self._links_of: dict[str, list[Peer]] = {}
        # A broker's incarnation (new at each start, and larger than its last one's: the
        # microseconds since the epoch, then random bits) tells a peer that restarted from one
        # that said hello on a second link, or again, and its late messages from the new
        # one's. `forgot` counts the times this broker forgot a node (took it for down, or
        # found it restarted), and `seen_forgot` the times the node said it forgot this one:
        # each time, this one forgets it too, once.
        micros, noise = time.time_ns() // 1000, int.from_bytes(os.urandom(2), "big") >> 6
        self.incarnation = micros << 10 | noise
        self._incarnations: dict[str, int] = {}  # node -> its incarnation, as last heard
        # Told of a node heard from as a newer incarnation (`same`): Transfers.restarted.
        self.restarts: Callable[[str], None] = lambda node: None
        self.forgot: dict[str, int] = {}
        self.seen_forgot: dict[str, int] = {}
        self._after: list[tuple[str, Message]] = []  # (node, message): `after`
        self.refused: set[str] = set()  # brokers of another PROTOCOL, logged (joining.py)
        self._kept: list[tuple[str, Message]] = []  # refused at a flush: next one

    def follow(self, last: Any) -> int:
        """This broker took over the state of one whose incarnation was `last`: its own is
        larger, also if the clock went back since (its peers would ignore it). Returned,
        to be journaled."""
        if isinstance(last, int):
            self.incarnation = max(self.incarnation, last + 1)
        return self.incarnation

    def meet(self, address: str) -> None:
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
        self.peers.append(self.dealers.link(address))
        log.info("cluster: a broker at %s joined; linked to it", address)

    def read(self, item: Any) -> Iterator[tuple[bytes | None, Peer | None, dict[str, Any]]]:
        """The messages `item` has: (route, None, request) off the ROUTER, (None, peer,
        answer) off the DEALERs (item `fd`); what is not msgpack with an op is dropped."""
        if item is not self.router:
            for peer, frames in self.dealers.read():
                message = _unpack(frames[0]) if len(frames) == 1 else None
                if message is not None:
                    yield None, peer, message
            return
        while readable(item):
            frames = item.recv_multipart()
            message = _unpack(frames[1]) if len(frames) == 2 else None
            if message is not None:
                yield frames[0], None, message

    @property
    def unread(self) -> bool:
        """Whether a send found answers to read (Cluster.tick reads them: dealers.py)."""
        return bool(self.dealers.unread)

    def same(self, node: str, m: dict[str, Any]) -> bool | None:
        """Whether `node`'s hello, welcome or beat `m` comes from the broker heard before
        (not one that restarted since) and that did not forget this one since: then what it
        lent or offered this one still holds. Else (False) this one must forget it too. None:
        `m` comes from an older incarnation than one heard already (late, off a dead link):
        it is to be ignored."""
        incarnation, known = m.get("incarnation"), self._incarnations.get(node)
        if isinstance(incarnation, int) and known is not None and incarnation < known:
            return None
        forgot = m.get("forgot", 0) if isinstance(m.get("forgot", 0), int) else 0
        if isinstance(incarnation, int) and known is not None and incarnation > known:
            self.restarts(node)
        same = known is not None and known == incarnation
        if isinstance(incarnation, int):
            self._incarnations[node] = incarnation
        if not same:
            self.seen_forgot[node] = forgot
            return False
        if forgot > self.seen_forgot.get(node, 0):
            self.seen_forgot[node] = forgot
            return False
        return True

    def restarted(self, node: str, incarnation: Any) -> bool:
        """Whether `incarnation` (`node`'s entry in etcd says) is newer than the one heard."""
        known = self._incarnations.get(node)
        return isinstance(incarnation, int) and known is not None and incarnation > known

    def older(self, node: str, incarnation: Any) -> bool:
        """Whether `incarnation` is older than the one of `node`'s heard already."""
        known = self._incarnations.get(node)
        return isinstance(incarnation, int) and known is not None and incarnation < known

    def ack(self, node: str) -> dict[str, Any]:
        """What a message that pins something for `node` (an offer, a loan, a queue item)
        says, for `acked` there: how often this broker knows that node forgot it (`ack`),
        and the incarnation of the node it knows (`to`)."""
        return {"ack": self.seen_forgot.get(node, 0), "to": self._incarnations.get(node)}

    def acked(self, node: str, m: dict[str, Any]) -> bool:
        """Whether `node` sent `m` (an offer or a loan) to this broker's incarnation (not to
        one it replaced: it lets that one's go once it hears of this one) knowing every time
        this broker forgot it (`ack`: its seen_forgot of this one; if not, it forgets this
        one once it knows, and lets go what `m` pinned). Else `m` must not be read."""
        ack = m.get("ack", 0)
        return (
            m.get("to") == self.incarnation
            and isinstance(ack, int)
            and ack >= self.forgot.get(node, 0)
        )

    def forgetting(self, node: str) -> None:
        """This broker forgets `node` (took it for down, or found it restarted): its next
        messages say so, and the node forgets this one once."""
        self.forgot[node] = self.forgot.get(node, 0) + 1
        self._safe_until.pop(node, None)

    def heard_of(self, node: str) -> bool:
        return node in self._incarnations

    def forget_routes(self, node: str) -> None:
        """`node` is forgotten: its routes go, and what waits to be sent to it (it let go
        what those messages name, or will)."""
        self._after = [(n, m) for n, m in self._after if n != node]
        self._kept = [(n, m) for n, m in self._kept if n != node]
        for route in self._routes_of.pop(node, ()):
            del self.routes[route]
            self._heard.pop(route, None)  # (counted again from its next hello: `tally`)

    # -- what the rooms ask (the Links of replicas.py) --------------------------------------------

    def up(self, node: str) -> bool:
        peer = self.peer(node)
        return peer is not None and peer.up

    def send(self, node: str, message: dict[str, Any]) -> bool:
        """Send request `message` to `node`: behind a beat if its promise ran out (Note
        [beats]: its answer, before the request's, makes the node fresh again)."""
        peer = self.peer(node)
        if peer is None:
            return False
        self.beat_first(node, peer)
        return self.send_to(peer, message)

    def after(self, node: str, message: Message) -> None:
        """Send `message` to `node` at the loop's `flush`, after its replies, once the journal
        has what the loop's batch changed (a peer must not act on a change that a crash of
        this broker would undo: an item said taken, its lender frees it). In order; kept
        while its link reconnects and the node is up; dropped once it is forgotten. A
        callable is made into the message as it is sent (one naming this broker's agent
        metadata must name it as of then: a segment made meanwhile sent newer at once)."""
        self._after.append((node, message))

    def everyone_after(self, message: dict[str, Any]) -> None:
        """`after`, to each node up."""
        for node in self.nodes():
            if self.up(node):
                self._after.append((node, message))

    @property
    def holding(self) -> bool:
        """Whether messages wait for the next `flush` (not those kept after a refusal: the
        beats try again)."""
        return bool(self._after)

    def flush(self) -> None:
        """Send what `after` holds. Once a node's link refuses one, the rest for it are kept
        too (in order) for the next flush."""
        if not self._after and not self._kept:  # (every turn of the loop)
            return
        held, self._after, self._kept = self._kept + self._after, [], []
        refused: set[str] = set()
        for node, message in held:
            made = message() if callable(message) else message
            if node not in refused and self.send(node, made):
                continue
            refused.add(node)
            if self.up(node):
                self._kept.append((node, message))

    def route(self, route: bytes, node: str) -> None:
        """`node` said hello on `route`: the newest of its routes (answers go there first)."""
        was = self.routes.pop(route, None)
        if was is not None:
            self._routes_of[was].remove(route)
        self.routes[route] = node
        self._routes_of.setdefault(node, []).append(route)

    def answer(self, node: str, message: dict[str, Any]) -> bool:
        """Answer a request of `node`'s, on the newest link it opened to this broker that
        is still there (a link that reconnected has a new route; the old one is dropped).
        False if none was (it is forgotten, say)."""
        for route in reversed(self._routes_of.get(node, [])[:]):
            try:
                self.router.send_multipart([route, _pack(message)], zmq.NOBLOCK)
                return True
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    log.warning("a cluster answer to %r was dropped: %s", node, exc)
                    return False
                del self.routes[route]
                self._routes_of[node].remove(route)
        return False

    def everyone(self, message: dict[str, Any]) -> None:
        for peer in self.peers:
            if peer.up:
                self.send_to(peer, message)

    def nodes(self) -> list[str]:
        """The peers' node names (those that answered once), each once."""
        return list(dict.fromkeys(p.node for p in self.peers if p.node is not None))

    def peer(self, node: str) -> Peer | None:
        """A link to `node`: one that is up, if one is."""
        links = self._links_of.get(node, ())
        return next((p for p in links if p.up), links[0] if links else None)

    def send_to(self, peer: Peer, message: dict[str, Any]) -> bool:
        sent, hello = self.dealers.send(peer, _pack(message)), message["op"] == "hello"
        if sent and not hello:
            peer.sent += 1
            return True
        if sent:  # (counted from the hello: Beats.tally)
            peer.sent = peer.checked = 0
        # A hello, or a send the link did not take: the link is in use until a beat after it
        # is answered (an idle link would not hear that either was lost: Note [beats]).
        peer.answered, peer.beat_t = False, 0.0
        return sent

    def reply(self, route: bytes, message: dict[str, Any]) -> None:
        try:
            self.router.send_multipart([route, _pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("a cluster reply to %r was dropped: %s", self.routes.get(route), exc)

    def named(self, peer: Peer, node: str) -> None:
        """`peer` is a link to `node` (its welcome said)."""
        if peer.node == node:
            return
        if peer.node is not None:
            self._links_of[peer.node].remove(peer)
        peer.node = node
        self._links_of.setdefault(node, []).append(peer)

    def unlink(self, peer: Peer) -> None:
        """Drop the link to `peer` (an address its node no longer has)."""
        if peer.node is not None:
            self._links_of[peer.node].remove(peer)
        self.dealers.drop(peer)
        self.peers.remove(peer)
        log.info("cluster: node %r left %s; unlinked", peer.node, peer.address)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long the answers still queued may take to go."""
        for peer in self.peers:
            self.dealers.drop(peer)
        self.dealers.close()
        self.router.close(linger_ms)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.term()
