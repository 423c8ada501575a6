"""The put's copy: split across threads for large tensors, exact in every layout."""

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


def test_a_copy_that_would_cast_is_refused(copier: Copier) -> None:
    src = np.ones(4 * MiB, np.float64)
    dst = np.zeros(4 * MiB, np.float32)  # casting="no" refuses float64 -> float32
    with pytest.raises(TypeError):
        copier.copy(dst, src)
    copier.close()
    copier.close()  # idempotent
