"""Eviction: when an allocation does not fit, free the least recently used evictable objects
no one holds, oldest first, and only then refuse the put (CapacityError).

An object is evictable if its put said so (`evictable=True`), or every keyed host object is
(`serve --evict lru`). An evicted key behaves as deleted: gets say NotFound, watch_prefix
sees a delete, stats() counts it (`evicted`).

Note [eviction]
~~~~~~~~~~~~~~~
"Used" is when an object was put or read. A read through the broker stamps it then; a read
from the directory never reaches the broker, so its lease slot tells: a client lets a slot
go by marking the id in it released (not by zeroing it), and takes its free slots in turn
(a FIFO), so a slot keeps that id until its turn comes again, a region's worth of reads
later. Each eviction pass first harvests the marks (`SlotTable.used`: a CAS empties each),
and what they name counts as used now. So directory reads are ordered by the passes they
fall between, as in CLOCK: an object read since the last pass outlives one put before that
pass and not read since. One held when the broker looks is never evicted (neither by a
lease nor by a lease slot).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .records import StoredObject
from .registry import Registry


class Eviction:
    def __init__(self, registry: Registry, on_evict: Callable[[StoredObject], None]) -> None:
        self.registry, self.on_evict = registry, on_evict
        self.evicted = 0
        self.every_object = False  # serve --evict lru
        # Whether clients of a broker that died may not be back yet (adoption.py).
        self.adopting: Callable[[], bool] = lambda: False
        registry.make_room = self.make_room

    def evictable(self, obj: StoredObject) -> bool:
        return obj.device == "cpu" and (obj.evictable or self.every_object)

    def make_room(self, size: int) -> bool:
        """Evict least recently used objects until `size` more bytes could be free, and free
        what no reader holds now; whether any was evicted. Nothing is evicted if even all of
        them would not make room (a put larger than the store must not empty it), nor while
        clients of a broker that died are not all back (their leases are not counted yet)."""
        registry, arena = self.registry, self.registry.arena
        if self.adopting() or size > arena.capacity:
            return False
        used, held = set(), {}
        if registry.slots is not None:
            used, held = registry.slots.used(), registry.slots.held()
        now = time.monotonic()
        candidates = []
        for obj in registry.objects.values():
            if obj.oid in used:  # read from the directory since the last pass
                obj.last_use = now
            if self.evictable(obj) and obj.leases == 0 and obj.oid not in held:
                candidates.append(obj)
        candidates.sort(key=lambda obj: obj.last_use)
        if arena.free_bytes + sum(obj.block.size for obj in candidates) < size:
            return False
        short = max(size - arena.free_bytes, 1)  # a free block large enough may still lack
        freed = 0
        for obj in candidates:
            if freed >= short:
                break
            registry.delete(obj.key)
            self.evicted += 1
            freed += obj.block.size
            self.on_evict(obj)
        if freed:
            registry.reclaim()  # the slots again, after the directory lost them
        return freed > 0
