"""The store: shared memory and the objects in it. The arena (arena.py) and device memory
(devices.py, chunks.py), the objects and their leases (records.py, registry.py), blocks
granted ahead (grants.py), the directory clients read without the broker and their lease
slots and mailboxes (directory.py, members.py), parked requests (parking.py), and the
requests on keyed objects: put, get, watch, delete, eviction (objects.py, events.py,
eviction.py).

May import: durability."""
