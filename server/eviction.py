"""Eviction: when an allocation does not fit, free the least recently used evictable objects
no one holds, oldest first, and only then refuse the put (CapacityError).

An object is evictable if its put said so (`evictable=True`), or every keyed host object is
(`serve --evict lru`). An evicted key behaves as deleted: gets say NotFound, watch_prefix
sees a delete, stats() counts it (`evicted`). "Used" is when it was put, read through the
broker, or found held by a reader: gets served from the directory do not reach the broker,
so for those the order is the order of puts, and one held when the broker looks is never
evicted (neither by a lease nor by a lease slot).
"""

from __future__ import annotations

from collections.abc import Callable

from .registry import Registry, StoredObject


class Eviction:
    def __init__(self, registry: Registry, on_evict: Callable[[StoredObject], None]) -> None:
        self.registry, self.on_evict = registry, on_evict
        self.evicted = 0
        self.every_object = False  # serve --evict lru
        registry.make_room = self.make_room

    def evictable(self, obj: StoredObject) -> bool:
        return obj.device == "cpu" and (obj.evictable or self.every_object)

    def make_room(self, size: int) -> bool:
        """Evict least recently used objects until `size` more bytes could be free, and free
        what no reader holds now; whether any was evicted. Nothing is evicted if even all of
        them would not make room (a put larger than the store must not empty it), nor while
        clients of a broker that died are not all back (their leases are not counted yet)."""
        registry, arena = self.registry, self.registry.arena
        if registry.adopted or size > arena.capacity:
            return False
        held = registry.slots.held() if registry.slots is not None else {}
        candidates = sorted(
            (
                obj
                for obj in registry.objects.values()
                if self.evictable(obj) and obj.leases == 0 and obj.oid not in held
            ),
            key=lambda obj: obj.last_use,
        )
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
