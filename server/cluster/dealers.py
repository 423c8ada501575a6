"""The DEALER to each peer of a cluster (Note [cluster] in cluster.py), where its answers come
back, all polled through one epoll descriptor (`fd`). ZeroMQ's poll looks at each of its
sockets at each call: about 1 us a socket, so with a DEALER a peer each loop turn cost 33 us
at 16 peers and 750 us at 1,000 (measured here), and every message from a peer is a turn.
An epoll of their ZeroMQ descriptors costs a turn the same whatever their number.

A DEALER's ZeroMQ descriptor says only that something may have changed: its messages are
read while ZMQ_EVENTS says there are (which takes in the signal), and a send on it, which
may take in the signal of an answer, looks too (`unread`: read in the same turn,
Cluster.tick), else that answer would wait for the next. So every send and read on a DEALER
goes through this class. (Each beat is a send to each peer in use, and a hello one to each
peer that is not up: a signal missed all the same is found within a beat, or at the next
send on that link.)"""

from __future__ import annotations

import os
import select
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from ...common.curve import ServerKeys

MAX_MESSAGE = 64 * 2**20  # a peer's message (a welcome lists its keys): at most this


@dataclass(slots=True)
class Peer:
    """A broker this one links to at `address`; `node` once it answered."""

    address: str
    socket: zmq.Socket[bytes]
    fd: int  # its ZeroMQ descriptor, in Dealers' epoll
    node: str | None = None
    up: bool = False
    heard: float = 0.0  # when it last answered, or was left alone (monotonic: Note [beats])
    sent: int = 0  # requests sent on it since its last hello (a beat says: Links.tally)
    checked: int = 0  # of those, how many a beat's answer said came (Links.beaten)
    beat_t: float = 0.0  # when its last beat went (monotonic), and `sent` then
    beat_n: int = 0
    answered: bool = True  # whether that beat was answered (not yet: after a hello or a
    # send the link did not take)
    tried: float = 0.0  # when a beat last was to go, sent or not (Beats.freshen)


def readable(socket: Any) -> bool:
    """Whether ZeroMQ holds a message for `socket` (taking in what signalled it)."""
    return bool(socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)


class Dealers:
    """The peers' DEALERs, made in `ctx` (with the cluster's CURVE `keys`, if it has them)."""

    def __init__(self, ctx: zmq.Context[Any], keys: ServerKeys | None) -> None:
        self._ctx, self._keys = ctx, keys
        self._epoll = select.epoll()
        self.fd = self._epoll.fileno()
        self._by_fd: dict[int, Peer] = {}
        self.unread: set[int] = set()  # DEALERs a send found with messages to read

    def link(self, address: str) -> Peer:
        """A DEALER connected to the peer at `address`."""
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a peer not connected
        # Its route at the peer, the same after a reconnect: what it sends then is still
        # this broker's (a new route is unknown there until a hello: its messages dropped).
        socket.setsockopt(zmq.ROUTING_ID, b"tb" + os.urandom(8))
        if self._keys is not None:  # the pair every broker of the cluster serves
            socket.curve_serverkey = self._keys.public
            socket.curve_publickey = self._keys.public
            socket.curve_secretkey = self._keys.secret
        socket.connect(address)
        peer = Peer(address, socket, int(socket.getsockopt(zmq.FD)))
        self._by_fd[peer.fd] = peer
        self._epoll.register(peer.fd, select.EPOLLIN)
        return peer

    def read(self) -> Iterator[tuple[Peer, list[bytes]]]:
        """The messages of the DEALERs the epoll names and of those `unread`. A DEALER not
        read to its end (its reader stopped: a fault handling a message) is `unread` again:
        its signal was taken in, and it would not come again."""
        ready, self.unread = self.unread, set()
        ready.update(fd for fd, _ in self._epoll.poll(0))
        left = list(ready)
        try:
            while left:
                peer = self._by_fd.get(left[-1])
                while peer is not None and readable(peer.socket):
                    yield peer, peer.socket.recv_multipart()
                    peer = self._by_fd.get(left[-1])  # (None once dropped meanwhile)
                left.pop()
        finally:
            self.unread.update(fd for fd in left if fd in self._by_fd)

    def send(self, peer: Peer, data: bytes) -> bool:
        """Send `data` to `peer`: False if ZeroMQ would not take it (not connected:
        IMMEDIATE; or its queue is full)."""
        try:
            peer.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        finally:  # (the send may have taken in the signal of an answer: the docstring)
            if readable(peer.socket):
                self.unread.add(peer.fd)
        return True

    def drop(self, peer: Peer) -> None:
        self._epoll.unregister(peer.fd)
        del self._by_fd[peer.fd]
        self.unread.discard(peer.fd)
        peer.socket.close(0)

    def close(self) -> None:
        self._epoll.close()
