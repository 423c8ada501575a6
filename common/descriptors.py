"""Descriptors: what the broker tells a client about an object's bytes. Frozen, and sent as
short msgpack lists (see `to_wire` / `from_wire`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .config import round_up
from .dtypes import DTYPES

MIN_ALIGN = 64  # JAX copies silently below 64-byte alignment
DEVICE_ALIGN = 256  # what cudaMalloc guarantees; every device tensor starts on 256 bytes
PAGE = 4096
PAGE_ALIGN_FROM = 64 * 1024  # tensors of this size and up start on a page
# Blocks granted ahead (Note [grants] in server/store/grants.py) come in these sizes, a page to
# 1 MiB by powers of two; larger host puts ask for their block (the copy dominates there).
GRANT_MIN, GRANT_MAX = PAGE, 1 << 20
# A device's blocks are granted up to 4 GiB: a device-to-device copy is fast enough that one
# trip more costs a 1 GiB put a fifth of its bandwidth. Above 1 MiB they come in sixteenths
# of a power of two, so a block is at most 1/8 larger than its put (device memory is scarce).
DEVICE_GRANT_MAX = 1 << 32


def layout(
    specs: list[tuple[str, str, tuple[int, ...]]], min_align: int = MIN_ALIGN
) -> tuple[list[int], int, int]:
    """Byte offsets of each tensor inside one block, the block size and its alignment: the
    broker and a client writing into a block granted ahead compute them alike."""
    offsets, end, block_align = [], 0, min_align
    for _, dtype, shape in specs:
        size = DTYPES[dtype].nbytes(shape)
        align = PAGE if size >= PAGE_ALIGN_FROM else min_align
        block_align = max(block_align, align)
        start = round_up(end, align)
        offsets.append(start)
        end = start + size
    return offsets, max(end, 1), block_align


def grant_class(size: int, device: bool = False) -> int | None:
    """The size of the granted blocks a block of `size` bytes is taken from, on the host or
    (`device`) a GPU; None: too big."""
    if size > (DEVICE_GRANT_MAX if device else GRANT_MAX):
        return None
    whole = max(GRANT_MIN, 1 << (size - 1).bit_length())
    if device and whole > GRANT_MAX:
        return round_up(size, whole // 16)
    return whole


def compact_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class TensorDesc(NamedTuple):
    """One tensor: where its bytes are and how to read them. (A named tuple: every get makes
    one, and a tuple is made several times faster than a frozen dataclass.)"""

    name: str  # "" for a plain object; the entry's name inside a bundle
    dtype: str  # a name from the dtype table
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, as DLPack counts them
    segment: str  # shared-memory file name
    offset: int  # byte offset of element 0 in the segment
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].nbytes(self.shape)

    def to_wire(self) -> list[Any]:
        return [
            self.name,
            self.dtype,
            list(self.shape),
            list(self.strides),
            self.segment,
            self.offset,
            self.device,
        ]

    @classmethod
    def from_wire(cls, w: list[Any]) -> TensorDesc:
        name, dtype, shape, strides, segment, offset, device = w
        return cls(name, dtype, tuple(shape), tuple(strides), segment, offset, device)


class Shapes:
    """Shape and stride tuples shared by the descriptors a broker keeps: each shape once, up
    to `limit` different ones (then it starts again). A plain object's descriptor so takes
    about 150 bytes of the broker's memory, not 450 (issue 31)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._known: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shape, compact strides) of `shape`, as tuples shared with every equal one."""
        key = tuple(shape)
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= self.limit:
                self._known.clear()
            known = self._known[key] = (key, compact_strides(key))
        return known


def laid_out(
    specs: Sequence[Sequence[Any]], offsets: list[int], segment: str, base: int, device: str,
    shapes: Shapes,
) -> tuple[tuple[Any, ...], ...]:  # fmt: skip
    """The wire form of the tensors of `specs` ([name, dtype, shape]) laid out at `offsets`
    from `base` in `segment`: tuples (packed as arrays), their dtype names and, through
    `shapes`, their shapes and strides shared with other objects'."""
    return tuple(
        (name, DTYPES[dtype].name, *shapes(shape), segment, base + off if off else base, device)
        for (name, dtype, shape), off in zip(specs, offsets, strict=True)
    )


def object_wire(
    key: str, version: int, bundle: bool, tensors: Sequence[Any], lease: int
) -> dict[str, Any]:
    """A sealed object as one `get` sees it (a version of a key, held by one lease), in its
    wire form, from tensors already in theirs (the broker keeps them so). A bundle is several
    named tensors published as one object."""
    return {"key": key, "version": version, "bundle": bundle, "tensors": tensors, "lease": lease}
