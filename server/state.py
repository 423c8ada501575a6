"""The broker's state dir: who owns it, and the journal a broker that starts after a crash
adopts.

Note [recovery]

    state dir (--state-dir; default: next to the socket)      /dev/shm
    ├── lock       flock'ed by the live broker; "pid start"   ├── tb-<id>-<hex>  arena segments
    └── journal    msgpack records: meta, segments, objects,  ├── tb-<id>-<hex>  directory
                   queues, sessions, versions                 ├── tb-<id>-<hex>  lease slots
                                                              └── tb-<id>.owner  flock'ed too;
                                                                  names the state dir

The bytes of every object are in shared memory, which outlives the broker; the journal says
what they are. The broker writes a record before it answers the request that made the change
(a grant, a seal, a delete, a queue hand-over, a free), so whatever a client was told is in
the journal when the broker dies, and whatever is not there was never acknowledged. The
records of one batch of requests go out in one write() (Broker._drain), and the replies
after it: a killed process loses nothing that write() handed to the kernel (a host crash
loses /dev/shm anyway), and a record cut short by a kill ends the journal where it starts.

Each record states a row as it now is (or that it is gone), so reading the journal back is
replaying it, and replaying a record twice changes nothing. The broker keeps the rows it
wrote; when the journal has grown to 4x what they take, it writes them as a new journal
aside and renames it over the old one (`_compact`), so a crash leaves one whole journal.
(SQLite cost 60-90 us per small put here, in three statements and a commit; a record
costs a few.)

Who owns a state is decided by the lock alone, never by pids (a pid means nothing in
another container's namespace): a starting broker takes the lock or refuses to start, and
only the lock holder touches the state's segments. A broker that takes the lock of a state
whose owner died adopts it (Broker._adopt in broker.py): it maps the segments, rebuilds
the registry, the allocator and the queues from the rows, keeps the sessions whose
processes still live (so their lease slots and their puts carry over), and waits for
them to say hello again with the leases they hold before it frees anything retired.

The owner file (tb-<id>.owner, beside the segments) lets a live state be told from a dead
one with /dev/shm alone, for `tensorbroker gc` (leftovers.py): the state dir may be out of
sight (in another container sharing /dev/shm, or removed by a /tmp cleaner while its broker
runs). The broker holds a flock on it as on the lock, from before it makes or adopts a
segment until it exits; it names the state dir, and a broker that stops and keeps its
state for the next one (--state-dir) adds a line "kept", which gc heeds. A gc holds it
while it removes a dead state, so a broker adopting that state waits, then finds what is
gone. `discard` removes it after the segments.

What is not journaled: leases (each client says which it holds when it comes back; the
slots of direct reads are in shared memory already) and device objects (their memory dies
with the broker's CUDA context).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..common import host
from ..common.errors import BrokerError

log = logging.getLogger(__name__)

LAYOUT = 2  # of the journal and of the shared-memory structures it names
JOURNAL = "journal"
OWNER = ".owner"  # tb-<id>.owner: Note [recovery]
KEPT = "kept"  # the owner file's second line once a broker stopped and kept its state
CLAIM_WAIT = 10.0  # seconds a starting broker waits for a gc holding its owner file
COMPACT_FROM = 8 << 20  # the journal is rewritten once it is this big and 4x its rows
ID_STEP = 1 << 20  # ids are reserved in the journal this many at a time
PENDING, LIVE, RETIRED = 0, 1, 2  # an object row's state


class StateError(BrokerError):
    """The state dir cannot be used (owned by a live broker, incompatible, not writable)."""

    code = "unavailable"


@dataclass
class Row:
    """One journaled object."""

    oid: int
    key: str
    version: int
    state: int
    bundle: bool
    segment: str
    offset: int
    size: int
    wire: list[Any]
    queue: int | None
    session: str
    put: int
    taker: str | None
    took: int | None
    evictable: bool = False  # journals before it have 14 fields
    # An item of a broadcast queue (Note [broadcast] in queues.py): the subscriptions not yet
    # given it, and [session, request] of each get it was given to.
    unseen: list[int] | None = None
    gives: list[list[Any]] = field(default_factory=list)


@dataclass
class Recovered:
    """What a broker reads back from the state of one that died."""

    owner: str  # "pid N" of the broker that wrote it
    segments: dict[str, tuple[int, str]]  # name -> size, kind
    meta: dict[str, Any]
    objects: list[Row] = field(default_factory=list)
    # id, name, maxsize, closed, sealed, removed, subscriptions ([sub, session], and its ring
    # bit and first version if it has one; sub None: one that ended, whose process holds
    # what it took; None: not a broadcast queue), ring segment or None
    queues: list[tuple[int, str, int, bool, int, bool, list[list[Any]] | None, str | None]] = field(
        default_factory=list
    )
    sessions: list[tuple[str, int | None, str | None, int | None, int | None, bool, list[int]]] = (
        field(default_factory=list)
    )
    versions: dict[str, int] = field(default_factory=dict)


class Journal:
    """What the broker tells its state as it changes. This base keeps nothing (a registry
    made without a state, in unit tests); `State` writes it down."""

    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def segment(self, name: str, size: int, kind: str) -> None: ...
    def segment_gone(self, name: str) -> None: ...
    def meta(self, name: str, value: Any) -> None: ...
    def granted(self, obj: Any, token: str, put: int) -> None: ...
    def sealed(self, obj: Any) -> None: ...
    def given(self, obj: Any, unseen: set[int], taker: str | None, took: int | None) -> None: ...
    def retired(self, obj: Any, taker: str | None = None, took: int | None = None) -> None: ...
    def freed(self, obj: Any) -> None: ...
    def key_deleted(self, key: str, version: int) -> None: ...
    def queue(self, q: Any) -> None: ...
    def queue_gone(self, q: Any) -> None: ...
    def session(self, s: Any) -> None: ...
    def session_closed(self, s: Any, held: list[int]) -> None: ...
    def session_gone(self, s: Any) -> None: ...


def owner_path(shm_dir: str, state_id: str) -> str:
    """The owner file of state `state_id` (Note [recovery])."""
    return os.path.join(shm_dir, f"tb-{state_id}{OWNER}")


def read_journal(path: str) -> Recovered | None:
    """Replay the journal in the state dir `path` (None: there is none). ValueError if it
    cannot be read."""
    try:
        with open(os.path.join(path, JOURNAL), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data) + 1)
    unpacker.feed(data)
    meta: dict[str, Any] = {}
    segments: dict[str, tuple[int, str]] = {}
    rows: dict[int, list[Any]] = {}
    queues: dict[int, list[Any]] = {}
    sessions: dict[str, list[Any]] = {}
    versions: dict[str, int] = {}
    try:
        for record in unpacker:  # a record cut short at the end stops the loop
            kind = record[0]
            if kind == "obj":
                rows[record[1][0]] = record[1]
            elif kind == "obj-":
                rows.pop(record[1], None)
            elif kind == "q":
                queues[record[1][0]] = record[1]
            elif kind == "q-":
                queues.pop(record[1], None)
            elif kind == "ses":
                sessions[record[1][0]] = record[1]
            elif kind == "ses-":
                sessions.pop(record[1], None)
            elif kind == "seg":
                segments[record[1]] = (record[2], record[3])
            elif kind == "seg-":
                segments.pop(record[1], None)
            elif kind == "meta":
                meta[record[1]] = record[2]
            elif kind == "ver":
                versions[record[1]] = record[2]
            elif kind == "head":
                meta["layout"], meta["id"] = record[1], record[2]
            else:
                raise ValueError(f"unknown record {kind!r:.40}")
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # msgpack's are ValueErrors
        raise ValueError(f"record {len(rows)}: {type(exc).__name__}: {exc}") from None
    out = Recovered(str(meta.get("owner", "?")), segments, meta)
    out.objects = [Row(*rows[oid]) for oid in sorted(rows)]
    # Older journals: 5 fields, or 6 for a queue removed (qdelete) while consumers held items,
    # or 7 before broadcast rings.
    out.queues = [
        (i, n, m, bool(c), s, bool(r and r[0]), r[1] if len(r) > 1 else None,
         r[2] if len(r) > 2 else None)
        for i, n, m, c, s, *r in queues.values()
    ]  # fmt: skip
    out.sessions = [(t, p, b, st, rg, bool(c), h) for t, p, b, st, rg, c, h in sessions.values()]
    out.versions = versions
    return out


def _ringed(q: Any, sub: int) -> list[int]:
    """A subscription's bit in its queue's ring and the first version it takes; none if it
    reads through messages."""
    ring = q.ring
    if ring is None or sub not in ring.bits:
        return []
    return [ring.bits[sub], ring.starts[sub]]


class State(Journal):
    """The state dir `path`, locked for this process's life. `recovered` is what a broker
    that died left there (None: a new state). StateError says why it cannot be used."""

    def __init__(self, path: str, *, reset: bool = False, shm_dir: str = "/dev/shm") -> None:
        self.path = path
        self.shm_dir = shm_dir
        self._lock_fd = self._fd = self._owner_fd = -1
        self.recovered: Recovered | None = None
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._out: list[tuple[Any, ...]] = []  # records not written yet
        self._batching = False
        self._written = self._snapshot = 0  # bytes: the journal, and it when last rewritten
        # The rows as they are now: what a rewrite of the journal writes.
        self._meta: dict[str, Any] = {}
        self._segments: dict[str, tuple[int, str]] = {}
        self._rows: dict[int, list[Any]] = {}
        self._queues: dict[int, tuple[Any, ...]] = {}
        self._sessions: dict[str, tuple[Any, ...]] = {}
        self._versions: dict[str, int] = {}
        self._lock()
        try:
            if reset:
                discard(path, shm_dir, locked=True, keep_lock=True)
            else:
                self.recovered = self._read()
            found = self.recovered
            if found is None:
                self.id = secrets.token_hex(4)
                self._meta = {"layout": LAYOUT, "id": self.id}
                self._claim()
            else:
                self.id = str(found.meta["id"])
                self._claim()
                self._check_segments(found)  # a gc may have removed them as we waited
                self._meta, self._segments = dict(found.meta), dict(found.segments)
                self._rows = {r.oid: list(vars(r).values()) for r in found.objects}
                self._queues = {q[0]: q for q in found.queues}
                self._sessions = {s[0]: s for s in found.sessions}
                self._versions = dict(found.versions)
            self._meta["owner"] = f"pid {os.getpid()}"
            self._compact()  # a journal of this broker's own, from what was found
        except BaseException:
            self.close(keep=True)
            raise

    @property
    def prefix(self) -> str:
        """The names of this state's segments start with this."""
        return f"tb-{self.id}-"

    # -- the lock --------------------------------------------------------------------------

    def _lock(self) -> None:
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateError(
                f"cannot use the state dir {self.path}: {exc.strerror}. Choose a directory this "
                "user can write with --state-dir, or fix its permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").split()
            os.close(fd)
            who = f" (pid {owner[0]})" if owner else ""
            raise StateError(
                f"the state dir {self.path} belongs to a running broker{who}: stop it, or "
                "give this one another --state-dir (and --address)"
            ) from None
        if not os.access(self.path, os.W_OK):
            os.close(fd)
            raise StateError(
                f"the state dir {self.path} is not writable: choose another --state-dir, or "
                "fix its permissions"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {host.start_time(os.getpid())}\n".encode(), 0)
        self._lock_fd = fd

    def _claim(self) -> None:
        """Hold the owner file of this state's segments for this process's life, and write
        the state dir in it (Note [recovery]). A gc that holds it (removing the state of a
        dead broker, which this one adopts) is waited for; a live broker on a copy of this
        state dir, whose segments these are too, is refused (StateError)."""
        path = owner_path(self.shm_dir, self.id)
        deadline = time.monotonic() + CLAIM_WAIT
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                raise StateError(
                    f"cannot make {path}, the owner file of this broker's segments: "
                    f"{exc.strerror}. Remove it if it is not a file of yours, or check "
                    f"{self.shm_dir}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    raise StateError(
                        f"the segments of the state in {self.path} ({path}) belong to a running "
                        "broker: one started on a copy of this state dir? Stop it, or start "
                        "this one with --reset"
                    ) from None
                time.sleep(0.01)
                continue
            try:
                same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:  # removed as we waited: by a gc done with it
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.path.abspath(self.path)}\n".encode(), 0)
        self._owner_fd = fd

    # -- reading back ----------------------------------------------------------------------

    def _read(self) -> Recovered | None:
        try:
            found = read_journal(self.path)
        except (OSError, ValueError) as exc:
            raise self._unusable(f"its journal cannot be read ({exc})") from None
        if found is None:
            if os.path.exists(os.path.join(self.path, "state.db")):
                raise self._unusable("it was written by layout 1 (an older tensorbroker)")
            return None
        layout = found.meta.get("layout")
        if layout != LAYOUT:
            raise self._unusable(
                f"it was written by layout {layout!r} and this broker reads "
                f"layout {LAYOUT} (another tensorbroker version)"
            )
        self._check_segments(found)
        return found

    def _check_segments(self, found: Recovered) -> None:
        segments = found.segments
        missing = [n for n in segments if not os.path.exists(os.path.join(self.shm_dir, n))]
        if missing:
            raise self._unusable(
                f"{len(missing)} of its {len(segments)} shared-memory segments are gone from "
                f"{self.shm_dir} (removed by hand or by `tensorbroker gc`, or /dev/shm was not "
                f"kept: {missing[0]}, ...)"
            )

    def _unusable(self, why: str) -> StateError:
        return StateError(
            f"cannot adopt the state in {self.path}: {why}. Start with --reset to discard it "
            "(its objects are lost), or point --state-dir elsewhere"
        )

    # -- the journal ---------------------------------------------------------------------

    def begin(self) -> None:
        """Group the records up to `commit` into one write (a batch of requests)."""
        self._batching = True

    def commit(self) -> None:
        self._batching = False
        if self._out:
            self._flush()

    def _put(self, record: tuple[Any, ...]) -> None:
        self._out.append(record)
        if not self._batching:
            self._flush()

    def _flush(self) -> None:
        pack = self._pack
        data = b"".join([pack(r) for r in self._out])
        self._out.clear()
        os.write(self._fd, data)
        self._written += len(data)
        if self._written > max(COMPACT_FROM, 4 * self._snapshot):
            self._compact()

    def segment(self, name: str, size: int, kind: str) -> None:
        self._segments[name] = (size, kind)
        self._put(("seg", name, size, kind))

    def segment_gone(self, name: str) -> None:
        self._segments.pop(name, None)
        self._put(("seg-", name))

    def meta(self, name: str, value: Any) -> None:
        self._meta[name] = value
        self._put(("meta", name, value))

    def granted(self, obj: Any, token: str, put: int) -> None:
        b, q = obj.block, obj.queue  # gives: (), not a list of its own in every row
        row = [obj.oid, obj.key, 0, PENDING, obj.bundle, b.segment, b.offset, b.size, obj.wire,
               q.id if q is not None else None, token, put, None, None,
               False, None, ()]  # fmt: skip
        self._rows[obj.oid] = row
        self._put(("obj", row))

    def sealed(self, obj: Any) -> None:
        row = self._rows[obj.oid]  # key, tensors and queue as sealed (a grant has none before)
        q = obj.queue
        row[1:5] = [obj.key, obj.version, LIVE, obj.bundle]
        row[8:10] = [obj.wire, q.id if q is not None else None]
        row[14] = obj.evictable
        self._put(("obj", row))
        if q is not None:
            self._queue_row(q)

    def given(self, obj: Any, unseen: set[int], taker: str | None, took: int | None) -> None:
        """A broadcast item was published (`taker` None) or given to get `took` of `taker`:
        the subscriptions still to be given it."""
        row = self._rows.get(obj.oid)
        if row is None:  # a device item: not journaled
            return
        row[15] = sorted(unseen)
        if taker is not None:
            row[16] = [*row[16], [taker, took]]
        self._put(("obj", row))

    def retired(self, obj: Any, taker: str | None = None, took: int | None = None) -> None:
        row = self._rows[obj.oid]
        row[3], row[12], row[13] = RETIRED, taker, took
        self._put(("obj", row))

    def freed(self, obj: Any) -> None:
        if self._rows.pop(obj.oid, None) is not None:
            self._put(("obj-", obj.oid))

    def key_deleted(self, key: str, version: int) -> None:
        self._versions[key] = version
        self._put(("ver", key, version))

    def queue(self, q: Any) -> None:
        self._queue_row(q)

    def _queue_row(self, q: Any) -> None:
        subs = None if q.subs is None else [[k, s.token, *_ringed(q, k)] for k, s in q.subs.items()]
        if q.ring is not None and subs is not None:  # ended; their items held until they exit
            subs += [[None, s.token, bit, 0] for bit, s in q.ring.parted.items()]
        ring = None if q.ring is None else q.ring.name
        row = (q.id, q.name, q.maxsize, q.closed, q.sealed, q.removed, subs, ring)
        self._queues[q.id] = row
        self._put(("q", row))

    def queue_gone(self, q: Any) -> None:
        self._queues.pop(q.id, None)
        self._put(("q-", q.id))

    def session(self, s: Any) -> None:
        self._session_row((s.token, s.pid, s.boot_id, s.start_time, s.region, False, []))

    def session_closed(self, s: Any, held: list[int]) -> None:
        old = self._sessions.get(s.token)
        if old is not None:
            self._session_row((*old[:5], True, held))

    def _session_row(self, row: tuple[Any, ...]) -> None:
        self._sessions[row[0]] = row
        self._put(("ses", row))

    def session_gone(self, s: Any) -> None:
        if self._sessions.pop(s.token, None) is not None:
            self._put(("ses-", s.token))

    def _compact(self) -> None:
        """Rewrite the journal as the records of the state now (the old one has every
        change since): written aside, then renamed over it, so a crash keeps one whole."""
        records: list[tuple[Any, ...]] = [("head", LAYOUT, self.id)]
        records += [("meta", n, v) for n, v in self._meta.items()]
        records += [("seg", n, size, kind) for n, (size, kind) in self._segments.items()]
        records += [("obj", row) for row in self._rows.values()]
        records += [("q", row) for row in self._queues.values()]
        records += [("ses", row) for row in self._sessions.values()]
        records += [("ver", k, v) for k, v in self._versions.items()]
        data = b"".join(self._pack(r) for r in records)
        journal = os.path.join(self.path, JOURNAL)
        aside = journal + ".new"
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
            os.rename(aside, journal)
        except BaseException:
            os.close(fd)
            raise
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._written, self._snapshot = fd, len(data), len(data)

    # -- closing ---------------------------------------------------------------------------

    def close(self, keep: bool) -> None:
        """Close the journal and let go of the lock; unless `keep`, remove the state (the
        caller unlinked its segments). Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                if self._out:
                    self._flush()
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            if not keep:
                discard(self.path, self.shm_dir, locked=True)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._owner_fd >= 0:  # after the state: a gc may take it from here
            if not keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(owner_path(self.shm_dir, self.id))
            else:  # kept on purpose: gc leaves it unless named (a crash never writes this)
                with contextlib.suppress(OSError):
                    os.pwrite(
                        self._owner_fd, f"{KEPT}\n".encode(), os.fstat(self._owner_fd).st_size
                    )
            os.close(self._owner_fd)
            self._owner_fd = -1


def discard(
    path: str, shm_dir: str = "/dev/shm", *, locked: bool = False, keep_lock: bool = False
) -> list[str]:
    """Remove the state in `path` and the segments it names (its objects are lost); the
    segments removed. Unless the caller holds its lock (`locked`), the lock is taken first,
    and StateError says so if a live broker holds it. `keep_lock`: the caller goes on
    with an empty state (--reset), so the lock file and the dir stay."""
    fd = -1
    if not locked:
        try:
            fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
        except FileNotFoundError:
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateError(f"the state dir {path} belongs to a running broker") from None
    removed: list[str] = []
    try:
        names: list[str] = []
        prefix = sid = ""
        with contextlib.suppress(OSError, ValueError):
            found = read_journal(path)
            if found is not None:
                names = list(found.segments)
                sid = str(found.meta.get("id", ""))
                prefix = f"tb-{sid}-" if sid else ""
        if prefix:  # and the ones made but not journaled when it died
            with contextlib.suppress(FileNotFoundError):
                names += [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
        for name in sorted(set(names)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
        if sid:  # after its segments (Note [recovery])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(owner_path(shm_dir, sid))
        for name in (JOURNAL, JOURNAL + ".new", *(() if keep_lock else ("lock",))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        if not keep_lock:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only if nothing else is in it
    finally:
        if fd >= 0:
            os.close(fd)
    if removed:
        log.info("removed the state in %s and its %d segments", path, len(removed))
    return removed
