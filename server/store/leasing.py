"""Leases (Registry's, registry.py): each `get`'s hold on an object, and the putter's until it
lets go, held by a session (a client that dies gives all of its leases back at once); a
queue item handed to its one consumer, or given back untaken. A device object's reader
gets a read-done event with its lease, which the object keeps once the lease ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...common.cudart import device_index
from ...common.errors import InvalidRequest
from ..durability.journal import Journal
from .devices import DeviceMemory
from .records import Session, StoredObject

if TYPE_CHECKING:
    from .members import SlotTables


class Leasing:
    """Registry's leases; what it uses of Registry is named here."""

    devices: DeviceMemory
    journal: Journal
    slots: SlotTables | None
    lease_count: int

    def _id(self) -> int:
        raise NotImplementedError

    def _retire(self, obj: StoredObject, taker: str | None = None, took: int | None = None) -> None:
        raise NotImplementedError

    def _unpend(self, session: Session, put_id: int) -> StoredObject:
        raise NotImplementedError

    def _maybe_free(self, obj: StoredObject) -> None:
        raise NotImplementedError

    def abort(self, session: Session, put_id: int, keep: bool) -> None:
        raise NotImplementedError

    def lease(
        self, session: Session, obj: StoredObject, reader: bool = False, lease_id: int = 0
    ) -> int:
        """A new lease of `session` on `obj` (id `lease_id` if set aside, else a new one). A
        reader of a device object gets a read-done event with it (`session.read_events`),
        which the object keeps once the lease ends."""
        if not lease_id:
            lease_id = self._id()
        elif lease_id in session.leases:
            if session.leases[lease_id] is obj:
                return lease_id  # claimed already, by a client back after a restart
            raise InvalidRequest(f"lease {lease_id} is taken already")
        session.leases[lease_id] = obj
        obj.leases += 1
        self.lease_count += 1
        if reader and obj.events is not None:
            index = device_index(obj.device)
            session.read_events[lease_id] = self.devices.event(index)[0]
        return lease_id

    def hand_over(
        self, session: Session, obj: StoredObject, request_id: int | None, lease_id: int = 0
    ) -> int:
        """Give a queue item to its one consumer (asking by `request_id`; None: it has it
        already, on the lease `lease_id` set aside): the consumer's lease is now all that
        keeps it."""
        lease_id = self.lease(session, obj, reader=True, lease_id=lease_id)
        self._retire(obj, session.token, request_id)
        return lease_id

    def take_back(self, session: Session, lease_id: int, queue: Any) -> StoredObject | None:
        """An item of `queue` handed to `session` on `lease_id`, never taken, given back: live
        again, its slot still in flight, the lease gone. None if the lease holds no such item."""
        obj = session.leases.get(lease_id)  # an item handed over: retired, the lease its only hold
        if obj is None or obj.queue is not queue or obj.live or not obj.retired or obj.freed:
            return None
        if obj.leases != 1 or obj.events or lease_id in session.pending:  # (no device item)
            return None
        del session.leases[lease_id]
        obj.leases -= 1
        self.lease_count -= 1
        obj.live, obj.retired = True, False
        self.journal.returned(obj)
        return obj

    def release(self, session: Session, lease_id: int) -> bool:
        """End one lease; False (and nothing changes) if the session does not hold it."""
        obj = session.leases.pop(lease_id, None)
        if obj is None:
            return False
        read_done = session.read_events.pop(lease_id, None)
        if read_done is not None and obj.events is not None:
            self.devices.settle(obj.events, read_done)
        if lease_id in session.pending:  # the putter let go before sealing: abort
            self._unpend(session, lease_id)
            self._retire(obj)
        obj.leases -= 1
        self.lease_count -= 1
        self._maybe_free(obj)
        return True

    def drop_session(self, session: Session, keep_leases: bool = False) -> None:
        """Abort the session's unsealed puts and, unless kept, end all of its leases."""
        for put_id in list(session.pending):
            self.abort(session, put_id, keep=True)
        if not keep_leases:
            for lease_id in list(session.leases):
                self.release(session, lease_id)
            if session.region is not None and self.slots is not None:
                self.slots.release(session.region)  # what its slots held is free to go
                session.region = None

    def slotted(self, session: Session) -> bool:
        """Whether the session's lease slots hold anything."""
        if session.region is None or self.slots is None:
            return False
        return bool(self.slots.held(session.region))
