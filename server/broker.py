"""The broker: one ROUTER socket, one thread, one loop.

Requests are answered in the order they arrive; nothing in the loop blocks. A request that
must wait parks as a `Waiter`: a `get` (or a watch) for a version of a key not sealed yet, a
queue `get` on an empty queue, a queue `put` on a full one. It is answered when what it waits
for happens, or with `Timeout` when its deadline passes.

Client processes are watched through pidfds (readable when the process exits, even by
SIGKILL); a client the broker cannot watch (another pid namespace, another host over tcp)
must send heartbeats instead.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import zmq

from ..common import cudart, host
from ..common.config import SHM_DIR, check_address, format_size
from ..common.errors import (
    BrokerError,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProtocolError,
    QueueClosed,
    Timeout,
)
from ..common.protocol import (
    MAX_MESSAGE_BYTES,
    NO_REPLY,
    PROTOCOL_VERSION,
    Op,
    Request,
    decode,
    encode,
    parse_request,
    reply_error,
    reply_ok,
)
from .arena import Arena
from .devices import DeviceMemory
from .queues import BrokerQueue, Waiter
from .registry import Registry, Session, StoredObject

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.25  # asked of clients the broker cannot watch
HEARTBEAT_TIMEOUT = 1.0  # silence after which such a client counts as dead
MAX_POLL_S = 3600.0  # a far deadline is waited for in steps zmq can take
DRAIN_BATCH = 512  # requests handled before the loop looks at timers and pidfds again
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum arithmetic costs
ENDED_QUEUES = 4096  # ended queues remembered, so that a late consumer sees them closed
DEVICE_WAIT = 10.0  # a device put waits this long for quarantined memory to come back
RECLAIM_POLL = 0.001  # how often blocks waiting for GPU work look at their events


class AddressInUse(BrokerError):
    code = "unavailable"


class Broker:
    def __init__(
        self,
        address: str,
        capacity: int,
        *,
        shm_dir: str = SHM_DIR,
        devices: DeviceMemory | None = None,
    ) -> None:
        self.address = check_address(address)
        self.arena = Arena(capacity, shm_dir=shm_dir)
        self.devices = devices if devices is not None else DeviceMemory(load=cudart.load)
        self.registry = Registry(self.arena, on_free=self._item_freed, devices=self.devices)
        self._device_puts: deque[Waiter] = deque()  # device puts waiting for memory
        self._retry_deadlines: dict[int, float] = {}  # request being retried -> its deadline
        self.sessions: dict[str, Session] = {}
        self.routes: dict[bytes, Session] = {}
        self.pidfds: dict[int, Session] = {}
        self._unwatched: set[Session] = set()  # sessions kept alive by heartbeats
        self.waiters: dict[str, deque[Waiter]] = {}  # key -> gets waiting for a version
        self.parked: set[Waiter] = set()  # every waiter not answered yet
        self.queues: dict[str, BrokerQueue] = {}  # name -> queue (open, draining or ended)
        self.queue_ids: dict[int, BrokerQueue] = {}
        self._queue_ids = itertools.count(1)
        self._ended: dict[int, BrokerQueue] = {}  # ended queues, oldest first
        self._roomy: set[BrokerQueue] = set()  # queues that freed a slot since the last look
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._started = time.monotonic()
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._ipc_inode: int | None = None
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._handlers: dict[str, Callable[[Session | None, bytes, Request], dict[str, Any] | None]]
        self._handlers = {
            Op.HELLO: self._on_hello,
            Op.PING: self._on_ping,
            Op.PUT: self._on_put,
            Op.SEAL: self._on_seal,
            Op.ABORT: self._on_abort,
            Op.GET: self._on_get,
            Op.DELETE: self._on_delete,
            Op.EXISTS: self._on_exists,
            Op.KEYS: self._on_keys,
            Op.STATS: self._on_stats,
            Op.RELEASE: self._on_nothing,
            Op.HEARTBEAT: self._on_nothing,
            Op.BYE: self._on_bye,
            Op.QOPEN: self._on_qopen,
            Op.QPUT: self._on_qput,
            Op.QGET: self._on_qget,
            Op.QCLOSE: self._on_qclose,
            Op.QINFO: self._on_qinfo,
        }

    # -- life cycle ------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the address; AddressInUse if another broker answers there."""
        self._refuse_if_served()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        router.setsockopt(zmq.SNDHWM, 100_000)
        router.setsockopt(zmq.RCVHWM, 100_000)
        try:
            router.bind(self.address)
        except zmq.ZMQError as exc:
            router.close()
            raise AddressInUse(
                f"cannot serve on {self.address}: {exc}. Is another broker running there? "
                "Stop it or choose another --address."
            ) from None
        self._router = router
        if self.address.startswith("ipc://"):  # zmq leaves the socket file: remove it at close
            self._ipc_inode = os.stat(self.address[6:]).st_ino
        self._poller.register(router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        first = self.arena.allocate(1)  # create and back the first chunk now, not at first put
        if first is not None:
            self.arena.free(first)
        self.devices.start()
        log.info("serving on %s, capacity %s", self.address, format_size(self.arena.capacity))

    def _refuse_if_served(self) -> None:
        if self.address.startswith("ipc://") and not os.path.exists(self.address[6:]):
            return
        probe = self._ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.connect(self.address)
            probe.send(encode({"op": Op.PING, "id": 1}))
            if probe.poll(500):
                pid = decode(probe.recv()).get("pid")
                raise AddressInUse(
                    f"a broker (pid {pid}) already serves {self.address}; stop it "
                    "(kill it, or systemctl stop) or choose another --address"
                )
        finally:
            probe.close()

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

    def stop(self) -> None:
        """Ask the loop to end; safe from any thread and from signal handlers."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        """Close sockets and pidfds and unlink every segment. Idempotent."""
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
            self._unlink_socket_file()
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()
        self.arena.close()
        self.devices.close()

    def _unlink_socket_file(self) -> None:
        path = self.address[6:]
        try:
            if self._ipc_inode is not None and os.stat(path).st_ino == self._ipc_inode:
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
        while not self._stopping:
            for item, _ in self._poller.poll(self._poll_timeout_ms()):
                if item is router:
                    self._drain(router)
                elif item is self._wake_r:
                    self._wake_r.recv(4096)
                elif isinstance(item, int) and item in self.pidfds:
                    session = self.pidfds[item]
                    log.info("client pid %s exited: dropping %s", session.pid, session)
                    self._forget_events_of(session)
                    self._drop_session(session)
            self._expire(time.monotonic())
            self.devices.reclaim()
            if self.devices.freed:  # here or while a request was handled
                self.devices.freed = 0
                self._retry_device_puts()
            self._admit_putters()

    def _poll_timeout_ms(self) -> int:
        timeout = None
        if self._deadlines:
            timeout = max(0.0, self._deadlines[0][0] - time.monotonic())
        if self.devices.quarantine:
            timeout = min(timeout if timeout is not None else RECLAIM_POLL, RECLAIM_POLL)
        if self._unwatched:
            timeout = min(timeout or HEARTBEAT_INTERVAL, HEARTBEAT_INTERVAL)
        return -1 if timeout is None else int(min(timeout, MAX_POLL_S) * 1000) + 1

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        for _ in range(DRAIN_BATCH):
            # Asking for the socket's events is cheaper than a recv that raises zmq.Again.
            if not cast(int, router.getsockopt(_EVENTS)) & _POLLIN:
                return
            frames = router.recv_multipart(copy=True)
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (expected 2)", len(frames))
                continue
            self._handle(frames[0], frames[1])
            self._admit_putters()

    def _handle(self, route: bytes, payload: bytes) -> None:
        request_id = 0
        try:
            message = decode(payload)
            raw_id = message.get("id")
            request_id = raw_id if type(raw_id) is int and 0 <= raw_id < 1 << 63 else 0
            request = parse_request(message)
            session = self.routes.get(route)
            if session is None and request.op not in (Op.HELLO, Op.PING):
                raise ProtocolError(f"{request.op}: say hello first")
            if session is not None:
                session.last_seen = time.monotonic()
                for lease_id in request.releases:
                    if not self.registry.release(session, lease_id):
                        log.warning("%s released lease %s it does not hold", session, lease_id)
        except Exception as exc:
            self._fail(route, request_id, exc)
            return
        self._run(session, route, request)

    def _run(self, session: Session | None, route: bytes, request: Request) -> None:
        """Answer one request (or park it)."""
        try:
            result = self._handlers[request.op](session, route, request)
        except Exception as exc:
            self._fail(route, request.id, exc)
            return
        if result is not None and request.op not in NO_REPLY:
            self._send(route, reply_ok(request.id, **result))

    def _fail(self, route: bytes, request_id: int, exc: Exception) -> None:
        if isinstance(exc, BrokerError):
            log.debug("request %s failed: %s", request_id, exc)
        else:  # a bug must not take the broker down; say so loudly
            log.exception("internal error handling request %s", request_id)
            exc = BrokerError(f"internal error: {exc!r}")
        self._send(route, reply_error(request_id, exc))

    def _send(self, route: bytes, payload: bytes) -> None:
        router = self._router
        if router is None:
            return
        try:
            router.send_multipart([route, payload], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a reply: the client's queue is full")

    # -- sessions --------------------------------------------------------------------------

    def _on_hello(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        f = req.fields
        if f["version"] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {f['version']}, this broker {PROTOCOL_VERSION}: "
                "install the same tensorbroker version on both sides"
            )
        token = f["session"]
        session = self.sessions.get(token)
        if session is None:
            session = Session(token, f.get("pid"), last_seen=time.monotonic())
            session.pidfd = self._watch(f.get("pid"), f.get("boot_id"), f.get("start_time"))
            if session.pidfd is not None:
                self.pidfds[session.pidfd] = session
                self._poller.register(session.pidfd, zmq.POLLIN)
            else:
                self._unwatched.add(session)
            self.sessions[token] = session
            log.debug(
                "hello from pid %s (%s)", session.pid, "watched" if session.pidfd else "heartbeat"
            )
        old = self.routes.get(route)
        if old is not None and old is not session:
            old.routes.discard(route)
        session.routes.add(route)
        self.routes[route] = session
        return {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "boot_id": host.boot_id(),
            "start_time": host.start_time(os.getpid()),
            "heartbeat": 0.0 if session.pidfd is not None else HEARTBEAT_INTERVAL,
            "capacity": self.arena.capacity,
        }

    @staticmethod
    def _watch(pid: int | None, boot: str | None, started: int | None) -> int | None:
        """A pidfd for the client process, if it is provably that process on this host."""
        if pid is None or boot != host.boot_id() or started is None:
            return None
        try:
            fd = os.pidfd_open(pid)
        except (OSError, OverflowError, AttributeError):
            return None
        if host.start_time(pid) != started:  # another namespace's pid, or reused
            os.close(fd)
            return None
        return fd

    def _on_bye(self, session: Session | None, route: bytes, req: Request) -> None:
        assert session is not None
        keep = req.fields.get("keep_leases", False) and session.pidfd is not None
        self._drop_session(session, keep_leases=keep)

    def _forget_events_of(self, session: Session) -> None:
        """A dead process's read-done events, and the write events of its unsealed puts,
        will not complete behind work its context took with it; objects it sealed whose
        copies had not run are lost (Note [a producer that dies with its copy queued])."""
        for lost in self.registry.lose_unwritten(session):
            log.warning(
                "pid %s died before its copy of %s to %s had run: removed it (it never held "
                "the data put)", session.pid, _label(lost), lost.device,
            )  # fmt: skip
        events = list(session.read_events.values())
        for put_id in session.pending:
            obj = self.registry.pending.get(put_id)
            if obj is not None and obj.events:
                events.append(obj.events[0])
        if events:
            self.devices.forget(events)

    def _drop_session(self, session: Session, keep_leases: bool = False) -> None:
        for route in session.routes:
            self.routes.pop(route, None)
        session.routes.clear()
        for w in [w for w in self.parked if w.session is session]:
            self._unpark(w)
        keep = keep_leases and (bool(session.leases) or self.registry.writing(session))
        self.registry.drop_session(session, keep_leases=keep)
        session.closed = True
        if keep:
            return  # the pidfd drops the leases (and lost copies) when the process exits
        if session.pidfd is not None:
            self._poller.unregister(session.pidfd)
            self.pidfds.pop(session.pidfd, None)
            os.close(session.pidfd)
            session.pidfd = None
        self._unwatched.discard(session)
        self.sessions.pop(session.token, None)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if not w.done:
                self._unpark(w)
                self._send(w.route, reply_error(w.request.id, Timeout(w.timeout_message)))
        for session in list(self._unwatched):
            if now - session.last_seen > HEARTBEAT_TIMEOUT:
                log.info("%s sent no heartbeat for %.1fs: dropping it", session, HEARTBEAT_TIMEOUT)
                self._drop_session(session)

    # -- parked requests -------------------------------------------------------------------

    def _park(
        self,
        session: Session,
        route: bytes,
        req: Request,
        timeout: float | None,
        line: deque[Waiter],
        timeout_message: str,
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = Waiter(session, route, req, deadline, line, timeout_message)
        line.append(waiter)
        self.parked.add(waiter)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), waiter))

    def _unpark(self, w: Waiter) -> None:
        """Take a waiter out of its line, to be answered now (or never: its client is gone)."""
        w.done = True
        self.parked.discard(w)
        try:
            w.line.remove(w)
        except ValueError:
            pass  # already taken from the front of its line
        key = w.request.fields.get("key")
        if not w.line and key is not None and self.waiters.get(key) is w.line:
            del self.waiters[key]

    def _answer(self, w: Waiter, payload: bytes) -> None:
        self._unpark(w)
        self._send(w.route, payload)

    # -- objects ---------------------------------------------------------------------------

    def _on_put(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any] | None:
        assert session is not None
        f = req.fields
        try:
            put_id, obj = self.registry.begin_put(
                session,
                f["key"],
                f["tensors"],
                f.get("bundle", False),
                device=f.get("device", "cpu"),
            )
        except CapacityError as exc:
            self._wait_for_device(session, route, req, exc)
            return None
        return self._granted(put_id, obj)

    def _granted(self, put_id: int, obj: StoredObject) -> dict[str, Any]:
        """A put's reply: where to write, and for a device object the chunk's IPC handle and
        the write event to record after the copy."""
        reply = {"put": put_id, "tensors": obj.wire}
        if obj.events is not None:
            reply.update(self._device_fields(obj))
        return reply

    def _device_fields(self, obj: StoredObject) -> dict[str, Any]:
        assert obj.events is not None
        arena = self.devices.arena(obj.device)
        write = obj.events[0]
        return {
            "handle": arena.handle(obj.block.segment),
            "event": [write, self.devices.handle(write)],
        }

    def _wait_for_device(
        self, session: Session, route: bytes, req: Request, exc: CapacityError
    ) -> None:
        """A device put that does not fit while blocks wait for GPU work to finish waits for
        them (up to DEVICE_WAIT), instead of failing for memory that is a moment from free."""
        if req.fields.get("device", "cpu") == "cpu" or not self.devices.quarantine:
            raise exc
        deadline = self._retry_deadlines.get(id(req))  # a retried put keeps its first deadline
        timeout = DEVICE_WAIT if deadline is None else max(0.0, deadline - time.monotonic())
        message = f"{exc} (waited {DEVICE_WAIT:g}s for readers' GPU work to finish)"
        self._park(session, route, req, timeout, self._device_puts, message)

    def _retry_device_puts(self) -> None:
        for w in list(self._device_puts):
            self._unpark(w)
            self._retry_deadlines[id(w.request)] = w.deadline or time.monotonic() + DEVICE_WAIT
            try:
                self._run(w.session, w.route, w.request)
            finally:
                del self._retry_deadlines[id(w.request)]

    def _on_seal(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        assert session is not None
        put_id, keep = req.fields["put"], req.fields.get("keep", False)
        queue = self.registry.pending_put(session, put_id, "seal").queue
        if queue is not None:
            return self._seal_item(session, put_id, keep, queue)
        obj = self.registry.seal(session, put_id, keep)
        for w in [
            w
            for w in self.waiters.get(obj.key, ())
            if w.request.fields.get("after", 0) < obj.version
        ]:
            self._answer(w, reply_ok(w.request.id, **self._describe(w.session, obj)))
        return {"version": obj.version}

    def _on_abort(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        assert session is not None
        self.registry.abort(session, req.fields["put"], req.fields.get("keep", False))
        return {}

    def _describe(self, session: Session, obj: StoredObject) -> dict[str, Any]:
        """The object as a reader sees it, with a new lease of the reader's on it."""
        if obj.queue is not None:
            lease = self.registry.hand_over(session, obj)
        else:
            lease = self.registry.lease(session, obj, reader=True)
        reply = {
            "key": obj.key,
            "version": obj.version,
            "bundle": obj.bundle,
            "tensors": obj.wire,
            "lease": lease,
        }
        if obj.events is not None:  # and the event this reader records when it lets go
            done = session.read_events[lease]
            reply.update(self._device_fields(obj), done=[done, self.devices.handle(done)])
        return reply

    def _on_get(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any] | None:
        """The live version of a key, if newer than `after`; else wait for one up to timeout."""
        assert session is not None
        f = req.fields
        key, timeout, after = f["key"], f.get("timeout", 0.0), f.get("after", 0)
        obj = self.registry.objects.get(key)
        if obj is not None and obj.version > after:
            return self._describe(session, obj)
        if after:
            what = f"no version of {key!r} newer than {after} was sealed"
        else:
            what = f"no object {key!r} was put"
        if timeout == 0.0:
            if obj is None and not after:
                raise NotFound(f"no object {key!r}; put it first, or pass timeout= to wait for it")
            raise Timeout(what)
        line = self.waiters.setdefault(key, deque())
        self._park(session, route, req, timeout, line, f"{what} within {_secs(timeout)}")
        return None

    def _on_delete(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        self.registry.delete(req.fields["key"])
        return {}

    def _on_exists(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        return {"exists": req.fields["key"] in self.registry.objects}

    def _on_keys(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        return {"keys": sorted(self.registry.objects)}

    # -- queues ----------------------------------------------------------------------------

    def _on_qopen(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        name, maxsize = req.fields["name"], req.fields.get("maxsize", 0)
        q = self.queues.get(name)
        if q is None:
            q = BrokerQueue(name, next(self._queue_ids), maxsize)
            self.queues[name] = q
            self.queue_ids[q.id] = q
        elif maxsize and q.maxsize and maxsize != q.maxsize:
            raise InvalidRequest(
                f"queue {name!r} is open with maxsize={q.maxsize}, not {maxsize}: open it with "
                f"maxsize={q.maxsize}, or with maxsize=0 to take it as it is"
            )
        elif maxsize:
            q.maxsize = maxsize  # the first bound asked for holds
        return {"queue": q.id, "maxsize": q.maxsize, "closed": q.closed}

    def _queue(self, req: Request) -> BrokerQueue:
        q = self.queue_ids.get(req.fields["queue"])
        if q is None:
            name = req.fields.get("name", f"#{req.fields['queue']}")
            raise QueueClosed(f"queue {name!r} is closed and drained")
        return q

    def _on_qput(
        self, session: Session | None, route: bytes, req: Request
    ) -> dict[str, Any] | None:
        assert session is not None
        q = self._queue(req)
        if q.closed:
            raise QueueClosed(
                f"queue {q.name!r} is closed: it takes no more puts (a closed queue stays "
                "closed; give a new stream a new name)"
            )
        if not q.full and not q.putters:
            try:
                return self._grant(session, q, req)
            except CapacityError as exc:
                self._wait_for_device(session, route, req, exc)
                return None
        timeout = req.fields.get("timeout")
        if timeout == 0.0:
            raise Timeout(f"{q.describe()} is full")
        message = f"{q.describe()} stayed full for {_secs(timeout)}: is a consumer keeping up?"
        self._park(session, route, req, timeout, q.putters, message)
        return None

    def _grant(self, session: Session, q: BrokerQueue, req: Request) -> dict[str, Any]:
        """Memory for one item of `q`: it takes a slot until the item is freed."""
        f = req.fields
        put_id, obj = self.registry.begin_put(
            session, q.name, f["tensors"], f.get("bundle", False), queue=q,
            device=f.get("device", "cpu"),
        )  # fmt: skip
        q.in_flight += 1
        q.pending += 1
        return self._granted(put_id, obj)

    def _seal_item(
        self, session: Session, put_id: int, keep: bool, q: BrokerQueue
    ) -> dict[str, Any]:
        if q.closed:
            self.registry.abort(session, put_id, keep)
            raise QueueClosed(f"queue {q.name!r} was closed before this item was sealed")
        q.sealed += 1
        obj = self.registry.seal(session, put_id, keep, version=q.sealed)
        q.pending -= 1
        if q.getters:  # a consumer is waiting: it takes the item now
            w = q.getters[0]
            self._answer(w, reply_ok(w.request.id, **self._describe(w.session, obj)))
        else:
            q.items.append(obj)
        return {"version": obj.version}

    def _on_qget(
        self, session: Session | None, route: bytes, req: Request
    ) -> dict[str, Any] | None:
        assert session is not None
        q = self._queue(req)
        if q.items:
            reply = self._describe(session, q.items.popleft())
            self._note_if_ended(q)
            return reply
        if q.closed:
            raise QueueClosed(f"queue {q.name!r} is closed and drained")
        timeout = req.fields.get("timeout")
        if timeout == 0.0:
            raise Timeout(f"queue {q.name!r} is empty")
        self._park(
            session,
            route,
            req,
            timeout,
            q.getters,
            f"queue {q.name!r} stayed empty for {_secs(timeout)}",
        )
        return None

    def _on_qclose(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        q = self.queue_ids.get(req.fields["queue"])
        if q is None or q.closed:
            return {}  # closing a closed queue succeeds
        q.closed = True
        for w in [*q.getters, *q.putters]:
            closed = QueueClosed(f"queue {q.name!r} was closed")
            self._answer(w, reply_error(w.request.id, closed))
        self._note_if_ended(q)
        return {}

    def _on_qinfo(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        q = self._queue(req)
        return {
            "name": q.name,
            "len": len(q.items),
            "maxsize": q.maxsize,
            "in_flight": q.in_flight,
            "closed": q.closed,
        }

    def _item_freed(self, obj: StoredObject) -> None:
        """The registry freed a queue item's memory: its slot opens (answered after the
        request at hand, by `_admit_putters`)."""
        q: BrokerQueue = obj.queue
        q.in_flight -= 1
        if obj.version == 0:  # aborted before it was sealed
            q.pending -= 1
        self._roomy.add(q)

    def _admit_putters(self) -> None:
        """Give freed slots to the producers waiting for them, first come first served."""
        while self._roomy:
            q = self._roomy.pop()
            while q.putters and not q.full:
                w = q.putters[0]
                try:
                    result = self._grant(w.session, q, w.request)
                except BrokerError as exc:
                    self._answer(w, reply_error(w.request.id, exc))
                else:
                    self._answer(w, reply_ok(w.request.id, **result))
            self._note_if_ended(q)

    def _note_if_ended(self, q: BrokerQueue) -> None:
        """A closed queue stays closed: consumers that come late end at once instead of
        waiting for a stream that is over. Only the oldest of many ended queues are forgotten
        (their names then start new queues)."""
        if not q.ended or q.id in self._ended:
            return
        self._ended[q.id] = q
        while len(self._ended) > ENDED_QUEUES:
            old = self._ended.pop(next(iter(self._ended)))
            del self.queue_ids[old.id]
            del self.queues[old.name]

    def _on_stats(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        return {
            **self.registry.stats(),
            "clients": sum(1 for s in self.sessions.values() if not s.closed),
            "waiters": len(self.parked),
            "queues": len(self.queues) - len(self._ended),  # not ended yet
            "queued_items": sum(len(q.items) for q in self.queues.values()),
            "pid": os.getpid(),
            "address": self.address,
            "uptime_s": time.monotonic() - self._started,
            "devices": self.devices.stats(),
            "cuda": self.devices.unavailable if self.devices.runtime is None else "",
        }

    def _on_ping(self, session: Session | None, route: bytes, req: Request) -> dict[str, Any]:
        return {"pid": os.getpid(), "protocol": PROTOCOL_VERSION, "address": self.address}

    def _on_nothing(self, session: Session | None, route: bytes, req: Request) -> None:
        return None


def _secs(timeout: float | None) -> str:
    return "ever" if timeout is None else f"{timeout:g}s"


def _label(obj: StoredObject) -> str:
    if obj.queue is not None:
        return f"an item of queue {obj.queue.name!r}"
    return f"{obj.key!r} v{obj.version}"
