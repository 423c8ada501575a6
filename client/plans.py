"""A put planned: what it writes where (`WritePlan`), made by Transfer.plan_write and written
by Transfer.fill or Transfer.write_granted, or by a queue ring's slot (qring.py)."""

from __future__ import annotations

from typing import Any

from ..common.descriptors import compact_strides
from ..common.dtypes import DType
from ..common.mailbox import Template, body_tail
from .ahead import Grant
from .sources import Source

PLAN_CACHE = 256  # put plans of plain NumPy arrays, by dtype and shape


class WritePlan:
    """A put under way: its tensors placed, and the block granted ahead it writes into (None:
    the broker is asked for memory with `request`)."""

    __slots__ = (
        "label", "items", "target", "specs", "bundle", "fields", "offsets", "size", "grant",
        "raw", "tails",
    )  # fmt: skip

    def __init__(
        self,
        label: str,
        items: list[tuple[str, Source, DType]],
        target: str,
        specs: list[list[Any]],
        bundle: bool,
        fields: dict[str, Any],
    ) -> None:
        self.label, self.items, self.target = label, items, target
        self.specs, self.bundle, self.fields = specs, bundle, fields
        self.offsets: list[int] = []
        self.size = 0  # bytes of its block (on the host)
        self.grant: Grant | None = None
        self.raw = False  # its one array is stored byte for byte as it is (a plain ndarray)
        self.tails: dict[tuple[str, str], bytes] | None = None  # kept with a plan reused

    @property
    def request(self) -> dict[str, Any]:
        return {"tensors": self.specs, "bundle": self.bundle, **self.fields}

    def tail(self, segment: str) -> bytes:
        """The tail of a mailbox body for this item in `segment` (`body_tail`): packed once
        per queue and segment for a plan reused (`tails`)."""
        name = self.fields.get("name", "")
        tails = self.tails
        found = None if tails is None else tails.get((name, segment))
        if found is not None:
            return found
        template: Template = [
            (tensor, dtype, shape, list(compact_strides(tuple(shape))), offset)
            for (tensor, dtype, shape), offset in zip(self.specs, self.offsets, strict=True)
        ]
        tail = body_tail(name, self.bundle, segment, template)
        if tails is not None:
            if len(tails) >= PLAN_CACHE:
                tails.clear()
            tails[name, segment] = tail
        return tail
