"""The one copy of a put: large tensors are split across threads (NumPy releases the GIL
while it copies, and one core cannot fill the memory bandwidth: on the 2-core VM, 1 GiB into
touched memory took 78 ms on one thread and 47-52 ms on two)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

PARALLEL_FROM = 8 << 20  # bytes; below this one thread is as fast
MAX_THREADS = 4

Array = np.ndarray[Any, Any]


class Copier:
    """Copies into shared memory, with a pool of threads of its own (made on first need)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or min(MAX_THREADS, len(os.sched_getaffinity(0)))  # CPUs we may use
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, dst: Array, src: Array) -> None:
        """dst[...] = src, exactly (no casting); returns when every byte is written."""
        if dst.nbytes < PARALLEL_FROM or self.threads < 2 or dst.ndim == 0:
            np.copyto(dst, src, casting="no")
            return
        if dst.flags.c_contiguous and src.flags.c_contiguous:
            dst, src = dst.reshape(-1), src.reshape(-1)
        parts = min(self.threads, dst.shape[0])
        bounds = [dst.shape[0] * i // parts for i in range(parts + 1)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="tb-copy")
        futures: list[Future[None]] = []
        try:
            for a, b in zip(bounds[1:-1], bounds[2:], strict=True):
                futures.append(self._pool.submit(np.copyto, dst[a:b], src[a:b], casting="no"))
            np.copyto(dst[: bounds[1]], src[: bounds[1]], casting="no")  # this thread's part
        finally:
            # Never return (or abort the put) while a thread still writes into the block.
            wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
