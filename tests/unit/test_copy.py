"""The put's copy: split across threads for large tensors and large bundles, exact in every
layout."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorbroker.client.copy import PARALLEL_FROM, Copier, _parts, _runs

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


@pytest.mark.parametrize(
    ("arrays", "threads", "shares"),
    [
        ([np.zeros(PARALLEL_FROM + 1, np.uint8)], 2, [0.5, 0.5]),  # (odd: halves a byte short)
        ([np.zeros((3, PARALLEL_FROM), np.uint8)[:, ::2]], 2, [1 / 3, 2 / 3]),  # (by rows)
        ([np.zeros(2 * PARALLEL_FROM + 3, np.uint8)], 4, [0.25] * 4),
        ([np.zeros(16 * MiB, np.uint8), np.zeros(MiB, np.uint8)], 4, [4 / 17] * 3 + [5 / 17]),
        ([np.zeros(MiB, np.uint8) for _ in range(40)], 3, [13 / 40, 13 / 40, 14 / 40]),
    ],
    ids=["odd-2", "rows-2", "odd-4", "large-and-small-4", "many-3"],
)
def test_each_thread_copies_about_its_share(arrays: list[Any], threads: int,
                                            shares: list[float]) -> None:  # fmt: skip
    """The copy is cut into one run per thread of about equal bytes (one thread doing twice
    its share makes the copy as slow as one thread)."""
    pairs = [p for a in arrays for p in _parts(a, a, threads)]
    total = sum(a.nbytes for a in arrays)
    runs = _runs(pairs, total, threads)
    got = [sum(d.nbytes for d, _ in run) / total for run in runs]
    assert sorted(got) == pytest.approx(sorted(shares), abs=0.01)


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
