"""The broker's state dir: who owns it, and the journal a broker that starts after a crash
adopts.

Note [recovery]

    state dir (--state-dir; default: next to the socket)      /dev/shm
    ├── lock       flock'ed by the live broker; "pid start"   ├── tb-<id>-<hex>  arena segments
    └── state.db   SQLite: meta, segments, objects, queues,   ├── tb-<id>-<hex>  directory
                   sessions, versions                         └── tb-<id>-<hex>  lease slots

The bytes of every object are in shared memory, which outlives the broker; the journal says
what they are. The broker writes a row before it answers the request that made the change
(a grant, a seal, a delete, a queue hand-over, a free), so whatever a client was told is in
the journal when the broker dies, and whatever is not there was never acknowledged.
SQLite runs with synchronous=OFF: a killed process loses nothing that write() handed to
the kernel; a host crash loses /dev/shm anyway.

Who owns a state is decided by the lock alone, never by pids (a pid means nothing in
another container's namespace): a starting broker takes the lock or refuses to start, and
only the lock holder touches the state's segments. A broker that takes the lock of a state
whose owner died adopts it (Broker._adopt in broker.py): it maps the segments, rebuilds
the registry, the allocator and the queues from the rows, keeps the sessions whose
processes still live (so their lease slots and their puts carry over), and waits for
them to say hello again with the leases they hold before it frees anything retired.

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
import sqlite3
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..common import host
from ..common.errors import BrokerError

log = logging.getLogger(__name__)

LAYOUT = 1  # of the journal and of the shared-memory structures it names
ID_STEP = 1 << 20  # ids are reserved in the journal this many at a time
PENDING, LIVE, RETIRED = 0, 1, 2  # an object row's state

_SCHEMA = """
create table meta(name text primary key, value);
create table segments(name text primary key, size integer, kind text);
create table objects(oid integer primary key, key text, version integer, state integer,
    bundle integer, segment text, offset integer, size integer, wire blob, queue integer,
    session text, put integer, taker text, took integer);
create table queues(id integer primary key, name text, maxsize integer, closed integer,
    sealed integer);
create table sessions(token text primary key, pid integer, boot_id text, start_time integer,
    region integer, closed integer, held blob);
create table versions(key text primary key, version integer);
"""


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


@dataclass
class Recovered:
    """What a broker reads back from the state of one that died."""

    owner: str  # "pid N" of the broker that wrote it
    segments: dict[str, tuple[int, str]]  # name -> size, kind
    meta: dict[str, Any]
    objects: list[Row] = field(default_factory=list)
    queues: list[tuple[int, str, int, bool, int]] = field(default_factory=list)
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
    def retired(self, obj: Any, taker: str | None = None, took: int | None = None) -> None: ...
    def freed(self, obj: Any) -> None: ...
    def key_deleted(self, key: str, version: int) -> None: ...
    def queue(self, q: Any) -> None: ...
    def queue_gone(self, q: Any) -> None: ...
    def session(self, s: Any) -> None: ...
    def session_closed(self, s: Any, held: list[int]) -> None: ...
    def session_gone(self, s: Any) -> None: ...


class State(Journal):
    """The state dir `path`, locked for this process's life. `recovered` is what a broker
    that died left there (None: a new state). StateError says why it cannot be used."""

    def __init__(self, path: str, *, reset: bool = False, shm_dir: str = "/dev/shm") -> None:
        self.path = path
        self.shm_dir = shm_dir
        self._lock_fd = -1
        self._db: sqlite3.Connection | None = None
        self.recovered: Recovered | None = None
        self._lock()
        try:
            db_path = os.path.join(path, "state.db")
            if reset:
                discard(path, shm_dir, locked=True, keep_lock=True)
            elif os.path.exists(db_path):
                self.recovered = self._read(db_path)
            if self.recovered is None:
                self.id = secrets.token_hex(4)
                self._db = self._create(db_path)
            else:
                self.id = str(self.recovered.meta["id"])
                self._db = self._open(db_path)
            self.meta("owner", f"pid {os.getpid()}")
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

    # -- reading back ----------------------------------------------------------------------

    def _read(self, db_path: str) -> Recovered:
        try:
            db = sqlite3.connect(db_path, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._unusable(f"its journal cannot be opened ({exc})") from None
        try:
            meta = dict(db.execute("select name, value from meta"))
            if meta.get("layout") != LAYOUT:
                raise self._unusable(
                    f"it was written by layout {meta.get('layout')!r} and this broker reads "
                    f"layout {LAYOUT} (another tensorbroker version)"
                )
            segments = {n: (s, k) for n, s, k in db.execute("select * from segments")}
            missing = [n for n in segments if not os.path.exists(os.path.join(self.shm_dir, n))]
            if missing:
                raise self._unusable(
                    f"{len(missing)} of its {len(segments)} shared-memory segments are gone from "
                    f"{self.shm_dir} (removed by hand, or /dev/shm was not kept: {missing[0]}, ...)"
                )
            unpack = msgpack.unpackb
            out = Recovered(str(meta.get("owner", "?")), segments, meta)
            for r in db.execute("select * from objects order by oid"):
                out.objects.append(
                    Row(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7], unpack(r[8]),
                        r[9], r[10], r[11], r[12], r[13])
                )  # fmt: skip
            out.queues = [
                (i, n, m, bool(c), s) for i, n, m, c, s in db.execute("select * from queues")
            ]
            out.sessions = [
                (t, p, b, st, rg, bool(c), unpack(h) if h else [])
                for t, p, b, st, rg, c, h in db.execute("select * from sessions")
            ]
            out.versions = dict(db.execute("select key, version from versions"))
            return out
        except sqlite3.Error as exc:
            raise self._unusable(f"its journal cannot be read ({exc})") from None
        finally:
            db.close()

    def _unusable(self, why: str) -> StateError:
        return StateError(
            f"cannot adopt the state in {self.path}: {why}. Start with --reset to discard it "
            "(its objects are lost), or point --state-dir elsewhere"
        )

    def _create(self, db_path: str) -> sqlite3.Connection:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(db_path + suffix)
        db = self._open(db_path)
        db.executescript(_SCHEMA)
        db.executemany("insert into meta values (?, ?)", [("layout", LAYOUT), ("id", self.id)])
        return db

    @staticmethod
    def _open(db_path: str) -> sqlite3.Connection:
        db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        db.execute("pragma journal_mode=wal")
        db.execute("pragma synchronous=off")  # a killed process loses nothing written
        return db

    # -- the journal -----------------------------------------------------------------------

    def begin(self) -> None:
        """Group the writes up to `commit` into one transaction (a batch of requests)."""
        assert self._db is not None
        self._db.execute("begin")

    def commit(self) -> None:
        assert self._db is not None
        self._db.execute("commit")

    def _x(self, sql: str, args: tuple[Any, ...] = ()) -> None:
        assert self._db is not None
        self._db.execute(sql, args)

    def segment(self, name: str, size: int, kind: str) -> None:
        self._x("insert or replace into segments values (?, ?, ?)", (name, size, kind))

    def segment_gone(self, name: str) -> None:
        self._x("delete from segments where name = ?", (name,))

    def meta(self, name: str, value: Any) -> None:
        self._x("insert or replace into meta values (?, ?)", (name, value))

    def granted(self, obj: Any, token: str, put: int) -> None:
        b = obj.block
        self._x(
            "insert into objects values (?, ?, 0, 0, ?, ?, ?, ?, ?, ?, ?, ?, null, null)",
            (obj.oid, obj.key, obj.bundle, b.segment, b.offset, b.size,
             msgpack.packb(obj.wire), obj.queue.id if obj.queue is not None else None,
             token, put),
        )  # fmt: skip

    def sealed(self, obj: Any) -> None:
        self._x("update objects set state = 1, version = ? where oid = ?", (obj.version, obj.oid))
        if obj.queue is not None:
            self._x("update queues set sealed = ? where id = ?", (obj.queue.sealed, obj.queue.id))

    def retired(self, obj: Any, taker: str | None = None, took: int | None = None) -> None:
        self._x(
            "update objects set state = 2, taker = ?, took = ? where oid = ?",
            (taker, took, obj.oid),
        )

    def freed(self, obj: Any) -> None:
        self._x("delete from objects where oid = ?", (obj.oid,))

    def key_deleted(self, key: str, version: int) -> None:
        self._x("insert or replace into versions values (?, ?)", (key, version))

    def queue(self, q: Any) -> None:
        self._x(
            "insert or replace into queues values (?, ?, ?, ?, ?)",
            (q.id, q.name, q.maxsize, q.closed, q.sealed),
        )

    def queue_gone(self, q: Any) -> None:
        self._x("delete from queues where id = ?", (q.id,))

    def session(self, s: Any) -> None:
        self._x(
            "insert or replace into sessions values (?, ?, ?, ?, ?, 0, null)",
            (s.token, s.pid, s.boot_id, s.start_time, s.region),
        )

    def session_closed(self, s: Any, held: list[int]) -> None:
        self._x(
            "update sessions set closed = 1, held = ? where token = ?",
            (msgpack.packb(held), s.token),
        )

    def session_gone(self, s: Any) -> None:
        self._x("delete from sessions where token = ?", (s.token,))

    # -- closing ---------------------------------------------------------------------------

    def close(self, keep: bool) -> None:
        """Close the journal and let go of the lock; unless `keep`, remove the state (the
        caller unlinked its segments). Idempotent."""
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock_fd >= 0:
            if not keep:
                discard(self.path, self.shm_dir, locked=True)
            os.close(self._lock_fd)
            self._lock_fd = -1


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
        db_path = os.path.join(path, "state.db")
        names: list[str] = []
        prefix = ""
        if os.path.exists(db_path):
            with contextlib.suppress(sqlite3.Error):
                db = sqlite3.connect(db_path)
                try:
                    names = [n for (n,) in db.execute("select name from segments")]
                    row = db.execute("select value from meta where name = 'id'").fetchone()
                    prefix = f"tb-{row[0]}-" if row else ""
                finally:
                    db.close()
        if prefix:  # and the ones made but not journaled when it died
            with contextlib.suppress(FileNotFoundError):
                names += [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
        for name in sorted(set(names)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
        for name in ("state.db", "state.db-wal", "state.db-shm", *(() if keep_lock else ("lock",))):
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
