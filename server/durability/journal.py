"""The journal: what the broker writes down as its state changes, and reading it back.

Each record states a row as it now is (or that it is gone), so reading the journal back is
replaying it, and replaying a record twice changes nothing. The broker writes a record before
it answers the request that made the change (Note [recovery] in state.py); the records of one
batch of requests go out in one write() (`begin`, `commit`). `JournalFile` keeps the rows it
wrote; when the journal has grown to 4x what they take, it writes them as a new journal aside
and renames it over the old one (`_compact`), so a crash leaves one whole journal. (SQLite
cost 60-90 us per small put here, in three statements and a commit; a record costs a few.)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import msgpack

LAYOUT = 2  # of the journal and of the shared-memory structures it names
JOURNAL = "journal"  # its file in the state dir
COMPACT_FROM = 8 << 20  # the journal is rewritten once it is this big and 4x its rows
ID_STEP = 1 << 20  # ids are reserved in the journal this many at a time
PENDING, LIVE, RETIRED = 0, 1, 2  # an object row's state


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
    # An item of a broadcast queue (Note [broadcast] in subscriptions.py): the subscriptions not yet
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
    def returned(self, obj: Any) -> None: ...
    def freed(self, obj: Any) -> None: ...
    def key_deleted(self, key: str, version: int) -> None: ...
    def queue(self, q: Any) -> None: ...
    def queue_gone(self, q: Any) -> None: ...
    def session(self, s: Any) -> None: ...
    def session_closed(self, s: Any, held: list[int]) -> None: ...
    def session_gone(self, s: Any) -> None: ...


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


class JournalFile(Journal):
    """The journal of the state dir `path` (its segments' names start with tb-`state_id`-),
    started from what a broker that died left there (`found`; None: a new state)."""

    def __init__(self, path: str, state_id: str, found: Recovered | None) -> None:
        self.path, self.id = path, state_id
        self._fd = -1
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._out: list[tuple[Any, ...]] = []  # records not written yet
        self._batching = False
        self._written = self._snapshot = 0  # bytes: the journal, and it when last rewritten
        # The rows as they are now: what a rewrite of the journal writes.
        self._meta: dict[str, Any] = {"layout": LAYOUT, "id": state_id}
        self._segments: dict[str, tuple[int, str]] = {}
        self._rows: dict[int, list[Any]] = {}
        self._queues: dict[int, tuple[Any, ...]] = {}
        self._sessions: dict[str, tuple[Any, ...]] = {}
        self._versions: dict[str, int] = {}
        if found is not None:
            self._meta, self._segments = dict(found.meta), dict(found.segments)
            self._rows = {r.oid: list(vars(r).values()) for r in found.objects}
            self._queues = {q[0]: q for q in found.queues}
            self._sessions = {s[0]: s for s in found.sessions}
            self._versions = dict(found.versions)
        self._meta["owner"] = f"pid {os.getpid()}"
        self._compact()  # a journal of this broker's own, from what was found

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

    def returned(self, obj: Any) -> None:
        """A queue item given back untaken: waiting in its queue again."""
        row = self._rows.get(obj.oid)
        if row is not None:
            row[3], row[12], row[13] = LIVE, None, None
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
        if q.qring is not None:
            ring = q.qring.row()
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

    def close(self) -> None:
        """Write what is left and close the file. Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                if self._out:
                    self._flush()
            os.close(self._fd)
            self._fd = -1
