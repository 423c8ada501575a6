"""The put's copy: split across threads for large tensors and large bundles, exact in every
layout."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorbroker.client.copy import PARALLEL_FROM, Copier

MiB = 2**20


@pytest.fixture
def copier() -> Any:
    c = Copier(threads=3)
    yield c
    c.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(PARALLEL_FROM // 4 + 7, dtype=np.float32),  # 1-D, uneven split
        lambda: np.arange(3 * PARALLEL_FROM // 8, dtype=np.int64).reshape(3, -1),
        lambda: np.arange(PARALLEL_FROM // 2, dtype=np.int32).reshape(1, -1),  # one row
        lambda: np.arange(4 * PARALLEL_FROM // 4, dtype=np.float32).reshape(64, -1)[:, ::2],
        lambda: np.arange(PARALLEL_FROM // 4, dtype=np.float32)[::-1],  # negative stride
        lambda: np.arange(10, dtype=np.uint8),  # small: one thread
    ],
    ids=["1d", "2d", "one-row", "strided", "reversed", "small"],
)
def test_copies_exactly(copier: Copier, make: Any) -> None:
    src = make()
    dst = np.zeros(src.shape, src.dtype)
    copier.copy(dst, src)
    assert np.array_equal(dst, src)


def test_a_bundle_of_many_tensors_is_copied_exactly_across_threads(copier: Copier) -> None:
    # 40 small tensors (each below PARALLEL_FROM, together above it), a large one that is
    # split too, a strided one and an empty one, as a state_dict put as one bundle is.
    srcs = [np.arange(i, i + MiB // 4, dtype=np.float32) for i in range(40)]
    srcs += [np.arange(PARALLEL_FROM // 8, dtype=np.int64).reshape(8, -1),
             np.arange(2 * MiB, dtype=np.int16)[::2], np.zeros(0, np.uint8)]  # fmt: skip
    dsts = [np.zeros(s.shape, s.dtype) for s in srcs]
    copier.copy_all(list(zip(dsts, srcs, strict=True)))
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_a_bundle_with_one_copy_that_would_cast_raises_after_every_thread_is_done(
    copier: Copier,
) -> None:
    pairs = [(np.zeros(MiB, np.float32), np.ones(MiB, np.float32)) for _ in range(12)]
    pairs[-1] = (np.zeros(MiB, np.float32), np.ones(MiB, np.float64))  # the last thread's
    with pytest.raises(TypeError):
        copier.copy_all(pairs)
    assert all(np.array_equal(d, s) for d, s in pairs[:-1])  # the others were all written


def test_a_copy_that_would_cast_is_refused(copier: Copier) -> None:
    src = np.ones(4 * MiB, np.float64)
    dst = np.zeros(4 * MiB, np.float32)  # casting="no" refuses float64 -> float32
    with pytest.raises(TypeError):
        copier.copy(dst, src)
    copier.close()
    copier.close()  # idempotent
