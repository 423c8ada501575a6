"""Sessions: who the broker's clients are, and how it learns that one is gone.

A client says hello on each of its sockets with a session token. The broker asks the kernel
which process is at the other end (SO_PEERCRED, on a lane or an ipc:// ZeroMQ connection) and
opens a pidfd for it (readable when the process exits, even by SIGKILL); the pid a client
claims is never trusted. Where the kernel cannot say (another pid namespace, tcp://), the
client must send heartbeats, and a session silent for HEARTBEAT_TIMEOUT counts as dead. A
dead session's leases end, its unsealed puts abort, its waiting requests are dropped, and its
GPU events are forgotten (Note [events of dead processes] in devices.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from ...common import host
from ...common.errors import CapacityError, InvalidRequest, ProtocolError, SessionUnknown
from ...common.protocol import PROTOCOL_VERSION, Request
from ..store.parking import ParkingLot
from ..store.records import Peer, Session, StoredObject
from ..store.registry import Registry

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.25  # asked of clients the broker cannot watch
HEARTBEAT_TIMEOUT = 1.0  # silence after which such a client counts as dead
RESUME_GRACE = 30.0  # how long an adopted client the broker cannot watch has to come back
MAX_SESSIONS = 16384  # sessions open at once
MAX_SESSIONS_PER_PROCESS = 1024  # of those, sessions of one process


class Comebacks(Protocol):
    """What the broker knows of the clients of a broker that died (adoption.py)."""

    def claim(self, session: Session, leases: list[tuple[int, int]], calls: list[int]) -> list[int]:
        """`session` is back, holding `leases`, with `calls` waiting: the leases lost."""

    def settle(self) -> None:
        """Every client is back or gone."""

    def drop(self, session: Session) -> None:
        """`session` is gone."""


class Sessions:
    """The broker's sessions by token, by socket route and by pidfd. `watch_fd` and
    `unwatch_fd` add a pidfd to the broker's poller and take it out."""

    def __init__(
        self,
        registry: Registry,
        adoption: Comebacks,
        lot: ParkingLot,
    ) -> None:
        self.registry, self.adoption, self.lot = registry, adoption, lot
        # Watch a pidfd (readable when its process exits) in the loop; stop watching it.
        self.watch_fd: Callable[[int], None] = lambda fd: None
        self.unwatch_fd: Callable[[int], None] = lambda fd: None
        self.by_token: dict[str, Session] = {}
        self.crashed = 0  # sessions dropped because their process died or fell silent
        self.routes: dict[bytes, Session] = {}
        # One pidfd per process, however many sessions it has: pidfd -> its sessions.
        self.pidfds: dict[int, set[Session]] = {}
        self._pidfd_of: dict[tuple[int, int | None], int] = {}  # (pid, start time) -> pidfd
        # Pidfds let go of, closed only once the loop has handled its batch of events: closed
        # at once, a number could be reused by a new pidfd within the batch and get the old
        # one's event (a live process taken for dead).
        self.to_close: list[int] = []
        self.unwatched: set[Session] = set()  # kept alive by heartbeats
        # Told before its puts end; with False when its process lives on, holding things.
        self.on_drop: Callable[[Session, bool], None] = lambda session, gone: None
        self.holds_ring: Callable[[Session], bool] = lambda session: False  # ring slots
        self.ring_held: Callable[[Session], list[int]] = lambda session: []  # their items' oids
        self.mailboxes: Any = None  # the broker's MailboxTables (members.py), named at hello

    def hello(self, route: bytes, req: Request, peer: Peer | None = None) -> dict[str, Any]:
        """`peer`: the kernel's word for the process that sent it (None: it cannot say)."""
        f = req.fields
        if f["version"] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol {f['version']}, this broker {PROTOCOL_VERSION}: "
                "install the same tensorbroker version on both sides"
            )
        token = f["session"]
        session = self.by_token.get(token)
        if session is not None and peer is not None:
            if session.uid is None:  # adopted: its first hello says whose it is
                session.uid = peer.uid
            elif peer.uid != session.uid:  # a token learnt elsewhere (Note [members])
                raise InvalidRequest(
                    f"hello: this session belongs to uid {session.uid}, not {peer.uid}: "
                    "a client says hello with a session token of its own"
                )
        resumed: dict[str, Any] = {}
        if session is not None and session.awaiting and "leases" not in f:
            raise SessionUnknown(  # its first hello must say which leases it holds
                "this broker restarted and waits for the client to say hello with its leases"
            )
        if session is not None and session.awaiting:  # back after the broker restarted
            session.awaiting, session.came_back = False, True
            lost = self.adoption.claim(session, f["leases"], f.get("calls", []))
            resumed = {"lost": lost}
            log.info("%s is back (%d leases lost)", session, len(lost))
            self._settle_if_all_back()
        elif session is not None and session.came_back and "leases" in f:
            # Said again: the answer to the first did not reach it in time (a busy machine).
            # The leases were claimed then; the client has sent nothing since.
            resumed = {"lost": [lease for lease, _ in f["leases"] if lease not in session.leases]}
            log.info("%s is back again (its first hello went unanswered)", session)
        if session is None:
            # The kernel's word for the process, never the client's claim: a session the
            # kernel cannot name (tcp://, another pid namespace) is kept by heartbeats.
            pid = None if peer is None else peer.pid
            boot, started = None, None
            if pid is not None:
                if f.get("pid") != pid:
                    log.info("hello claims pid %s; the kernel says %s", f.get("pid"), pid)
                boot, started = host.boot_id(), host.start_time(pid)
            self._check_room(pid, started)
            session = Session(token, pid, boot, started, last_seen=time.monotonic())
            session.uid = None if peer is None else peer.uid
            if not self._watch(session):
                self.unwatched.add(session)
            if self.registry.slots is not None and session.pidfd is not None:
                # Only a client whose death the broker sees gets lease slots: a region
                # freed on a missed heartbeat could be handed on while its old owner, only
                # slow, still holds and later clears slots in it.
                session.region = self.registry.slots.assign(session.uid)
            self.by_token[token] = session
            self.registry.journal.session(session)
            log.debug(
                "hello from pid %s, uid %s (%s)", session.pid, session.uid,
                "watched" if session.pidfd else "heartbeat",
            )  # fmt: skip
        if self.mailboxes is not None and session.mailbox is None and session.region is not None:
            session.mailbox = self.mailboxes.assign(session.uid)  # Note [direct handoff]
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
            "capacity": self.registry.arena.capacity,
            "resumed": bool(resumed) or "leases" not in f,
            **resumed,
            **self.shared(session),
        }

    def _check_room(self, pid: int | None, started: int | None) -> None:
        """CapacityError if a new session (of process `pid` started at `started`, if the
        kernel named one) would be one too many."""
        if self.clients >= MAX_SESSIONS:  # open ones: a closed one is only its arrays' leases
            raise CapacityError(
                f"this broker has {self.clients} sessions open, its limit: close the clients "
                "you no longer use (Client.close, or `with tb.connect() as c`)"
            )
        pidfd = None if pid is None else self._pidfd_of.get((pid, started))
        if pidfd is not None and sum(not s.closed for s in self.pidfds[pidfd]) >= (
            MAX_SESSIONS_PER_PROCESS
        ):
            raise CapacityError(
                f"process {pid} has {MAX_SESSIONS_PER_PROCESS} sessions open, the limit for "
                "one process: share one client between threads, or close the ones you no "
                "longer use"
            )

    def _watch(self, session: Session) -> bool:
        """Watch the session's process through its pidfd (one per process); False if it is
        not provably a live process on this host (then heartbeats must keep it)."""
        process = (session.pid or 0, session.start_time)
        pidfd = self._pidfd_of.get(process)
        if pidfd is None:
            pidfd = _pidfd(session.pid, session.boot_id, session.start_time)
            if pidfd is None:
                return False
            self._pidfd_of[process] = pidfd
            self.pidfds[pidfd] = set()
            self.watch_fd(pidfd)
        session.pidfd = pidfd
        self.pidfds[pidfd].add(session)
        return True

    def _unwatch(self, session: Session) -> None:
        self.unwatched.discard(session)
        pidfd, session.pidfd = session.pidfd, None
        if pidfd is None:
            return
        sessions = self.pidfds[pidfd]
        sessions.discard(session)
        if not sessions:  # the process's last session
            self.unwatch_fd(pidfd)
            del self.pidfds[pidfd], self._pidfd_of[(session.pid or 0, session.start_time)]
            self.to_close.append(pidfd)  # by the loop, after this batch (Broker._loop)

    def shared(self, session: Session | None) -> dict[str, Any]:
        """Where a client finds the directory and (if it has one) its lease-slot region."""
        out: dict[str, Any] = {}
        directory, slots = self.registry.directory, self.registry.slots
        if directory is not None:
            out["directory"] = [directory.name, directory.size]
        if slots is not None and session is not None and session.region is not None:
            out["slots"] = slots.where(session.region)  # its user's (Note [members])
        if self.mailboxes is not None and session is not None and session.mailbox is not None:
            out["mailboxes"] = self.mailboxes.where(session.mailbox)
        return out

    def bye(self, session: Session, route: bytes, req: Request) -> None:
        keep = req.fields.get("keep_leases", False) and session.pidfd is not None
        self.drop(session, keep_leases=keep)
        if session.closed and session.token in self.by_token:  # kept for its arrays
            held = [obj.oid for obj in session.leases.values() if obj.device == "cpu"]
            self.registry.journal.session_closed(session, held + self.ring_held(session))

    def exited(self, pidfd: int) -> None:
        """The process behind `pidfd` exited: drop each of its sessions."""
        for session in list(self.pidfds.get(pidfd, ())):
            self._exited(session)

    def _exited(self, session: Session) -> None:
        """Forget the GPU events of a session whose process exited, then drop it."""
        log.info("client pid %s exited: dropping %s", session.pid, session)
        if not session.closed:  # it never said bye: what it held is reclaimed
            self.crashed += 1
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
            self.registry.devices.forget(events)
        self.drop(session)

    def route_gone(self, route: bytes) -> None:
        """A lane closed (Note [lanes] in lanes.py), or a client was cut off for leaving its
        replies unread: the route's waiting requests can get no answer."""
        session = self.routes.pop(route, None)
        if session is None:
            return
        session.routes.discard(route)
        for w in self.lot.of(session):
            if w.route == route:
                self.lot.unpark(w)

    def drop(self, session: Session, keep_leases: bool = False) -> None:
        """End a session: its routes, its waiting requests, its puts and (unless kept until
        its process exits) its leases."""
        for route in session.routes:
            self.routes.pop(route, None)
        session.routes.clear()
        for w in self.lot.of(session):
            self.lot.unpark(w)
        keep = keep_leases and (
            bool(session.leases) or self.registry.writing(session) or self.registry.slotted(session)
            or self.holds_ring(session)
        )  # fmt: skip
        self.on_drop(session, not keep)
        self.adoption.drop(session)
        self.registry.drop_session(session, keep_leases=keep)
        session.closed = True
        if keep:
            return  # the pidfd drops the leases (and lost copies) when the process exits
        self._unwatch(session)
        self.by_token.pop(session.token, None)
        self.registry.journal.session_gone(session)
        if session.awaiting:
            session.awaiting = False
            self._settle_if_all_back()

    # -- adopting the sessions of a broker that died (Note [recovery] in state.py) ----------

    def adopt(self, rows: list[tuple[Any, ...]]) -> dict[str, list[int]]:
        """Keep the sessions of a broker that died whose processes still live: their lease
        slots and puts carry over, and the broker waits for them to come back (hello) with
        the leases they hold. A session whose process the broker cannot watch gets
        RESUME_GRACE to come back. The objects each closed session's arrays still hold."""
        held_by: dict[str, list[int]] = {}
        for token, pid, boot, started, region, closed, held in rows:
            session = Session(token, pid, boot, started, last_seen=time.monotonic())
            if not self._watch(session):
                if boot == host.boot_id() and pid is not None:
                    self.registry.journal.session_gone(session)  # it died, with the broker
                    continue
                self.unwatched.add(session)
            if region is not None and self.registry.slots is not None:
                self.registry.slots.keep(region)
                session.region = region
            session.closed, session.awaiting = closed, not closed
            if closed:
                held_by[token] = held
            self.by_token[token] = session
        if self.registry.slots is not None:
            self.registry.slots.clear_free()
        return held_by

    def _settle_if_all_back(self) -> None:
        if not any(s.awaiting for s in self.by_token.values()):
            self.adoption.settle()

    def drop_silent(self, now: float) -> None:
        """Drop the sessions that stopped sending heartbeats."""
        for session in list(self.unwatched):
            limit = RESUME_GRACE if session.awaiting else HEARTBEAT_TIMEOUT
            if now - session.last_seen > limit:
                log.info("%s sent no heartbeat for %.1fs: dropping it", session, limit)
                self.crashed += 1
                self.drop(session)

    @property
    def clients(self) -> int:
        return sum(1 for s in self.by_token.values() if not s.closed)

    def by_uid(self) -> dict[str, int]:
        """Open sessions by the kernel's uid of their process ("?" where it cannot say)."""
        counts: dict[str, int] = {}
        for s in self.by_token.values():
            if not s.closed:
                uid = "?" if s.uid is None else str(s.uid)
                counts[uid] = counts.get(uid, 0) + 1
        return counts

    def close_let_go(self) -> None:
        """Close the pidfds let go of during the last batch."""
        fds, self.to_close = self.to_close, []
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        self.close_let_go()
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        self._pidfd_of.clear()


def _pidfd(pid: int | None, boot: str | None, started: int | None) -> int | None:
    """A pidfd for the client process, if it is provably that process on this host."""
    if pid is None or boot != host.boot_id():
        return None
    return host.open_pidfd(pid, started)


def _label(obj: StoredObject) -> str:
    if obj.queue is not None:
        return f"an item of queue {obj.queue.name!r}"
    return f"{obj.key!r} v{obj.version}"
