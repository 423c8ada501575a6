"""Blocks granted ahead, so that a small put takes one trip: how many each client holds of
each size class, and how many are out.

Note [grants]

A small put would take two round trips, one for its memory and one for its seal. So the
broker grants each writing client blocks ahead, per size class (a page to 1 MiB by powers
of two, `grant_class`): a pending put with no key yet (`StoredObject.granted`), held by the
client as a put lease, journaled like any put. The client lays its tensors out in a block
of the class that fits (`layout`, which both ends compute alike), copies, and sends one
`write` naming the block; the broker checks that the block is that client's grant and
that the layout fits, then seals it as any put. Once the batch's replies are out, the
broker tops the client's grants of that class back up to `grant_depth` and sends them in a
message of their own (id 0, on the socket of the write), which the client reads with its
next reply: refills cost no trip, and are not on the writer's path. Grants are real allocations
(they count in `stats()["granted_bytes"]` and never let the arena go past its capacity),
and are made only while a quarter of the arena stays free: a put that finds no grant asks
for its block as before. A client that dies, closes, or loses its broker lets them go
like any unsealed put.
"""

from __future__ import annotations

from ..common.descriptors import PAGE, Shapes, laid_out, layout
from ..common.errors import InvalidRequest
from .arena import Arena, Block
from .records import Session, StoredObject

GRANT_AHEAD_BYTES = 1 << 20  # a client is granted about this much of one size class ahead,
GRANT_DEPTH = (2, 8)  # and at least 2 blocks of it, at most 8
GRANT_FREE_SHARE = 4  # grants ahead only while more than 1/4 of the arena stays free


def grant_depth(size_class: int) -> int:
    """Blocks of `size_class` a client is granted ahead."""
    return max(GRANT_DEPTH[0], min(GRANT_DEPTH[1], GRANT_AHEAD_BYTES // size_class))


class Grants:
    """The blocks of `arena` granted ahead: `bytes` and `blocks` out, and each session's
    count per size class (`Session.grants`). The registry holds each block as a pending put."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.bytes = self.blocks = 0

    def take(self, session: Session, size_class: int) -> list[Block]:
        """Blocks of `size_class` bytes for `session`, up to its depth (fewer, or none, once
        the arena is three quarters full)."""
        have = session.grants.get(size_class, 0)
        out: list[Block] = []
        arena = self.arena
        for _ in range(grant_depth(size_class) - have):
            if arena.free_bytes - size_class < arena.capacity // GRANT_FREE_SHARE:
                break
            block = arena.allocate(size_class, PAGE)
            if block is None:
                break
            out.append(block)
        if out:
            session.grants[size_class] = have + len(out)
            self.bytes += size_class * len(out)
            self.blocks += len(out)
        return out

    def carry(self, session: Session, obj: StoredObject) -> None:
        """A block a broker that died granted `session`, granted again (adoption.py)."""
        obj.granted = True
        size = obj.block.size
        session.grants[size] = session.grants.get(size, 0) + 1
        self.bytes += size
        self.blocks += 1

    def fill(
        self,
        session: Session,
        put_id: int,
        obj: StoredObject,
        key: str,
        specs: list[tuple[str, str, tuple[int, ...]]],
        bundle: bool,
        shapes: Shapes,
    ) -> None:
        """`obj`, the pending put `put_id` of `session`, written: no longer a grant but a put
        of `key` laid out as `specs`. InvalidRequest if it was no grant or they do not fit."""
        if not obj.granted:
            raise InvalidRequest(f"write {key!r}: put {put_id} is not a block granted ahead")
        if not bundle and (len(specs) != 1 or specs[0][0] != ""):
            raise InvalidRequest(f"write {key!r}: a plain object holds one unnamed tensor")
        offsets, size, _ = layout(specs)
        if size > obj.block.size:
            raise InvalidRequest(
                f"write {key!r}: its tensors take {size} bytes, and block {put_id} has "
                f"{obj.block.size}"
            )
        self.ungrant(session, obj)
        obj.key, obj.bundle = key, bundle
        block = obj.block
        obj.wire = laid_out(specs, offsets, block.segment, block.offset, "cpu", shapes)

    def ungrant(self, session: Session, obj: StoredObject) -> None:
        """`obj` is no longer a grant (written, aborted, or let go)."""
        if obj.granted:
            obj.granted = False
            session.grants[obj.block.size] -= 1
            self.bytes -= obj.block.size
            self.blocks -= 1
