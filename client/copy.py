"""The one copy of a put, split across threads when it is large: a large tensor in parts, a
bundle of many smaller ones in groups of whole tensors (NumPy releases the GIL while it
copies, and one core cannot fill the memory bandwidth: on the 2-core VM, 1 GiB into touched
memory took 78 ms on one thread and 47-52 ms on two; a 512 MiB state_dict of 194 tensors of
2.6 MiB, 66-70 ms on one)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

PARALLEL_FROM = 8 << 20  # bytes; below this one thread is as fast
MAX_THREADS = 4

Array = np.ndarray[Any, Any]
Pairs = Sequence[tuple[Array, Array]]  # (dst, src)


class Copier:
    """Copies into shared memory, with a pool of threads of its own (made on first need)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or min(MAX_THREADS, len(os.sched_getaffinity(0)))  # CPUs we may use
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, dst: Array, src: Array) -> None:
        """dst[...] = src, exactly (no casting); returns when every byte is written."""
        self.copy_all([(dst, src)])

    def copy_all(self, pairs: Pairs) -> None:
        """dst[...] = src for every pair, exactly (no casting); returns when every byte is
        written. Each thread takes a run of whole pairs, or of parts of a large one, of about
        the same number of bytes."""
        total = sum(dst.nbytes for dst, _ in pairs)
        if total < PARALLEL_FROM or self.threads < 2:
            _copy_run(pairs)
            return
        runs = _runs([part for dst, src in pairs for part in _parts(dst, src, self.threads)],
                     total, self.threads)  # fmt: skip
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="tb-copy")
        futures: list[Future[None]] = []
        try:
            for run in runs[1:]:
                futures.append(self._pool.submit(_copy_run, run))
            _copy_run(runs[0])  # this thread's run
        finally:
            # Never return (or abort the put) while a thread still writes into the block.
            wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _copy_run(pairs: Pairs) -> None:
    for dst, src in pairs:
        np.copyto(dst, src, casting="no")


def _parts(dst: Array, src: Array, parts: int) -> Pairs:
    """(dst, src) in up to `parts` slices along its first axis if it alone is large."""
    if dst.nbytes < PARALLEL_FROM or dst.ndim == 0:
        return [(dst, src)]
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        dst, src = dst.reshape(-1), src.reshape(-1)
    parts = min(parts, dst.shape[0])
    bounds = [dst.shape[0] * i // parts for i in range(parts + 1)]
    return [(dst[a:b], src[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def _runs(parts: Pairs, total: int, threads: int) -> list[list[tuple[Array, Array]]]:
    """`parts` cut, in order, into at most `threads` runs of about total/threads bytes: a run
    ends before the part that would take it further past its share than it stays short of
    it (the parts of one large array are a hair under a share each: they are a run each)."""
    runs: list[list[tuple[Array, Array]]] = [[]]
    done = 0
    for part in parts:
        nbytes = part[0].nbytes
        if runs[-1] and len(runs) < threads and done + nbytes / 2 > total * len(runs) / threads:
            runs.append([])
        runs[-1].append(part)
        done += nbytes
    return runs
