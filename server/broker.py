"""The broker: the rooms that own its state, a dispatch table from each op to the room that
answers it (dispatch.py: a request's way there), and the loop (one thread; nothing in it
blocks).

The loop reads requests in arrival order off the endpoint's sockets (endpoint.py), ends the
leases each one carries, hands it to its handler, and sends the replies after the batch's
journal records (Note [recovery] in state.py). The rooms:

    sessions.py   hello, bye, pidfds and heartbeats: who the clients are and when one is gone
    objects.py    keyed objects: put, seal, get, watch, ... (events.py, eviction.py)
    seals.py      seals and writes, routed to their key or queue; grants topped up
    queues.py     pipeline queues (broadcast.py, handoff.py: subscribers and direct handoffs)
    parking.py    every request that waits, and its deadline
    registry.py   objects, versions, leases and memory (leasing.py, grants.py, arena.py,
                  devices.py)
    adoption.py   the state of a broker that died, taken over
    cluster.py    the other brokers of a cluster (replicas.py: their keys, pulled by NIXL;
                  lending.py: this node's, lent to their pulls)
    endpoint.py   the sockets: ZeroMQ, the lanes beside an ipc:// address, wake-ups

Every handler but hello's and ping's is given the sender's session; a request from a socket
that has not said hello is refused before any handler runs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ..common import cudart, curve
from ..common.config import SHM_DIR, check_address, default_state_dir, format_size, group_id
from ..common.errors import InvalidRequest, Timeout
from ..common.protocol import PROTOCOL_VERSION, Request, reply_error
from .adoption import Adoption
from .cluster.cluster import Cluster, Joining, Watched
from .dispatch import Dispatching
from .durability.state import State
from .inventory import Inventory
from .ops import op_table
from .opstats import OpStats
from .queues.qring_state import QRing
from .queues.queues import Queues
from .queues.rings import Ring
from .seals import Seals
from .sessions import backlog
from .sessions.endpoint import Endpoint
from .sessions.outbox import Outbox
from .sessions.sessions import HEARTBEAT_INTERVAL, Sessions
from .sessions.sockets import refuse_if_served
from .store.arena import Arena
from .store.chunks import ChunkFds
from .store.devices import RECLAIM_POLL, DeviceMemory
from .store.directory import Directory
from .store.members import MailboxTables, SlotTables
from .store.objects import Objects
from .store.parking import ParkingLot
from .store.records import Session
from .store.registry import Registry

if TYPE_CHECKING:
    from .metrics import Exporter

log = logging.getLogger(__name__)

MAX_POLL_S = 3600.0  # a far deadline is waited for in steps zmq can take
RING_SCAN = 0.005  # seconds between looks at the rings whose producers wait (QueueRings.scan)
GROW_POLL = 0.002  # seconds between looks at a segment being made (Arena.grown)


class Broker(Dispatching):
    def __init__(
        self,
        address: str,
        capacity: int,
        *,
        shm_dir: str = SHM_DIR,
        devices: DeviceMemory | None = None,
        state_dir: str | None = None,
        keep_state: bool = False,
        reset: bool = False,
        curve_secret: str | None = None,
        curve_clients: str | None = None,
        insecure_tcp: bool = False,
        group: str | None = None,
        evict: str | None = None,
        cluster: Joining | None = None,
    ) -> None:
        """A broker on the state in `state_dir` (default: next to the socket), adopting the
        one a broker that died left there (Note [recovery] in state.py) unless `reset`.
        `keep_state`: a clean stop leaves the state (and the objects) for the next broker.
        StateError if the state cannot be used. On tcp:// it serves with the keys in the
        file `curve_secret` (and only to the clients whose public keys are in the folder
        `curve_clients`, if given), or without keys on loopback if `insecure_tcp`
        (common/curve.py); InvalidRequest otherwise. `group`: a group whose members may
        connect and map the memory too (folder, sockets and segments group-accessible).
        `evict`: "lru" makes every keyed host object evictable (eviction.py). `cluster`:
        the node this broker is, and its peers (Note [cluster] in cluster.py)."""
        if evict not in (None, "none", "lru"):
            raise InvalidRequest(f"--evict must be none or lru, not {evict!r}")
        self.address = check_address(address)
        gid = None if group is None else group_id(group)
        keys = curve.server_keys(self.address, curve_secret, curve_clients, insecure_tcp)
        self.keep_state = keep_state
        refuse_if_served(self.address)  # before the state: say who serves the address
        self.state = state = State(
            state_dir or default_state_dir(self.address), reset=reset, shm_dir=shm_dir
        )
        found, journal = state.recovered, state.journal
        assert journal is not None  # made by State, or it raised
        self.cluster: Cluster | None = None
        try:
            self.arena = Arena(
                capacity, shm_dir=shm_dir, prefix=state.prefix, on_segment=self._segment_made,
                group=gid,
            )  # fmt: skip
            self.directory = Directory(shm_dir, state.prefix, journal, group=gid)
            # Lease slots and mailboxes: a table of each per user (Note [members]).
            per_user = gid is not None
            self.slots = SlotTables(
                shm_dir, state.prefix, journal, per_user=per_user,
                existing=found.meta.get("slots") if found else None,
            )  # fmt: skip
            self.mailboxes = MailboxTables(shm_dir, state.prefix, journal, per_user=per_user)
        except BaseException:
            state.close(keep=found is not None)
            raise
        self.devices = devices if devices is not None else DeviceMemory(load=cudart.load)
        self.registry = Registry(
            self.arena,
            devices=self.devices,
            directory=self.directory,
            slots=self.slots,
            journal=journal,
            first_id=int(found.meta.get("next_id", 1)) if found else 1,
        )
        self.adoption = Adoption(self.registry)
        self.outbox = Outbox(  # (the rooms it names are made below)
            journal,
            lambda route, payload, fd: self.endpoint.send(route, payload, fd),
            committed=lambda: self.handoffs.committed(),
            sent=self._sent,
        )
        self.lot = ParkingLot()
        self.sessions = Sessions(self.registry, self.adoption, self.lot)
        self.objects = Objects(self.registry, self.lot, self.outbox.answer)
        self.objects.eviction.every_object = evict == "lru"
        self.objects.eviction.adopting = lambda: bool(self.adoption.adopted)
        self.devices.on_free = self.objects.memory_back
        self.queues = Queues(self.objects)
        self.queues.rings.make = lambda slots, existing: Ring(
            shm_dir, state.prefix, journal, slots, gid, existing
        )  # fmt: skip
        if cluster is None and gid is None:  # Note [queue ring]: one node, one user
            self.queues.qrings.make = lambda slots, existing: QRing(
                shm_dir, state.prefix, journal, slots, gid, existing
            )  # fmt: skip
        self.queues.retake = self.adoption.retake
        self.registry.on_free = self.queues.item_freed  # a freed item opens its slot
        self.handoffs = self.queues.handoffs  # Note [direct handoff] in common/mailbox.py
        self.handoffs.mailboxes, self.handoffs.sessions = self.mailboxes, self.sessions.by_token
        self.sessions.mailboxes = self.mailboxes
        self.sessions.on_drop = self.queues.session_gone
        rings, qrings = self.queues.rings, self.queues.qrings
        self.sessions.holds_ring = lambda s: rings.holds(s) or qrings.holds(s)
        self.sessions.ring_held = self.queues.rings.held
        sessions = self.sessions.by_token.values()
        self.inventory = Inventory(self.objects, self.queues, sessions, self.lot)
        self.seals = Seals(
            self.objects, self.queues, self.adoption, self.handoffs, self.sessions.routes
        )
        self.endpoint = Endpoint(
            self.address, keys, gid, self.sessions.route_gone, self.handoffs.sent
        )
        poller = self.endpoint.poller
        self.sessions.watch_fd = lambda fd: poller.register(fd, zmq.POLLIN)
        self.sessions.unwatch_fd = poller.unregister
        if cluster is not None:
            last = found.meta.get("incarnation") if found else None
            self.cluster = Cluster.join(cluster, self.queues, shm_dir, poller, last)
        self._stopping = False
        self._started = time.monotonic()
        self._ring_scan = 0.0  # when the rings are looked at next (QueueRings.scan)
        self._exporter: Exporter | None = None  # serve --metrics: export_metrics()
        self.opstats = OpStats()
        chunks = ChunkFds(self.devices, self.outbox.send, self.endpoint.is_lane)
        self._handlers = op_table(
            self.objects, self.seals, self.queues, self.sessions, self.inventory, chunks,
            self._on_stats,
        )  # fmt: skip
        if self.cluster is not None:  # (a request that asked a key's home runs again: its op)
            self.cluster.replicas.homes.handlers = self._handlers
        if found is not None:
            try:
                others = {*self.slots.names, *self.mailboxes.names}
                self.adoption.take_over(
                    found, shm_dir, state.prefix, self.sessions, self.queues, others
                )
            except BaseException:
                self.close(keep=True)  # left as found, for a fix and another try
                raise

    def _sent(self) -> None:
        """The replies of a batch went: the ring writes that waited for them go."""
        self.queues.rings.flush()  # Note [broadcast ring]
        self.queues.qrings.flush()  # Note [queue ring]

    def _segment_made(self, segment: Any) -> None:  # journaled; and registered with NIXL, once
        journal = self.state.journal
        assert journal is not None
        journal.segment(segment.name, segment.size, "arena")
        if self.cluster is not None:
            try:
                self.cluster.segment(segment.name)
            except BaseException:  # (the arena removes it: the journal must not name it)
                journal.segment_gone(segment.name)
                raise

    # -- life cycle ------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the address; AddressInUse if another broker answers there."""
        self.endpoint.bind()
        first = self.arena.allocate(1)  # create and back the first chunk now, not at first put
        if first is not None:
            self.arena.free(first)
        self.devices.start()
        if self.cluster is not None:  # (once bound: a peer that links here finds a broker)
            self.cluster.start()
        log.info("serving on %s, capacity %s", self.address, format_size(self.arena.capacity))

    def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Run until stop() or SIGINT/SIGTERM; then release everything."""
        if not self.endpoint.bound:
            self.bind()
        restore = self.endpoint.install_signals(self.stop)
        try:
            if ready is not None:
                ready()
            self._loop()
        finally:
            restore()
            self.close()

    def export_metrics(self, host: str, port: int) -> None:
        """Serve Prometheus metrics at http://HOST:PORT/metrics until close(), on threads
        that ask the loop for each scrape's figures (Note [metrics] in metrics.py). Call it
        before serve(). MetricsUnavailable without prometheus_client; AddressInUse if the
        port is taken."""
        from .metrics import Exporter  # prometheus_client is an extra: only when asked for

        self._exporter = Exporter(host, port, self.endpoint.wake)

    def stop(self) -> None:
        """Ask the loop to end; safe from any thread and from signal handlers."""
        self._stopping = True
        self.endpoint.wake()

    def close(self, keep: bool | None = None) -> None:
        """Close sockets and pidfds, and unlink every segment and the state unless it is
        kept (`keep`, else as made: `keep_state`). Idempotent."""
        if keep is not None:
            self.keep_state = keep
        self.sessions.close()
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        self.endpoint.close()
        unlink = not self.keep_state
        self.arena.close(unlink)
        self.directory.close(unlink)
        self.slots.close(unlink)
        self.mailboxes.close(unlink)
        self.queues.rings.close_all(unlink)
        self.queues.qrings.close_ended()
        self.state.close(keep=self.keep_state)
        self.devices.close()

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        endpoint, pidfds, cluster = self.endpoint, self.sessions.pidfds, self.cluster
        others = pidfds if cluster is None else Watched(pidfds, cluster.sockets)
        exporter = self._exporter
        while not self._stopping:
            events = endpoint.poller.poll(self._poll_timeout_ms())
            self.outbox.begin()
            try:
                for item in endpoint.ready(events, others, self._handle, self._refuse):
                    if item in pidfds:
                        self.sessions.exited(item)
                    elif cluster is not None:
                        cluster.ready(item)
                if cluster is not None:
                    cluster.tick(time.monotonic())
            finally:
                self.outbox.commit()
            if cluster is not None:  # what the replies go before: announcements, loans back
                cluster.flush()
            # Only now that this batch's events are handled may their descriptors go.
            self.sessions.close_let_go()
            if self.objects.refills:  # the grants the batch's writes used (Note [grants])
                self.outbox.batch(self.seals.top_up())
            now = time.monotonic()
            endpoint.after_batch(now)
            for w in self.lot.expired(now):
                if w.at_deadline is not None:
                    payload = w.at_deadline()
                    if payload is not None:
                        self.outbox.send(w.route, payload)
                else:
                    self.opstats.refuse(Timeout.code)
                    self.outbox.send(w.route, reply_error(w.request.id, Timeout(w.timeout_message)))
            self.sessions.drop_silent(now)
            self.registry.reclaim()
            self.devices.reclaim()
            self.objects.retry_device_puts()
            self.objects.retry_growing_puts()
            if now >= self._ring_scan:
                self._ring_scan = now + RING_SCAN
                self.queues.rings.scan()
            self.queues.slots.admit_putters()
            if exporter is not None and exporter.wanted:  # a scrape waits (Note [metrics])
                try:
                    exporter.answer(self.stats)
                except Exception:  # the scrape gets the last figures; the broker goes on
                    log.exception("could not take the figures for a metrics scrape")

    def _poll_timeout_ms(self) -> int:
        if self.queues.rings.due:  # ring writes of work done after the last commit
            return 0
        waits = [MAX_POLL_S]
        deadline = self.endpoint.next_deadline(self.lot.next_deadline())
        if deadline is not None:
            waits.append(max(0.0, deadline - time.monotonic()))
        if self.devices.quarantine or self.registry.scanning:
            waits.append(RECLAIM_POLL)
        if self.arena.growing:  # (Note [growing] in server/store/arena.py)
            waits.append(GROW_POLL)
        if self.queues.rings.waited_on:  # a "done" lost: found by the scan
            waits.append(RING_SCAN)
        if self.sessions.unwatched:
            waits.append(HEARTBEAT_INTERVAL)
        if self.endpoint.backlogged:
            waits.append(backlog.RETRY_S)
        if self.cluster is not None:
            waits.append(self.cluster.wake_in)
        return -1 if len(waits) == 1 else math.ceil(min(waits) * 1000)

    # -- the few handlers that span rooms ----------------------------------------------------

    def _on_stats(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """The counters of `stats()`, in dicts made for the call: also what a scrape of
        `serve --metrics` is handed (Note [metrics] in metrics.py). Loop thread only."""
        return {
            **self.registry.stats(),
            "clients": self.sessions.clients,
            "clients_by_uid": self.sessions.by_uid(),
            "evicted": self.objects.eviction.evicted,
            "lanes": self.endpoint.lanes_open,
            "waiters": len(self.lot),
            "crashed": self.sessions.crashed,
            "published": self.registry.published,
            **self.queues.stats(),
            **self.opstats.wire(),
            "pid": os.getpid(),
            "address": self.address,
            "state_dir": self.state.path,
            "uptime_s": time.monotonic() - self._started,
            "cpu_s": time.process_time(),  # (all its threads': bench/scaling_hosts.py)
            "devices": self.registry.grants.device_stats(),
            "cuda": self.devices.unavailable if self.devices.runtime is None else "",
            **({} if self.cluster is None else {"cluster": self.cluster.stats()}),
        }

    def _ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "address": self.address,
            **self.sessions.shared(None),
        }
