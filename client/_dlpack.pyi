"""Type stubs for the C extension ``tensorbroker.client._dlpack`` (see client/_dlpack.c)."""

from typing_extensions import CapsuleType

DLPACK_VERSION: tuple[int, int]
"""The DLPack version of the capsules this module builds: (1, 0)."""
FLAG_READ_ONLY: int
"""DLPACK_FLAG_BITMASK_READ_ONLY."""
FLAG_IS_COPIED: int
"""DLPACK_FLAG_BITMASK_IS_COPIED."""
MAX_NDIM: int
"""The largest ndim make_capsule accepts (64)."""

def make_capsule(
    owner: object,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    code: int,
    bits: int,
    lanes: int,
    device_type: int,
    device_id: int,
    versioned: bool,
    readonly: bool,
    *,
    copied: bool = False,
) -> CapsuleType:
    """Wrap the memory at address ``data`` in a DLPack capsule.

    ``strides`` are in elements and must have the same length as ``shape``. The capsule is
    named "dltensor_versioned" (DLPack 1.0; flags: read-only when ``readonly``, is-copied when
    ``copied``) when ``versioned`` is true, else "dltensor" (the flags are then dropped). A
    tensor with a zero in its shape gets a NULL data pointer, as the spec asks. ``owner`` is kept
    alive until the consumer's deleter runs, or until the capsule is destroyed unconsumed.
    """

def capsule_info(
    capsule: CapsuleType,
) -> tuple[int, tuple[int, ...], tuple[int, ...] | None, int, int, int, int, int, bool]:
    """Read a producer's DLPack capsule without consuming it.

    Returns ``(data, shape, strides, code, bits, lanes, device_type, device_id, readonly)``;
    ``data`` includes the byte offset, ``strides`` (in elements) is None for a compact
    row-major tensor. Raises ValueError for a consumed capsule or a DLPack major version other
    than 1, TypeError for anything that is not a DLPack capsule.
    """
