"""The broker's shared-memory segments: files in /dev/shm (the tmpfs) that the broker makes
and backs, never maps, and hands out in blocks (arena.py); shared with one user or group
where asked; made on a thread of their own where the loop must not wait (Note [growing] in
arena.py).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class ShmExhausted(OSError):
    """/dev/shm (the tmpfs) could not back a new segment (ENOSPC from posix_fallocate); or
    the GPU a new device chunk (a failed cudaMalloc, devices.py)."""


_ACL = "system.posix_acl_access"
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id: linux/posix_acl_xattr.h
_ACL_ANY = 0xFFFFFFFF  # the id of an entry that names no one
# tags: the owner, a named user, the owning group, the mask, everyone else
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20


def share_with_user(fd: int, uid: int) -> None:
    """Let user `uid` open the file `fd` read-write too, and no one else but its owner: a
    POSIX ACL (owner rw, that user rw, owning group and others nothing), which the owner of a
    file may set without privilege. OSError if the file system has no ACLs (EOPNOTSUPP)."""
    entries = [
        (_USER_OBJ, 6, _ACL_ANY), (_USER, 6, uid), (_GROUP_OBJ, 0, _ACL_ANY),
        (_MASK, 6, _ACL_ANY), (_OTHER, 0, _ACL_ANY),
    ]  # fmt: skip
    value = struct.pack("<I", 2) + b"".join(_ACL_ENTRY.pack(*e) for e in entries)
    os.setxattr(fd, _ACL, value)


class Segment:
    """One shared-memory file owned by the broker (the broker never maps it).

    Class-level defaults let a half-built object still be unlinked, as in
    ``multiprocessing.shared_memory``.
    """

    name: str = ""
    path: str = ""
    size: int = 0

    @classmethod
    def create(
        cls, shm_dir: str, prefix: str, size: int, group: int | None = None, mode: int = 0o660,
        user: int | None = None,
    ) -> Segment:  # fmt: skip
        """Create ``shm_dir/<prefix><16 hex>`` (mode 0600) with every page backed now; with
        `group`, that group's members may map it too (`mode`: 0660, or 0640 read-only); with
        `user` (and no group), that one user too, read-write (`share_with_user`)."""
        if size < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size}")
        segment = cls()
        while True:
            name = prefix + os.urandom(8).hex()
            path = os.path.join(shm_dir, name)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue
            break
        segment.name, segment.path = name, path
        try:
            if group is not None:
                os.fchown(fd, -1, group)
                os.fchmod(fd, mode)
            elif user is not None and user != os.geteuid():
                share_with_user(fd, user)
            os.ftruncate(fd, size)
            try:
                # Back every page now: a lazily-filled tmpfs would SIGBUS clients later.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise ShmExhausted(
                    errno.ENOSPC,
                    f"cannot back a {size}-byte ({size / 2**20:.1f} MiB) shared-memory segment "
                    f"in {shm_dir}: the tmpfs is full. Enlarge it (docker run --shm-size=..., or "
                    f"in Kubernetes mount an emptyDir {{medium: Memory, sizeLimit: ...}} at "
                    f"{shm_dir}) or lower the broker capacity",
                ) from exc
            segment.size = size
        except BaseException:
            segment.unlink()
            raise
        finally:
            os.close(fd)
        logger.info("created shm segment %s (%s bytes)", path, size)
        return segment

    @classmethod
    def existing(cls, shm_dir: str, name: str) -> Segment:
        """A segment a broker that died made (adopted: Note [recovery] in state.py)."""
        segment = cls()
        segment.name, segment.path = name, os.path.join(shm_dir, name)
        segment.size = os.stat(segment.path).st_size
        return segment

    def unlink(self) -> None:
        """Remove the file; idempotent."""
        if not self.path:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"Segment(name={self.name!r}, size={self.size})"


class Growth:
    """A segment of `size` bytes made by `make` on a thread of its own (Note [growing]):
    `segment` once made, `error` if that failed."""

    def __init__(self, make: Callable[[int], Segment], size: int) -> None:
        self.size = size
        self.segment: Segment | None = None
        self.error: Exception | None = None
        self.over = False  # ended, and taken in by its arena (Arena.grown)
        self._thread = threading.Thread(target=self._run, args=(make,), name="arena-growth")
        self._thread.start()

    def _run(self, make: Callable[[int], Segment]) -> None:
        try:
            self.segment = make(self.size)
        except Exception as exc:  # (the allocations that waited fail with it)
            self.error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
