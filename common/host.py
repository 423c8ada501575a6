"""Facts that tell whether two processes share a host and which process a pid names."""

from __future__ import annotations

import functools
import os

_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def pid() -> int:
    """This process's id, kept across a fork: no system call (os.getpid() makes one, 145 ns
    here, and every get asked twice)."""
    return _pid


@functools.cache
def boot_id() -> str:
    """This boot's random id: equal for every process of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or None.

    Together with the pid it names one process: a pid reused later, or the same number in
    another pid namespace, gives a different start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def open_pidfd(pid: int, started: int | None) -> int | None:
    """A pidfd for `pid` if it is the process that started at `started` (see start_time), or
    None: no such process, pidfds unsupported, or another process under the same number
    (reused, or another pid namespace's). The caller closes it."""
    if started is None:
        return None
    try:
        fd = os.pidfd_open(pid)
    except (OSError, OverflowError, AttributeError):
        return None
    if start_time(pid) != started:
        os.close(fd)
        return None
    return fd
