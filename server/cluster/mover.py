"""NIXL's reads, started and watched on a thread of their own: no NIXL call of a transfer runs
on the broker's loop (issue 50's second fault: one `check_xfer_state` took 2.84 s on a busy
host, the loop answered nothing meanwhile, and its peers took it for down).

The loop hands a read to `Mover.start` and gets its `Read` at once; the thread makes NIXL's
transfer request, posts it and polls it (NIXL's bindings let go of the GIL in those calls,
and the agent runs in NIXL's read-write thread mode: the loop may register memory or add a
peer meanwhile), then marks the Read finished or failed and writes a byte to `fd`, which the
loop polls: the loop looks at its reads when one ended, never at a timer.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

POLL = 0.0002  # seconds between the thread's looks at the reads under way (none: it sleeps)


@dataclass(slots=True)
class Read:
    """A read handed to the mover: `size` bytes from `node` at `remote` (a NIXL descriptor
    list) into `local`, or, `op` WRITE, from `local` to `remote` in `node`'s memory (a piece
    pushed to a reader: Note [pushes] in pushes.py). `finished` once NIXL said DONE; `error`
    once it failed. A pushed read (`token`) is not the mover's: its lender says it ended."""

    node: str
    local: Any
    remote: Any
    size: int
    fill: int = 0  # the address of its bytes here, if host memory: populated first
    op: str = "READ"
    handle: Any = None  # NIXL's transfer request (the thread's)
    finished: bool = False
    error: str | None = None
    token: int = 0  # a pushed read's: named in its `write` and its lender's `wrote`
    queried_at: float = 0.0  # when its lender was last asked about it (pushes.py)
    late: bool = False  # given up, its lender perhaps still writing it (pushes.py)
    inc: int | None = None  # the incarnation of its lender's broker asked to write it
    nixl_error: bool = False  # NIXL failed it here (Transfers.unknown: the peer's agent?)


# What the loop hands the thread: a transfer, a call, a call replacing a node's agent, or None
# (stop).
Item = Read | Callable[[], None] | tuple[str, Callable[[], None]] | None


class Mover:
    """The thread that runs `agent`'s reads (the Read of each `start`), and the descriptor it
    writes to when one ends (`fd`: the broker's loop polls it)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.fd, self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._new: queue.SimpleQueue[Item] = queue.SimpleQueue()
        # node -> what waits for its transfers under way to end (`call` with a node), in order
        self._waiting: dict[str, list[Read | Callable[[], None]]] = {}
        self._thread = threading.Thread(target=self._run, name="nixl-reads", daemon=True)
        self._thread.start()

    def start(
        self, node: str, local: Any, remote: Any, size: int, fill: int = 0, op: str = "READ"
    ) -> Read:
        read = Read(node, local, remote, size, fill, op)
        self._new.put(read)
        return read

    def call(self, fn: Callable[[], None], node: str | None = None) -> None:
        """Run `fn` (NIXL calls: a peer's agent added or replaced) on the thread, after what
        was handed to it before and before what comes after: NIXL's lock is held for as
        long as a transfer is posted (4.2 s on a busy host), and a loop waiting for it to
        replace a peer's agent answered nothing, and froze its process's other threads.
        `node`: `fn` replaces that peer's agent, which NIXL does under the transfers with it
        (its endpoint and keys go): it waits until none is under way, and the transfers
        with `node` handed over after it wait for it."""
        self._new.put(fn if node is None else (node, fn))

    def woken(self) -> None:
        """The loop read `fd` (its bytes dropped: it looks at every read anyway)."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass

    def close(self) -> bool:
        """Stop the thread once the transfers under way ended (NIXL may still write into
        their blocks, or read from them, until then): whether it did within 10 s."""
        self._new.put(None)
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # (still the thread's to write to)
            log.error("cluster: NIXL transfers still under way after 10 s, at the close")
            return False
        os.close(self.fd)
        os.close(self._wake)
        return True

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        active: list[Read] = []
        stopping = False
        while not stopping or active:
            try:  # (blocks while no read is under way)
                item = self._new.get(timeout=POLL if active else None)
                while True:
                    if item is None:
                        stopping = True
                    elif isinstance(item, tuple):  # (a peer's agent replaced)
                        self._waiting.setdefault(item[0], []).append(item[1])
                    elif isinstance(item, Read) and item.node in self._waiting:
                        self._waiting[item.node].append(item)
                    elif isinstance(item, Read):
                        if self._post(item):
                            active.append(item)
                    else:
                        self._call(item)
                    self._unwait(active)
                    item = self._new.get_nowait()
                    active = [r for r in active if not self._ended(r)]  # (between posts)
            except queue.Empty:
                pass
            active = [r for r in active if not self._ended(r)]
            self._unwait(active)  # (with none under way it runs all that waits: none is left)

    def _unwait(self, active: list[Read]) -> None:
        """Run what waits for a node with no transfer under way now, in order: a replace of
        its agent waits again once a transfer posted before it is under way."""
        for node in list(self._waiting):
            items = self._waiting[node]
            while items:
                if not isinstance(items[0], Read) and any(r.node == node for r in active):
                    break
                item = items.pop(0)
                if not isinstance(item, Read):
                    self._call(item)
                elif self._post(item):
                    active.append(item)
            if not items:
                del self._waiting[node]

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # (what it was for says so: a read from that peer fails)
            log.warning("cluster: %s", exc)

    def _post(self, read: Read) -> bool:
        """Make and post `read`'s transfer; False if NIXL refused it (`read` failed)."""
        agent = self.agent
        if read.fill:
            populate(read.fill, read.size)
        try:
            read.handle = agent.initialize_xfer(read.op, read.local, read.remote, read.node)
            if agent.transfer(read.handle) == "ERR":
                agent.release_xfer_handle(read.handle)
                raise OSError("NIXL refused to post it")
        except Exception as exc:  # NIXL's own errors (nixlNotFoundError, ...)
            what = "read of {} bytes from" if read.op == "READ" else "write of {} bytes to"
            self._end(read, f"NIXL could not start a {what.format(read.size)} {read.node!r}: "
                      f"{exc!r}")  # fmt: skip
            return False
        return True

    def _ended(self, read: Read) -> bool:
        try:
            state = self.agent.check_xfer_state(read.handle)
        except Exception as exc:
            self._end(read, f"NIXL lost a read: {exc!r}")
            return True
        if state == "PROC":
            return False
        try:
            self.agent.release_xfer_handle(read.handle)
        except Exception as exc:  # (the read is over either way)
            log.warning("NIXL could not release a read's handle: %r", exc)
        self._end(read, None if state == "DONE" else f"a NIXL read ended in state {state}")
        return True

    def _end(self, read: Read, error: str | None) -> None:
        read.nixl_error = error is not None  # (before `error`: the loop reads it once ended)
        read.error, read.finished = error, error is None
        try:
            os.write(self._wake, b"\0")
        except BlockingIOError:  # (the loop has not read the last ones yet: it will look)
            pass


MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module does not name it)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(address: int, size: int) -> None:
    """Fault in the pages of host memory a read will write, in one call (Note [populating
    mappings] in client/shm.py): UCX's copies faulted them one by one. A 512 MiB read into
    pages this broker had not touched took 1.2-2.0 s on this 2-core VM, against 0.3-0.4 s
    into pages touched before. Where the kernel has no MADV_POPULATE_WRITE (before 5.14),
    the read faults them as before."""
    start = address - address % mmap.PAGESIZE
    _libc.madvise(start, address + size - start, MADV_POPULATE_WRITE)
