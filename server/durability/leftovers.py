"""`tensorbroker gc`: remove the shared memory of brokers that are no longer running.

A broker that is killed (SIGKILL, the OOM killer, a host of containers torn down) and never
started again on its state leaves its segments in /dev/shm, where they take memory until
`serve --reset` on the same state dir. `collect` finds them without being told where that
state dir is, and never touches a live broker's, whatever its state dir and wherever it runs.

How it tells (Note [recovery] in state.py). Every file of a state in /dev/shm is named
tb-<state id>-<hex> (SEGMENT_NAME); beside them is the state's owner file, tb-<id>.owner,
which names the state dir and on which the broker holding the state keeps a flock from before
it makes its first segment until it exits. A flock, not a pid: it is seen from every
container that shares /dev/shm, and survives the state dir being out of sight (another
container's, or removed by a /tmp cleaner while its broker runs). For each state id:

- its owner file is locked: a broker is running on it. Kept.
- the owner file is free but its state dir's lock is held: a broker is starting on that
  state dir (it takes that lock first, then the owner file). Kept.
- both are free: no broker owns it. With both locks held (so no broker can start on it
  meanwhile), its segments are removed, then its state dir (journal, lock, and the folder if
  empty: the next broker there starts empty, as after --reset), then the owner file. A
  broker that was waiting to adopt it finds its segments gone and says so.
- no owner file (made by a tensorbroker from before owner files, or removed by hand): gc
  cannot tell whether a broker uses it, so it is kept and reported. A broker maps only some
  of its segments (never its arena: Segment in server/store/segments.py), and a process in
  another container is out of sight of /proc, so /proc/*/maps cannot decide it either.

- both are free, and the owner file says "kept": a broker stopped cleanly and kept its
  state on purpose for the next one (`serve --state-dir`). Kept, unless named (`gc ID`).

Only the files of the user running gc are looked at (root: every user's, and a state's
segments and state dir only where they belong to the owner file's user).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from dataclasses import dataclass

from ...common.config import SEGMENT_NAME, SHM_DIR
from .journal import read_journal
from .state import KEPT, OWNER, discard, owner_path

log = logging.getLogger(__name__)

_OWNER_NAME = re.compile(r"tb-([0-9a-f]+)" + re.escape(OWNER))

REMOVED, RUNNING, STARTING, UNKNOWN = "removed", "running", "starting", "unknown"
STOPPED = "stopped"  # by a broker that kept it for the next one


@dataclass(frozen=True)
class Leftover:
    """The files in /dev/shm of one broker state, and what gc did with them: `status` is
    REMOVED (or would, with dry_run), RUNNING, STARTING, STOPPED or UNKNOWN (module
    docstring)."""

    state_id: str
    status: str
    state_dir: str | None  # as its owner file names it; None: no owner file
    segments: tuple[tuple[str, int], ...]  # name, size in bytes

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.segments)


def state_id(text: str) -> str:
    """The state id in `text`: an id ('1a2b3c4d') or a file name of that state
    ('tb-1a2b3c4d-…', 'tb-1a2b3c4d.owner'). ValueError says what it takes."""
    name = text.strip()
    name = name.removeprefix("/dev/shm/").removeprefix("tb-")
    sid = re.split(r"[-.]", name, maxsplit=1)[0]
    if not re.fullmatch(r"[0-9a-f]+", sid):
        raise ValueError(
            f"gc: {text!r} is not a state: give the id in its segments' names "
            "(tb-<id>-..., as `tensorbroker gc --dry-run` lists them)"
        )
    return sid


def collect(
    shm_dir: str = SHM_DIR, *, only: set[str] | None = None, dry_run: bool = False
) -> list[Leftover]:
    """Remove the files in `shm_dir` of every state no broker owns (only the states in
    `only`, if given; none with `dry_run`); one Leftover per state found, by id."""
    uid = os.geteuid()
    ids: set[str] = set()
    for name in os.listdir(shm_dir):
        match = SEGMENT_NAME.fullmatch(name) or _OWNER_NAME.fullmatch(name)
        if match is None or (only is not None and match.group(1) not in only):
            continue
        with contextlib.suppress(FileNotFoundError):
            if uid == 0 or os.lstat(os.path.join(shm_dir, name)).st_uid == uid:
                ids.add(match.group(1))
    found = [_collect(shm_dir, sid, dry_run, only is not None) for sid in sorted(ids)]
    return [f for f in found if f is not None]


def _segments(shm_dir: str, sid: str, uid: int | None) -> tuple[tuple[str, int], ...]:
    """The segments of state `sid` (of user `uid`; None: of the user running this)."""
    owner = os.geteuid() if uid is None else uid
    out = []
    for name in sorted(os.listdir(shm_dir)):
        match = SEGMENT_NAME.fullmatch(name)
        if match is None or match.group(1) != sid:
            continue
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(os.path.join(shm_dir, name))
            if info.st_uid == owner or (uid is None and owner == 0):
                out.append((name, info.st_size))
    return tuple(out)


def _owner(fd: int) -> tuple[str | None, bool]:
    """What an owner file says: its state dir, and whether the state was kept on purpose."""
    lines = os.pread(fd, 4096, 0).decode(errors="replace").splitlines()
    return (lines[0].strip() or None) if lines else None, KEPT in lines[1:]


def _collect(shm_dir: str, sid: str, dry_run: bool, named: bool) -> Leftover | None:
    marker = owner_path(shm_dir, sid)
    try:
        fd = os.open(marker, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return Leftover(sid, UNKNOWN, None, _segments(shm_dir, sid, None))
    except OSError as exc:  # a link, or a file this user cannot write
        log.warning("cannot open %s (%s): its state is kept", marker, exc.strerror)
        return Leftover(sid, UNKNOWN, None, _segments(shm_dir, sid, None))
    try:
        info = os.fstat(fd)
        state_dir, _ = _owner(fd)
        if os.geteuid() not in (0, info.st_uid):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Leftover(sid, RUNNING, state_dir, _segments(shm_dir, sid, info.st_uid))
        try:
            if os.stat(marker, follow_symlinks=False).st_ino != info.st_ino:
                return None  # removed and made again as we looked: see it the next time
        except FileNotFoundError:
            return None  # another gc removed it
        state_dir, kept = _owner(fd)
        if kept and not named:
            return Leftover(sid, STOPPED, state_dir, _segments(shm_dir, sid, info.st_uid))
        dir_fd = _lock_state_dir(state_dir, info.st_uid)
        if dir_fd is None:
            if state_dir is None or _journal_id(state_dir) in (None, sid):
                return Leftover(sid, STARTING, state_dir, _segments(shm_dir, sid, info.st_uid))
            dir_fd = -1  # its state dir is another state's now (made there since): not touched
        try:
            segments = _segments(shm_dir, sid, info.st_uid)  # with both locks: all there are
            if not dry_run:
                _remove(shm_dir, sid, state_dir, dir_fd, segments)
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        return Leftover(sid, REMOVED, state_dir, segments)
    finally:
        os.close(fd)


def _journal_id(state_dir: str) -> str | None:
    """The id of the state in `state_dir`; None if it has no journal (yet) to say."""
    try:
        found = read_journal(state_dir)
    except (OSError, ValueError):
        return None
    return None if found is None or "id" not in found.meta else str(found.meta["id"])


def _lock_state_dir(state_dir: str | None, uid: int) -> int | None:
    """Hold the lock of `state_dir`: its fd; -1 if it has none of user `uid` (gone, or not a
    state dir of that user); None if a broker holds it."""
    if state_dir is None or not os.path.isabs(state_dir):
        return -1
    try:
        fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return -1
    if os.fstat(fd).st_uid != uid:
        os.close(fd)
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _remove(
    shm_dir: str, sid: str, state_dir: str | None, dir_fd: int,
    segments: tuple[tuple[str, int], ...],
) -> None:  # fmt: skip
    """Remove a dead state: its segments, its state dir if it still holds this state (a
    --reset there since made it another's), then its owner file. The caller holds both."""
    for name, _ in segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
    if dir_fd >= 0 and state_dir is not None and _journal_id(state_dir) in (None, sid):
        discard(state_dir, shm_dir, locked=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(owner_path(shm_dir, sid))
    log.info("removed the state %s (%s): %d segments", sid, state_dir, len(segments))
