"""Who is in the cluster, kept in etcd (`serve --etcd`; Note [membership]).

Note [membership]

Each broker puts `{prefix}/members/{node}` = {"address": its --cluster address,
"incarnation": ...} (JSON) under a lease of TTL seconds, renews the lease every TTL/3 seconds,
and watches `{prefix}/members/`. It puts its entry only where none is (one transaction), or
over its own (the same address: it restarted in place); an entry at another address is
waited for to go (a broker restarted elsewhere), then the broker refuses to start (NodeTaken:
two brokers with one --node would take each other's place).

A put there is a broker that joined or restarted: this one links to its address
(Links.meet) and the hello/welcome of Note [cluster] follows. A delete is a broker that
stopped (its lease revoked) or died (its lease expired, within TTL plus etcd's half-second
check): it is down at once here, as if its beats had stopped. A broker started on a --peers
list joins the same way, and brokers never configure each other's addresses.

A starting broker waits up to START_WAIT seconds for an etcd that is there but slow (or has
no leader yet); one where no member listens at all does not start. The calls to etcd then
run on two threads of their own (the lease's, the watch's): the broker's loop never waits
for etcd. What they see goes into `events`, and a byte into a pipe the loop polls (`fd`). A
lease that expired while etcd was out of reach (the other brokers took this one for down) is
granted again and the entry put again: they link to it anew. Several
clusters share one etcd under prefixes of their own (--etcd-prefix)."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
from collections import deque
from typing import Any, NamedTuple

from ...common.errors import InvalidRequest
from .etcd import TIMEOUT, Etcd, EtcdUnavailable

log = logging.getLogger(__name__)

TTL = 3  # seconds: a broker that died is gone from etcd this long after its last renewal
START_WAIT = 10.0  # seconds a starting broker waits for an etcd that is there but slow
LEASE_MARGIN = 0.5  # seconds: a lease renewed at t is taken to run until t + TTL less this


class NodeTaken(InvalidRequest):
    """Another broker serves this --node (its entry in etcd, at another address, stays)."""


class Member(NamedTuple):
    """A change in the cluster: `node` joined or restarted (`record`: its address and
    incarnation), or left (record None)."""

    node: str
    record: dict[str, Any] | None


class Membership:
    """This broker's entry in etcd, and the others' as they change (Note [membership])."""

    def __init__(
        self, urls: tuple[str, ...], prefix: str, node: str, record: dict[str, Any],
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        """`tls`: how etcd is reached over https (etcd.tls)."""
        self.urls, self.tls, self.node, self.address = urls, tls, node, record.get("address")
        self.prefix = f"{prefix.rstrip('/')}/members/".encode()
        self._key, self.record = self.prefix + node.encode(), record
        self.events: deque[Member] = deque()
        self.fd, self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._streams: list[socket.socket] = []  # the watch's, shut to end it
        self._lease = 0
        self.alive_until = 0.0  # (monotonic) this broker's lease surely runs until then
        self.registration = 0  # its entries put (in `registration`: a peer says which it saw)
        self._watching = ""  # the member the watch's stream is on
        self._present: set[str] = set()  # the other nodes in etcd (the watch's thread's)
        self._threads: list[threading.Thread] = []

    def _etcd(self, timeout: float = TIMEOUT, first: int = 0) -> Etcd:
        """A client of this cluster's etcd (one per thread: Etcd)."""
        return Etcd(self.urls, timeout, first, self.tls)

    def start(self) -> None:
        """Put this broker's entry (EtcdUnavailable if no etcd answers: the broker does not
        start), then keep it and watch the others' on threads of their own."""
        etcd = self._etcd()
        deadline, said = time.monotonic() + START_WAIT, False
        while True:  # (an etcd that answers slowly, or has no leader yet, is waited for)
            try:
                self._register(etcd)
                break
            except EtcdUnavailable as exc:
                if exc.refused or time.monotonic() > deadline:
                    raise
                if not said:
                    log.warning("cluster: %s; trying again for %.0f s", exc, START_WAIT)
                said = True
                time.sleep(0.2)
        self._start(self._keep, etcd.first)  # (at once: the lease runs from its grant)
        revision, members = etcd.range(self.prefix)
        for key, value in members.items():
            self._seen(key, value)
        self._start(self._watch, revision + 1)

    def _start(self, target: Any, arg: int) -> None:
        thread = threading.Thread(target=target, args=(arg,), name="etcd", daemon=True)
        thread.start()
        self._threads.append(thread)

    def take(self) -> list[Member]:
        """What changed since the last call (the loop's, when `fd` is readable)."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        taken = []
        while self.events:
            taken.append(self.events.popleft())
        return taken

    def close(self) -> None:
        """Leave the cluster: the entry goes at once (the others see this broker down now,
        not TTL seconds from now), and the threads end."""
        self._stop.set()
        self._end_streams()
        if self._lease:
            try:
                self._etcd().revoke(self._lease)
            except EtcdUnavailable as exc:  # (it expires by itself)
                log.warning("could not leave the cluster's etcd at once: %s", exc)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if not any(thread.is_alive() for thread in self._threads):  # (else theirs to write to)
            os.close(self.fd)
            os.close(self._wake)

    # -- the threads ---------------------------------------------------------------------------

    def _register(self, etcd: Etcd) -> None:
        """A new lease, and the entry put under it (the lease kept only once the put went).
        An entry of this node at another address (a broker restarted elsewhere, its old
        lease not expired yet) is waited for to go, up to TTL + 1 s; NodeTaken if it stays
        (another broker serves this --node and renews it)."""
        asked, registration = time.monotonic(), self.registration + 1
        value = json.dumps({**self.record, "registration": registration}).encode()
        lease = etcd.grant(TTL)
        deadline = time.monotonic() + TTL + 1.0
        while True:
            found = etcd.put_new(self._key, value, lease)
            if found is None:
                break
            try:
                there = json.loads(found).get("address") if found else None
            except (ValueError, AttributeError):
                there = None
            if found and (there == self.address or there is None):  # (restarted in place)
                etcd.put(self._key, value, lease)
                break
            if time.monotonic() > deadline:
                raise NodeTaken(
                    f"node {self.node!r} is already in the cluster, served at {there} (its "
                    "broker renews its entry in etcd): give this broker another --node, or "
                    "stop that one"
                )
            time.sleep(0.2)
        self._lease, self.registration = lease, registration
        self.alive_until = asked + TTL - LEASE_MARGIN

    def _keep(self, first: int) -> None:
        """Renew the lease every TTL/3 seconds, each call given TTL/3 seconds a member (then
        the next is tried); one that expired (etcd out of reach that long: the others took
        this broker for down) is granted again, and the entry put. A watch on a member that
        does not answer is ended: it goes on on another."""
        etcd, unreachable = self._etcd(timeout=TTL / 3, first=first), False
        while not self._stop.wait(TTL / 3):
            try:
                asked = time.monotonic()
                if etcd.keep_alive(self._lease):
                    self.alive_until = asked + TTL - LEASE_MARGIN
                elif not self._stop.is_set():
                    log.warning("cluster: this broker's lease in etcd expired; joining again")
                    self._register(etcd)
                    self._tell(Member(self.node, None))  # (the others took it for down)
                if unreachable:
                    log.warning("cluster: etcd answers again")
                unreachable = False
            except NodeTaken as exc:  # (its lease expired, and another broker took the name)
                log.error("cluster: %s", exc)
            except EtcdUnavailable as exc:
                if not unreachable:
                    log.warning("cluster: %s; trying again", exc)
                unreachable = True
            if etcd.failed & {self._watching}:
                self._end_streams()

    def _end_streams(self) -> None:
        for stream in list(self._streams):
            try:  # (the socket's own shutdown: an SSLSocket's drops its TLS state, which
                # the watch's thread may be reading with)
                socket.socket.shutdown(stream, socket.SHUT_RDWR)
            except OSError:
                pass

    def _watch(self, revision: int) -> None:
        """Follow the changes of the members from `revision` on; after a stream ended (its
        endpoint went away), read them all again from another endpoint and go on from there
        (said once an outage, not at each try)."""
        turn, quiet = 0, False
        while not self._stop.is_set():
            url = self._watching = self.urls[turn % len(self.urls)]
            try:
                for key, value, seen in self._etcd().watch(
                    url, self.prefix, revision, self._streams, self._stop
                ):
                    self._seen(key, value)
                    revision, quiet = seen + 1, False
            except (OSError, ValueError, KeyError) as exc:
                if self._stop.is_set():
                    return
                if not quiet:
                    log.warning("cluster: the watch of etcd at %s ended (%s); again", url, exc)
                quiet = True
            self._streams.clear()
            turn += 1
            if self._stop.wait(0.2):
                return
            try:  # (the changes missed meanwhile: those still there, and those gone)
                revision, members = self._etcd().range(self.prefix)
            except EtcdUnavailable:
                continue
            gone = self._present - {k[len(self.prefix) :].decode() for k in members}
            for key, value in members.items():
                self._seen(key, value)
            for node in gone:
                self._seen(self.prefix + node.encode(), None)
            revision += 1

    def _seen(self, key: bytes, value: bytes | None) -> None:
        node = key[len(self.prefix) :].decode(errors="replace")
        if node == self.node:
            return
        record = None
        if value is not None:
            try:
                record = json.loads(value)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                log.warning("cluster: etcd's entry for node %r is not a map: %r", node, value[:80])
                return
        self._present.add(node) if record is not None else self._present.discard(node)
        self._tell(Member(node, record))

    def _tell(self, change: Member) -> None:
        """A change for the loop (`take`): this node's own (record None) if its lease
        expired and it joined again."""
        self.events.append(change)
        try:
            os.write(self._wake, b"\0")
        except BlockingIOError:  # (the loop has not read the last ones yet)
            pass
