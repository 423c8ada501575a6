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
        registry.make_room = self.make_room

    def make_room(self, size: int) -> bool:
        """Evict least recently used objects worth `size` bytes (fewer if there are not as
        many), and free what no reader holds now; whether any was evicted."""
        registry = self.registry
        held = registry.slots.held() if registry.slots is not None else {}
        candidates = sorted(
            (
                obj
                for obj in registry.objects.values()
                if obj.evictable and obj.leases == 0 and obj.oid not in held
            ),
            key=lambda obj: obj.last_use,
        )
        freed = 0
        for obj in candidates:
            if freed >= size:
                break
            registry.delete(obj.key)
            self.evicted += 1
            freed += obj.nbytes
            self.on_evict(obj)
        if freed:
            registry.reclaim()  # the slots again, after the directory lost them
        return freed > 0
