"""The broker's endpoint and loop: one ROUTER socket, one thread, nothing in the loop blocks.

It binds the address, handles signals, reads requests in arrival order, ends the leases each
one carries, dispatches it to the module that owns its concern, and sends the replies:

    sessions.py   hello, bye, pidfds and heartbeats: who the clients are and when one is gone
    objects.py    keyed objects: put, seal, abort, get and watch, wait, delete, exists, keys
                  (events.py: watch_prefix; eviction.py: room made when memory is full)
    queues.py     pipeline queues: open, put, get, close, info, and their slots
    parking.py    every request that waits, and its deadline
    registry.py   objects, versions, leases and memory (arena.py, devices.py below it)
    lanes.py      the Unix stream sockets beside an ipc:// address; backlog.py: ZeroMQ
                  replies a client has not taken yet
    sockets.py    the address and descriptors as the OS sees them (peers, fd limit, --group)

Every handler but hello's and ping's is given the sender's session; a request from a socket
that has not said hello is refused before any handler runs.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import zmq
from zmq.auth.thread import ThreadAuthenticator

from ..common import cudart, curve, protocol
from ..common.config import (
    SHM_DIR,
    check_address,
    default_state_dir,
    format_size,
    group_id,
    ipc_path,
    lane_path,
)
from ..common.errors import BrokerError, InvalidRequest, ProtocolError, SessionUnknown, Timeout
from ..common.protocol import (
    MAX_MESSAGE_BYTES,
    NO_REPLY,
    PROTOCOL_VERSION,
    Budget,
    Op,
    Request,
    decode_request,
    parse_request,
    reply_error,
    reply_ok,
)
from . import backlog
from .arena import Arena, Block, Segment
from .devices import RECLAIM_POLL, DeviceMemory
from .directory import Directory
from .inventory import Inventory
from .lanes import Lanes
from .members import MailboxTables, SlotTables
from .objects import Objects
from .opstats import OpStats
from .parking import ParkingLot
from .queues import Queues
from .registry import Registry, Session, StoredObject
from .rings import Ring
from .sessions import HEARTBEAT_INTERVAL, Sessions
from .sockets import AddressInUse, frame_peer, raise_fd_limit, refuse_if_served, share_sockets
from .state import Recovered, State

if TYPE_CHECKING:
    from .metrics import Exporter

log = logging.getLogger(__name__)

SEALS = frozenset({Op.SEAL, Op.WRITE})  # a client's seals, in order over one socket

MAX_POLL_S = 3600.0  # a far deadline is waited for in steps zmq can take
# Requests ZeroMQ reads ahead per client: one that sends faster than the broker answers waits
# in its own socket (nothing is dropped), and holds at most RCVHWM frames here.
RCVHWM = 128
RING_SCAN = 0.005  # seconds between looks at the rings whose producers wait (QueueRings.scan)
DRAIN_BATCH = 512  # requests handled before the loop looks at timers and pidfds again
# plain ints: enum arithmetic costs
_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)

Handler = Callable[[Session, bytes, Request], "dict[str, Any] | None"]


class Broker:
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
    ) -> None:
        """A broker on the state in `state_dir` (default: next to the socket), adopting the
        one a broker that died left there (Note [recovery] in state.py) unless `reset`.
        `keep_state`: a clean stop leaves the state (and the objects) for the next broker.
        StateError if the state cannot be used. On tcp:// it serves with the keys in the
        file `curve_secret` (and only to the clients whose public keys are in the folder
        `curve_clients`, if given), or without keys on loopback if `insecure_tcp`
        (common/curve.py); InvalidRequest otherwise. `group`: a group whose members may
        connect and map the memory too (folder, sockets and segments group-accessible).
        `evict`: "lru" makes every keyed host object evictable (eviction.py)."""
        if evict not in (None, "none", "lru"):
            raise InvalidRequest(f"--evict must be none or lru, not {evict!r}")
        self.address = check_address(address)
        self._gid = None if group is None else group_id(group)
        self._keys = curve.server_keys(self.address, curve_secret, curve_clients, insecure_tcp)
        self._authenticator: ThreadAuthenticator | None = None
        self._shm_dir, self.keep_state = shm_dir, keep_state
        refuse_if_served(self.address)  # before the state: say who serves the address
        self.state = state = State(
            state_dir or default_state_dir(self.address), reset=reset, shm_dir=shm_dir
        )
        found = state.recovered
        try:
            self.arena = Arena(
                capacity, shm_dir=shm_dir, prefix=state.prefix,
                on_segment=lambda seg: state.segment(seg.name, seg.size, "arena"),
                group=self._gid,
            )  # fmt: skip
            self.directory = Directory(shm_dir, state.prefix, state, group=self._gid)
            # Lease slots and mailboxes: a table of each per user (Note [members]).
            per_user = self._gid is not None
            self.slots = SlotTables(
                shm_dir, state.prefix, state, per_user=per_user,
                existing=found.meta.get("slots") if found else None,
            )  # fmt: skip
            self.mailboxes = MailboxTables(shm_dir, state.prefix, state, per_user=per_user)
        except BaseException:
            state.close(keep=found is not None)
            raise
        self.devices = devices if devices is not None else DeviceMemory(load=cudart.load)
        self.registry = Registry(
            self.arena,
            on_free=self._item_freed,
            devices=self.devices,
            directory=self.directory,
            slots=self.slots,
            journal=state,
            first_id=int(found.meta.get("next_id", 1)) if found else 1,
        )
        self.lot = ParkingLot()
        self._poller = zmq.Poller()
        self._budget = Budget()
        self.sessions = Sessions(
            self.registry,
            self.lot,
            lambda fd: self._poller.register(fd, zmq.POLLIN),
            self._poller.unregister,
        )
        self.objects = Objects(self.registry, self.lot, self._answer)
        self.objects.eviction.every_object = evict == "lru"
        self.devices.on_free = self.objects.memory_back
        self.queues = Queues(self.objects)
        self.queues.rings.make = lambda slots, existing: Ring(
            shm_dir, state.prefix, state, slots, self._gid, existing
        )  # fmt: skip
        self.handoffs = self.queues.handoffs  # Note [direct handoff] in common/mailbox.py
        self.handoffs.mailboxes, self.handoffs.sessions = self.mailboxes, self.sessions.by_token
        self.sessions.mailboxes = self.mailboxes
        self.sessions.on_drop = self.queues.session_gone
        self.sessions.holds_ring = self.queues.rings.holds
        self.sessions.ring_held = self.queues.rings.held
        self.inventory = Inventory(
            self.registry, self.queues, self.sessions.by_token.values(), self.lot
        )
        self._stopping = False
        self._started = time.monotonic()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._backlogs: backlog.Backlogs | None = None  # replies the router would not take yet
        self._ipc_inode: int | None = None
        self._ipc = False  # serving an ipc:// address, where the kernel names each peer
        self.lanes: Lanes | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._outbox: list[tuple[bytes, bytes]] | None = None  # replies held for a commit
        self._after: list[tuple[bytes, bytes]] = []  # answers that go after the outbox's
        self._ring_scan = 0.0  # when the rings are looked at next (QueueRings.scan)
        self._wake_w.setblocking(False)
        self._exporter: Exporter | None = None  # serve --metrics: export_metrics()
        self.opstats = OpStats()
        self._handlers: dict[str, Handler] = {
            Op.PUT: self.objects.put,
            Op.SEAL: self._on_seal,
            Op.ABORT: self.objects.abort,
            Op.GRANT: self.objects.grant,
            Op.WRITE: self._on_write,
            Op.QCREDIT: self.queues.credit,
            Op.GET: self.objects.get,
            Op.WAIT: self.objects.wait,
            Op.WATCH_PREFIX: self.objects.events.watch,
            Op.DELETE: self.objects.delete,
            Op.EXISTS: self.objects.exists,
            Op.KEYS: self.objects.keys,
            Op.STATS: self._on_stats,
            Op.RELEASE: self._on_release,
            Op.HEARTBEAT: _nothing,
            Op.BYE: self._on_bye,
            Op.QOPEN: self.queues.open,
            Op.QPUT: self.queues.put,
            Op.QGET: self.queues.get,
            Op.QSUB: self.queues.subscribe,
            Op.QUNSUB: self.queues.unsubscribe,
            Op.QCLOSE: self.queues.close,
            Op.QINFO: self.queues.info,
            Op.QDELETE: self.queues.remove,
            Op.CANCEL: self._on_cancel,
            Op.LIST: self.inventory.objects,
            Op.QLIST: self.inventory.queue_list,
            Op.CLIENTS: self.inventory.clients,
        }
        if found is not None:
            try:
                self._adopt(found)
            except BaseException:
                self.close(keep=True)  # left as found, for a fix and another try
                raise

    def _adopt(self, found: Recovered) -> None:
        """Take over the state of the broker that died (Note [recovery] in state.py)."""
        arena = [n for n, (_, kind) in found.segments.items() if kind == "arena"]
        self.arena.adopt(
            [Segment.existing(self._shm_dir, n) for n in arena],
            [Block(row.segment, row.offset, row.size) for row in found.objects],
        )
        held = self.sessions.adopt(found.sessions)
        self.queues.adopt(found.queues, found.objects, self.sessions.by_token)
        self.registry.adopt(found.objects, self.sessions.by_token, self.queues.by_id)
        self.registry.versions(found.versions)
        for token, oids in held.items():
            self.registry.hold(self.sessions.by_token[token], oids)
        self.queues.adopted(found.objects)
        old = found.meta.get("directory")
        if old in found.segments:
            self.directory.adopt(old)
        ours = {*self.arena.segments, *self.directory.segments, *self.slots.names}
        ours.update(self.mailboxes.names)
        ours.update(self.queues.rings.segments)
        for name in os.listdir(self._shm_dir):  # made but not journaled, or replaced
            if name.startswith(self.state.prefix) and name not in ours:
                os.unlink(os.path.join(self._shm_dir, name))
                self.state.segment_gone(name)
        waiting = sum(s.awaiting for s in self.sessions.by_token.values())
        log.warning(
            "adopted the state of a broker that died (%s): %d objects, %d queues, %s used; "
            "waiting for %d clients to come back",
            found.owner, len(self.registry.objects), len(self.queues.by_name),
            format_size(self.arena.used_bytes), waiting,
        )  # fmt: skip
        if not waiting:
            self.registry.settle()

    # -- life cycle ------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the address; AddressInUse if another broker answers there."""
        raise_fd_limit()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.SNDHWM, backlog.SNDHWM)  # the rest wait in Backlogs
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises zmq.Again
        router.setsockopt(zmq.RCVHWM, RCVHWM)
        if self._keys is not None:
            self._keys.apply(router)
            if self._keys.clients is not None:  # ZeroMQ asks this thread about each client
                self._authenticator = ThreadAuthenticator(self._ctx, log=log)
                self._authenticator.start()
                self._authenticator.configure_curve(domain="*", location=self._keys.clients)
        elif self.address.startswith("tcp://"):
            log.warning(
                "serving %s WITHOUT KEYS (--insecure-tcp): every local user can read, write "
                "and delete every tensor here; use --curve-secret for anything else",
                self.address,
            )
        try:
            router.bind(self.address)
        except zmq.ZMQError as exc:
            router.close()
            if self._authenticator is not None:
                self._authenticator.stop()
                self._authenticator = None
            raise AddressInUse(
                f"cannot serve on {self.address}: {exc}. Is another broker running there? "
                "Stop it or choose another --address."
            ) from None
        self._router = router
        self._backlogs = backlog.Backlogs(router, self.sessions.route_gone)
        path = ipc_path(self.address)
        if path is not None:  # zmq leaves the socket file: remove it at close
            self._ipc_inode, self._ipc = os.stat(path).st_ino, True
        lane = lane_path(self.address)
        if lane is not None:
            self.lanes = Lanes(
                lane, self._watch, self._poller.unregister, self.sessions.route_gone,
                self.handoffs.sent,  # a bell rings once the reply is there to read
            )  # fmt: skip
            self.lanes.listen()
        if path is not None and self._gid is not None:
            share_sockets(self._gid, path, lane)
        self._poller.register(router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        first = self.arena.allocate(1)  # create and back the first chunk now, not at first put
        if first is not None:
            self.arena.free(first)
        self.devices.start()
        log.info("serving on %s, capacity %s", self.address, format_size(self.arena.capacity))

    def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Run until stop() or SIGINT/SIGTERM; then release everything."""
        if self._router is None:
            self.bind()
        restore = self._install_signals()
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

        self._exporter = Exporter(host, port, self._wake)

    def stop(self) -> None:
        """Ask the loop to end; safe from any thread and from signal handlers."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        """Make the loop run a batch; safe from any thread and from signal handlers."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self, keep: bool | None = None) -> None:
        """Close sockets and pidfds, and unlink every segment and the state unless it is
        kept (`keep`, else as made: `keep_state`). Idempotent."""
        if keep is not None:
            self.keep_state = keep
        self.sessions.close()
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = self._backlogs = None
            self._unlink_socket_file()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()
        unlink = not self.keep_state
        self.arena.close(unlink)
        self.directory.close(unlink)
        self.slots.close(unlink)
        self.mailboxes.close(unlink)
        self.queues.rings.close_all(unlink)
        self.state.close(keep=self.keep_state)
        self.devices.close()

    def _unlink_socket_file(self) -> None:
        path = ipc_path(self.address)
        try:
            if path and self._ipc_inode is not None and os.stat(path).st_ino == self._ipc_inode:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping", signal.Signals(signum).name)
            self.stop()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno())

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        router = self._router
        assert router is not None  # bound by serve()
        pidfds = self.sessions.pidfds
        exporter = self._exporter
        while not self._stopping:
            events = self._poller.poll(self._poll_timeout_ms())
            self._begin()
            try:
                for item, flags in events:
                    if item is router:
                        self._drain(router)
                    elif item is self._wake_r:
                        self._wake_r.recv(4096)
                    elif item in pidfds:
                        self.sessions.exited(item)
                    elif self.lanes is not None:
                        self._lane_ready(self.lanes, item, flags)
            finally:
                self._commit()
            # Only now that this batch's events are handled may their descriptors go.
            self.sessions.close_let_go()
            if self.lanes is not None:
                self.lanes.close_let_go()
            if self.objects.refills:
                self._refill()
            if self._backlogs:
                self._backlogs.flush()
            now = time.monotonic()
            for w in self.lot.expired(now):
                if w.at_deadline is not None:
                    payload = w.at_deadline()
                    if payload is not None:
                        self._send(w.route, payload)
                else:
                    self.opstats.refuse(Timeout.code)
                    self._send(w.route, reply_error(w.request.id, Timeout(w.timeout_message)))
            self.sessions.drop_silent(now)
            if self.lanes is not None:
                self.lanes.resume(now)
            self.registry.reclaim()
            self.devices.reclaim()
            self.objects.retry_device_puts()
            if now >= self._ring_scan:
                self._ring_scan = now + RING_SCAN
                self.queues.rings.scan()
            self.queues.admit_putters()
            if exporter is not None and exporter.wanted:  # a scrape waits (Note [metrics])
                try:
                    exporter.answer(self.stats)
                except Exception:  # the scrape gets the last figures; the broker goes on
                    log.exception("could not take the figures for a metrics scrape")

    def _poll_timeout_ms(self) -> int:
        if self.queues.rings.due:  # ring writes of work done after the last commit
            return 0
        timeout = None
        deadline = self.lot.next_deadline()
        if self.lanes is not None and self.lanes.paused_until is not None:
            deadline = min(deadline or math.inf, self.lanes.paused_until)
        if deadline is not None:
            timeout = max(0.0, deadline - time.monotonic())
        if self.devices.quarantine or self.registry.scanning:
            timeout = min(timeout if timeout is not None else RECLAIM_POLL, RECLAIM_POLL)
        if self.queues.rings.waited_on:  # a "done" lost: found by the scan
            timeout = min(timeout if timeout is not None else RING_SCAN, RING_SCAN)
        if self.sessions.unwatched:
            timeout = min(timeout if timeout is not None else math.inf, HEARTBEAT_INTERVAL)
        if self._backlogs:
            timeout = min(timeout if timeout is not None else math.inf, backlog.RETRY_S)
        return -1 if timeout is None else int(min(timeout, MAX_POLL_S) * 1000) + 1

    def _begin(self) -> None:
        """What the loop handles next is one journal transaction: replies wait in the outbox
        until it is committed (Note [recovery] in state.py)."""
        self._outbox = []
        self.state.begin()

    def _commit(self) -> None:
        self.state.commit()
        self.handoffs.committed()
        outbox, self._outbox = self._outbox, None
        for route, payload in outbox or ():
            self._send(route, payload)
        after, self._after = self._after, []
        for route, payload in after:
            self._send(route, payload)
        self.queues.rings.flush()  # Note [broadcast ring]

    def _answer(self, route: bytes, payload: bytes, last: bool = False) -> None:
        """The reply to a request that waited (a consumer parked on a queue, say): it goes
        out at once, after the journal records so far, not at the end of the batch, so that
        the work left (refilling the producer's grants) is not on the consumer's path.
        `last`: after the batch's replies instead (Note [broadcast] in queues.py)."""
        if self._outbox is None:
            self._send(route, payload)
            return
        if last:
            self._after.append((route, payload))
            return
        self._outbox.append((route, payload))
        self._commit()
        self._begin()

    def _refill(self) -> None:
        """Top up the grants the writes of the last batch used (Note [grants] in
        registry.py), now that their replies are out: one message per writer's socket."""
        refills, self.objects.refills = self.objects.refills, []
        due: dict[tuple[bytes, Session], set[int]] = {}
        for session, route, size_class in refills:
            due.setdefault((route, session), set()).add(size_class)
        self._begin()
        try:
            for (route, session), classes in due.items():
                if session.closed or route not in session.routes:
                    continue
                grants = [g for c in sorted(classes) for g in self.registry.grant(session, c)]
                if grants:
                    self._send(route, reply_ok(0, grants=grants))
        finally:
            self._commit()

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        """Handle the requests waiting on the ZeroMQ socket, up to DRAIN_BATCH."""
        for _ in range(DRAIN_BATCH):
            # Asking for the socket's events is cheaper than a recv that raises zmq.Again.
            if not cast(int, router.getsockopt(_EVENTS)) & _POLLIN:
                break
            frames = router.recv_multipart(copy=False)  # a Frame carries its sender's pid
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (expected 2)", len(frames))
                continue
            route = frames[0].bytes
            try:
                message = decode_request(frames[1].bytes, self._budget)
            except ProtocolError as exc:
                self._fail(route, 0, exc)
                continue
            self._handle(route, message, frames[1])

    def _lane_ready(self, lanes: Lanes, fd: int, flags: int) -> None:
        if lanes.is_listener(fd):
            lanes.accept()
            return
        if flags & _POLLOUT:
            lanes.write(fd)
        if flags & ~_POLLOUT and fd in lanes.by_fd:  # readable, or an error a read reports
            lanes.read(fd, self._handle)

    def _watch(self, fd: int, writable: bool) -> None:
        self._poller.register(fd, _POLLIN | _POLLOUT if writable else _POLLIN)

    def _handle(self, route: bytes, message: Any, frame: zmq.Frame | None = None) -> None:
        """Answer one request; `frame`: the ZeroMQ frame it came in (None: a lane's)."""
        began = time.perf_counter()
        op = None
        try:
            request = parse_request(message)
            op = request.op  # a known op: the counters stay bounded
            result = self._dispatch(route, request, frame)
        except Exception as exc:
            self._fail(route, protocol.request_id(message) or 0, exc)
            self._seal_refused(route, message, parsed=op is not None)
        else:
            if result is not None and request.op not in NO_REPLY:
                self._send(route, reply_ok(request.id, **result))
        self.queues.admit_putters()
        if op is not None:
            self.opstats.record(op, time.perf_counter() - began)

    def _dispatch(
        self, route: bytes, request: Request, frame: zmq.Frame | None
    ) -> dict[str, Any] | None:
        if request.op == Op.HELLO:
            if frame is not None:
                peer = frame_peer(frame) if self._ipc else None  # tcp: the kernel cannot say
            else:
                peer = None if self.lanes is None else self.lanes.peer(route)
            return self.sessions.hello(route, request, peer)
        if request.op == Op.PING:
            return self._ping()
        session = self.sessions.routes.get(route)
        if session is None:
            raise SessionUnknown(f"{request.op}: this broker does not know the client")
        session.last_seen = time.monotonic()
        if request.releases:
            release = self.registry.release
            unknown = [lease for lease in request.releases if not release(session, lease)]
            if unknown:
                unknown = self.handoffs.released_early(session, unknown)
            if unknown:  # one line per request, however many (a flood must not fill the log)
                log.warning("%s released %d leases it does not hold (%s%s)", session,
                            len(unknown), ", ".join(map(str, unknown[:5])),
                            ", ..." if len(unknown) > 5 else "")  # fmt: skip
        try:
            return self._handlers[request.op](session, route, request)
        finally:
            if request.op in SEALS:  # applied or refused: its offers say so (Note [direct handoff])
                self.handoffs.applied(session, request.id)

    def _seal_refused(self, route: bytes, message: Any, parsed: bool) -> None:
        """A seal (or write into a block granted ahead) refused, for any reason: its block
        goes back now. Its client forgets the put when the answer is an error (Note [writes]
        in client/writes.py), so a put left pending here would hold its memory until the
        client's process exits. A seal refused before it was parsed is applied too, as far
        as its offers go (`_dispatch` says so of the others)."""
        op = message.get("op") if isinstance(message, dict) else None
        if type(op) is not str or op not in SEALS:  # (an op of any shape comes here too)
            return
        session = self.sessions.routes.get(route)
        put_id = message.get("put")
        if session is None or type(put_id) is not int:
            return
        if put_id in session.pending:
            self.registry.abort(session, put_id, keep=message.get("keep") is True)
        request_id = protocol.request_id(message)
        if not parsed and request_id:
            self.handoffs.applied(session, request_id)

    def _fail(self, route: bytes, request_id: int, exc: Exception) -> None:
        self.opstats.refuse(exc.code if isinstance(exc, BrokerError) else BrokerError.code)
        if isinstance(exc, BrokerError):
            log.debug("request %s failed: %s", request_id, exc)
        else:  # a bug must not take the broker down; say so loudly
            log.exception("internal error handling request %s", request_id)
            exc = BrokerError(f"internal error: {exc!r}")
        self._send(route, reply_error(request_id, exc))

    def _send(self, route: bytes, payload: bytes) -> None:
        if self._outbox is not None:  # after the batch's journal commit
            self._outbox.append((route, payload))
            return
        if self.lanes is not None and self.lanes.send(route, payload):
            return
        if self._backlogs is not None:
            self._backlogs.send(route, payload)

    # -- the few handlers that span concerns -------------------------------------------------

    def _on_seal(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        put_id, keep = req.fields["put"], req.fields.get("keep", False)
        done = self.registry.sealed_before(session, put_id)
        if done is not None:  # sealed by the broker that died; its answer was lost
            return {"version": done[0]}
        queue = self.registry.pending_put(session, put_id, "seal").queue
        if queue is not None:
            return self.queues.seal(session, put_id, keep, queue)
        return self.objects.seal(session, put_id, keep)

    def _on_write(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        """A block granted ahead, written: sealed as a put of its key, or a queue item."""
        done = self.registry.sealed_before(session, req.fields["put"])
        if done is not None:  # sealed by the broker that died; its answer was lost
            return {"version": done[0]}
        if "queue" in req.fields:
            return self.queues.write(session, route, req)
        return self.objects.write(session, route, req)

    def _on_cancel(self, session: Session, route: bytes, req: Request) -> dict[str, Any]:
        """A request of this socket that waits in the broker, given up by its caller (an
        asyncio task cancelled, a sync call interrupted): it leaves its line and is never
        answered. Replies on a socket keep their order, so if it was answered already, that
        answer came first; `cancelled` False without one: a producer handed it an item."""
        call = req.fields["call"]
        for w in self.lot.of(session):
            if w.route == route and w.request.id == call:
                self.lot.unpark(w)  # its grant taken back, unless a producer claimed it
                return {"cancelled": not self.handoffs.answered(w)}
        return {"cancelled": False}

    def _on_bye(self, session: Session, route: bytes, req: Request) -> None:
        self.sessions.bye(session, req)

    def _item_freed(self, obj: StoredObject) -> None:
        self.queues.item_freed(obj)

    def _on_release(self, session: Session, route: bytes, req: Request) -> None:
        """Releases (taken in `_dispatch`), and ring slots a subscriber found idle."""
        done = req.fields.get("done")
        if done:
            self.queues.rings.done(done)

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
            "lanes": 0 if self.lanes is None else len(self.lanes.by_fd),
            "waiters": len(self.lot),
            "crashed": self.sessions.crashed,
            "published": self.registry.published,
            **self.queues.stats(),
            **self.opstats.wire(),
            "pid": os.getpid(),
            "address": self.address,
            "state_dir": self.state.path,
            "uptime_s": time.monotonic() - self._started,
            "devices": self.devices.stats(),
            "cuda": self.devices.unavailable if self.devices.runtime is None else "",
        }

    def _ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "address": self.address,
            **self.sessions.shared(None),
        }


def _nothing(session: Session, route: bytes, req: Request) -> None:
    return None
