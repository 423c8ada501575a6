"""The op table: which room's handler answers each op of a request (Op in
common/protocol.py). The broker's loop (broker.py) looks a request's op up here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..common.protocol import Op, Request
from .inventory import Inventory
from .queues.queues import Queues
from .seals import Seals
from .sessions.sessions import Sessions
from .store.chunks import ChunkFds
from .store.objects import Objects
from .store.records import Session

Handler = Callable[[Session, bytes, Request], "dict[str, Any] | None"]


def op_table(
    objects: Objects, seals: Seals, queues: Queues, sessions: Sessions, inventory: Inventory,
    chunks: ChunkFds, stats: Handler,
) -> dict[str, Handler]:  # fmt: skip
    """Each op's handler, the rooms' methods (hello and ping: the broker's own)."""
    return {
        Op.PUT: objects.put,
        Op.SEAL: seals.seal,
        Op.ABORT: objects.abort,
        Op.GRANT: objects.grant,
        Op.WRITE: seals.write,
        Op.QCREDIT: queues.slots.credit,
        Op.GET: objects.get,
        Op.WAIT: objects.wait,
        Op.WATCH_PREFIX: objects.watch_prefix,
        Op.DELETE: objects.delete,
        Op.EXISTS: objects.exists,
        Op.KEYS: objects.keys,
        Op.STATS: stats,
        Op.RELEASE: queues.rings.released,
        Op.HEARTBEAT: lambda session, route, req: None,
        Op.BYE: sessions.bye,
        Op.QOPEN: queues.open,
        Op.QPUT: queues.slots.put,
        Op.QGET: queues.get,
        Op.QSUB: queues.subscribe,
        Op.QUNSUB: queues.broadcasts.unsubscribe,
        Op.QCLOSE: queues.close,
        Op.QBACK: queues.give_back,
        Op.QUNCLAIM: queues.unclaim,
        Op.QINFO: queues.info,
        Op.QDELETE: queues.remove,
        Op.CANCEL: queues.handoffs.cancel,
        Op.LIST: inventory.objects,
        Op.QLIST: inventory.queue_list,
        Op.CLIENTS: inventory.clients,
        Op.CHUNK: chunks.chunk,
    }
