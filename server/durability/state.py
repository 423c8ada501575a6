"""The broker's state dir: who owns it (the lock and the owner file), what a broker that
starts after a crash finds there, and removing it (`discard`). Its journal: journal.py.

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
records of one batch of requests go out in one write() (outbox.py), and the replies
after it: a killed process loses nothing that write() handed to the kernel (a host crash
loses /dev/shm anyway), and a record cut short by a kill ends the journal where it starts.

How records are written, read back and compacted: journal.py.

Who owns a state is decided by the lock alone, never by pids (a pid means nothing in
another container's namespace): a starting broker takes the lock or refuses to start, and
only the lock holder touches the state's segments. A broker that takes the lock of a state
whose owner died adopts it (adoption.py): it maps the segments, rebuilds
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
import time

from ...common import host
from ...common.errors import BrokerError
from .journal import JOURNAL, LAYOUT, JournalFile, Recovered, read_journal

log = logging.getLogger(__name__)

REQUIRED = ("arena", "slots")  # segment kinds without which a state is refused

OWNER = ".owner"  # tb-<id>.owner: Note [recovery]
KEPT = "kept"  # the owner file's second line once a broker stopped and kept its state
CLAIM_WAIT = 10.0  # seconds a starting broker waits for a gc holding its owner file


class StateError(BrokerError):
    """The state dir cannot be used (owned by a live broker, incompatible, not writable)."""

    code = "unavailable"


def owner_path(shm_dir: str, state_id: str) -> str:
    """The owner file of state `state_id` (Note [recovery])."""
    return os.path.join(shm_dir, f"tb-{state_id}{OWNER}")


class State:
    """The state dir `path`, locked for this process's life, and its `journal`. `recovered`
    is what a broker that died left there (None: a new state). StateError says why it cannot
    be used."""

    def __init__(self, path: str, *, reset: bool = False, shm_dir: str = "/dev/shm") -> None:
        self.path = path
        self.shm_dir = shm_dir
        self._lock_fd = self._owner_fd = -1
        self.recovered: Recovered | None = None
        self.journal: JournalFile | None = None
        self._lock()
        try:
            if reset:
                discard(path, shm_dir, locked=True, keep_lock=True)
            else:
                self.recovered = self._read()
            found = self.recovered
            self.id = os.urandom(4).hex() if found is None else str(found.meta["id"])
            self._claim()
            if found is not None:
                self._check_segments(found)  # a gc may have removed them as we waited
            self.journal = JournalFile(path, self.id, found)
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
        """The arena and the lease slots are the state: without one of them it is refused.
        A part that is gone (a queue's ring, the directory, the mailboxes) is dropped with
        what only it held, and the rest is adopted."""
        segments = found.segments
        missing = [n for n in segments if not os.path.exists(os.path.join(self.shm_dir, n))]
        for name in [n for n in missing if segments[n][1] not in REQUIRED]:
            log.error(
                "the %s segment %s of the state is gone from %s: what only it held is lost",
                segments[name][1], name, self.shm_dir,
            )  # fmt: skip
            missing.remove(name)
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

    # -- closing ---------------------------------------------------------------------------

    def close(self, keep: bool) -> None:
        """Close the journal and let go of the lock; unless `keep`, remove the state (the
        caller unlinked its segments). Idempotent."""
        if self.journal is not None:
            self.journal.close()
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
