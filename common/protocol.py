"""The wire protocol: op codes, limits, request ids, msgpack encode/decode, replies.

No sockets here. A client's DEALER sends one frame per request, a msgpack map
``{"op": str, "id": int, ...fields}``; the broker's ROUTER answers with
``{"id": int, "ok": True, ...fields}`` or ``{"id": int, "ok": False, "code": str, "error": str}``.
Every request may carry ``"rel": [lease, ...]``: leases the client lets go of (batched).
Unpacking is bounded and never builds anything but plain data; nothing is ever unpickled.
Tensor bytes never travel here: only descriptors of shared memory. What each op's fields may
hold, and the checks that turn a decoded message into a Request, are in common/fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import BrokerError, ProtocolError

PROTOCOL_VERSION = 4  # 4: qunclaim, qback of a ring's item; 3: mailbox bodies are a head of
# u64s and a tail packed once per layout
MAX_MESSAGE_BYTES = 1 << 20
MAX_KEY_BYTES = 1024
MAX_NDIM = 32
MAX_TENSORS = 4096  # tensors in one bundle
MAX_NAME_BYTES = 1024
MAX_DEVICES = 1024  # device indices a request may name
MAX_RELEASES = 65536  # lease ids in one message
MAX_WAIT_KEYS = 4096  # keys one wait names
# What msgpack may build of one request, bounded before it builds it (decode_request, Budget):
MAX_CONTAINERS = 2 * MAX_TENSORS + 64  # maps and arrays: a bundle's specs and their shapes
MAX_ARRAY = 2 * MAX_RELEASES  # the longest array: a hello's leases, [lease, object, ...]
MAX_STRING = 64 << 10  # bytes of one string or bin (a longer key is still answered by id)
MAX_FIELDS = 64  # entries of one map


class Op:
    HELLO = "hello"  # pid, session, boot_id, start_time, version -> broker facts
    PUT = "put"  # key, tensors [[name, dtype, shape], ...], bundle, device, evictable -> put id,
    # descriptors
    # (a device object's replies add its chunk's IPC "handle" and its write "event" [id,
    # handle]; a get's adds the reader's read-done event as "done")
    SEAL = "seal"  # put, keep -> version (and the put's lease ends unless keep)
    ABORT = "abort"  # put
    GRANT = "grant"  # size -> grants [[put id, object id, segment, offset, size], ...]
    WRITE = "write"  # put (a block granted ahead), key or queue, tensors, bundle -> version,
    # grants (refills of that size), credits (a queue's slots granted ahead)
    QCREDIT = "qcredit"  # queue, timeout -> credits (waits, as a qput, for a free slot)
    GET = "get"  # key, timeout (None: wait forever), after -> object descriptor with a lease
    # (with deletes and after: {deleted} if the key is gone, or goes while the get waits)
    WAIT = "wait"  # keys, num, timeout -> keys: those that exist once `num` do, or at timeout
    WATCH_PREFIX = "watchp"  # prefix, after, run, timeout -> events [[n, kind, key, version],
    # ...], next (the number to ask after next), run (whose numbers), overflowed (some missed)
    DELETE = "delete"  # key
    EXISTS = "exists"  # key -> exists
    KEYS = "keys"  # -> keys
    STATS = "stats"  # -> counters
    RELEASE = "release"  # rel, done (idle ring slots); no reply
    PING = "ping"  # -> pid, version
    HEARTBEAT = "hb"  # no reply
    BYE = "bye"  # the client is closing; no reply
    QOPEN = "qopen"  # name, maxsize -> queue id, maxsize
    QPUT = "qput"  # queue, tensors, bundle, timeout -> as put (then seal / abort)
    QGET = "qget"  # queue, timeout -> as get
    QSUB = "qsub"  # queue -> sub: a subscription to a broadcast queue (its qgets name it)
    QUNSUB = "qunsub"  # queue, sub
    QCLOSE = "qclose"  # queue
    QBACK = "qback"  # queue, leases: items handed to this client that it never took (gets
    # it gave up), back to the queue as it closes -> back (the leases given back); or queue,
    # ring: the item a failed get took from the queue's ring at that position -> back (bool)
    QUNCLAIM = "qunclaim"  # queue, ring: a put for that position given up with no answer ->
    # aborted (whether the broker had granted it: it is aborted; else none will be)
    QINFO = "qinfo"  # queue -> len, maxsize, in_flight, closed
    QDELETE = "qdelete"  # name: remove a queue (its consumers get QueueClosed)
    CANCEL = "cancel"  # call (the id of a request of this socket) -> cancelled: whether it
    # was still waiting (it then gets no answer); else its answer went before this one
    LIST = "list"  # prefix, after, limit, by ("key" or "size") -> objects [{key, version,
    # nbytes, device, leases, bundle, tensors, evictable}, ...], more (keys after the last)
    QLIST = "qlist"  # -> queues [{name, depth, maxsize, in_flight, closed, ...}, ...]
    CLIENTS = "clients"  # -> clients [{pid, uid, sockets, leases, held_bytes, parked, ...}]
    CHUNK = "chunk"  # device, segment -> size, and the VMM chunk's file descriptor passed with
    # the reply over the lane (Note [device handles] in server/store/devices.py)


NO_REPLY = frozenset({Op.RELEASE, Op.HEARTBEAT, Op.BYE})


def encode(message: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(message, use_bin_type=True)
    return packed


def decode(frame: bytes, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Unpack one message; ProtocolError for anything but a bounded msgpack map."""
    if len(frame) > limit:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {limit}")
    try:
        # unpackb bounds every string, array and map by the frame's own length.
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a msgpack map, got {type(message).__name__}")
    return message


class Budget:
    """The limits a request's unpacking keeps to: how long an array, map or string may be
    (msgpack's own checks) and how many maps and arrays it may build in all (`hook`, called
    by msgpack for each one it built). A million empty arrays in one 1 MiB frame would take
    the broker 400 ms to build; past MAX_CONTAINERS it stops at once. `reset` before each
    message."""

    __slots__ = ("left", "options")

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS
        # keyword arguments for msgpack.unpackb or msgpack.Unpacker
        self.options: dict[str, Any] = {
            "raw": False,
            "strict_map_key": True,
            "max_array_len": MAX_ARRAY,
            "max_map_len": MAX_FIELDS,
            "max_str_len": MAX_STRING,
            "max_bin_len": MAX_STRING,
            "max_ext_len": 0,
            "list_hook": self.hook,
            "object_hook": self.hook,
        }

    def reset(self) -> None:
        self.left = MAX_CONTAINERS

    def hook(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(f"a request may hold at most {MAX_CONTAINERS} maps and arrays")
        return value


def decode_request(frame: bytes, budget: Budget) -> dict[str, Any]:
    """Unpack one request within `budget`'s limits; ProtocolError for anything else."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    budget.reset()
    try:
        message = msgpack.unpackb(frame, **budget.options)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a msgpack map, got {type(message).__name__}")
    return message


def reply_ok(request_id: int, **fields: Any) -> bytes:
    return encode({"id": request_id, "ok": True, **fields})


def reply_error(request_id: int, error: BrokerError) -> bytes:
    return encode({"id": request_id, "ok": False, "code": error.code, "error": str(error)})


@dataclass(frozen=True, slots=True)
class Request:
    """A request that passed its checks (common/fields.py, parse_request): its op, its id,
    its fields as checked and the leases it lets go of."""

    op: str
    id: int
    fields: dict[str, Any]
    releases: list[int]


def request_id(message: Any) -> int | None:
    """The message's request id if it is a valid one (an int in [0, 2**63)), else None."""
    value = message.get("id", 0) if isinstance(message, dict) else 0
    return value if type(value) is int and 0 <= value < 1 << 63 else None
