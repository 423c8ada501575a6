"""The dtype table: names, DLPack codes, sizes and NumPy type strings.

bfloat16 has no NumPy type of its own; its bytes travel as uint16 and consumers that know it
(torch, JAX, ml_dtypes) see it through its DLPack code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest

# DLDataTypeCode
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_COMPLEX, KDL_BOOL = 0, 1, 2, 4, 5, 6


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    code: int  # DLPack type code
    bits: int
    typestr: str  # NumPy array-interface type string of the bytes (uint16 for bfloat16)

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """The bytes of a compact tensor of this dtype and `shape`."""
        return math.prod(shape) * self.itemsize


_TABLE = [
    DType("bool", KDL_BOOL, 8, "|b1"),
    DType("int8", KDL_INT, 8, "|i1"),
    DType("int16", KDL_INT, 16, "<i2"),
    DType("int32", KDL_INT, 32, "<i4"),
    DType("int64", KDL_INT, 64, "<i8"),
    DType("uint8", KDL_UINT, 8, "|u1"),
    DType("uint16", KDL_UINT, 16, "<u2"),
    DType("uint32", KDL_UINT, 32, "<u4"),
    DType("uint64", KDL_UINT, 64, "<u8"),
    DType("float16", KDL_FLOAT, 16, "<f2"),
    DType("bfloat16", KDL_BFLOAT, 16, "<u2"),
    DType("float32", KDL_FLOAT, 32, "<f4"),
    DType("float64", KDL_FLOAT, 64, "<f8"),
    DType("complex64", KDL_COMPLEX, 64, "<c8"),
    DType("complex128", KDL_COMPLEX, 128, "<c16"),
]

DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
_BY_DLPACK: dict[tuple[int, int], DType] = {(d.code, d.bits): d for d in _TABLE}
# A 1-bit kDLBool is how some producers describe bool; its storage is still one byte.
_BY_DLPACK[(KDL_BOOL, 1)] = DTYPES["bool"]
_ALIASES = {"bool_": "bool", "float": "float64", "half": "float16", "double": "float64"}


def dtype(spec: Any) -> DType:
    """Look up a dtype by name ("float32"), by NumPy dtype, or by anything with a `.name` or str().

    Raises InvalidRequest (a ValueError) naming the dtype and the ones supported.
    """
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        name = spec
    else:
        import numpy as np  # here: the broker names dtypes by string and never loads NumPy

        try:
            name = np.dtype(spec).name  # NumPy and ml_dtypes dtypes and scalar types, JAX's
        except TypeError:
            name = str(spec).removeprefix("torch.")  # torch.float32
    name = _ALIASES.get(name, name)
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequest(
            f"unsupported dtype {spec!r}; supported: {', '.join(DTYPES)}"
        ) from None


def from_dlpack(code: int, bits: int, lanes: int = 1) -> DType:
    """The dtype of a DLPack DLDataType; InvalidRequest for vector types and unknown codes."""
    found = _BY_DLPACK.get((code, bits))
    if found is None or lanes != 1:
        raise InvalidRequest(
            f"unsupported DLPack dtype (code={code}, bits={bits}, lanes={lanes}); "
            f"supported: {', '.join(DTYPES)}"
        )
    return found
