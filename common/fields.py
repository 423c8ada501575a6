"""Field validation, the other half of the wire protocol (common/protocol.py): what each op's
request may carry (FIELDS), the check of every field, and parse_request, which turns a decoded
message into a Request or refuses it (ProtocolError when it cannot be answered by id,
InvalidRequest otherwise). No sockets here either; the limits it checks are protocol's.
"""

from __future__ import annotations

import contextlib
import math
import reprlib
from collections.abc import Callable
from typing import Any

from .cudart import device_index, parse_device
from .dtypes import DTYPES
from .errors import InvalidRequest, ProtocolError
from .protocol import (
    MAX_ARRAY,
    MAX_DEVICES,
    MAX_KEY_BYTES,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_RELEASES,
    MAX_TENSORS,
    MAX_WAIT_KEYS,
    Op,
    Request,
    request_id,
)

_REPR = reprlib.Repr()  # a value a client sent, in an error message: bounded in depth and size
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


def shown(value: Any, limit: int = 80) -> str:
    """`value` for an error message: never more than `limit` characters, and never a repr of
    all of it (a list nested 1,000 deep must not cost a RecursionError)."""
    return _REPR.repr(value)[:limit]


def check_key(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"a key must be a non-empty string, got {shown(value)}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidRequest(
            f"key {value[:40]!r}... is {size} bytes of UTF-8, over the limit of {MAX_KEY_BYTES}"
        )
    return value


def check_timeout(value: Any) -> float | None:
    """Seconds to wait: None (or infinity) waits as long as it takes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidRequest(f"timeout must be None or a number >= 0, got {shown(value)}")
    return None if math.isinf(value) else float(value)


def check_shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_NDIM:
        raise InvalidRequest(
            f"shape must be a list of at most {MAX_NDIM} sizes, got {shown(value)}"
        )
    if not all(type(d) is int and 0 <= d < 1 << 48 for d in value):
        raise InvalidRequest(f"shape must hold sizes in [0, 2**48), got {shown(value)}")
    return tuple(value)


def check_tensor_specs(value: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """[[name, dtype, shape], ...] -> validated tuples; names unique."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TENSORS:
        raise InvalidRequest(f"tensors must be a list of 1 to {MAX_TENSORS} [name, dtype, shape]")
    specs = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3):
            raise InvalidRequest(f"each tensor must be [name, dtype, shape], got {shown(item)}")
        name, dtype, shape = item
        if not isinstance(name, str) or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise InvalidRequest(
                f"a tensor name must be a string of at most {MAX_NAME_BYTES} bytes"
            )
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise InvalidRequest(
                f"unsupported dtype {shown(dtype)}; supported: {', '.join(DTYPES)}"
            )
        specs.append((name, dtype, check_shape(shape)))
    if len({s[0] for s in specs}) != len(specs):
        raise InvalidRequest("tensor names in a bundle must be unique")
    return specs


def check_device(value: Any) -> str:
    """'cpu' or 'cuda:N', canonical (as the client sends it: parse_device's form)."""
    if isinstance(value, str):
        with contextlib.suppress(InvalidRequest):
            if parse_device(value, "device") == value:
                if value == "cpu" or device_index(value) < MAX_DEVICES:
                    return value
    raise InvalidRequest(f"device must be 'cpu' or 'cuda:N', got {shown(value)}")


def check_prefix(value: Any) -> str:
    """A key prefix: "" (every key) or a key's start."""
    return "" if value == "" else check_key(value)


def check_keys(value: Any) -> list[str]:
    """1 to MAX_WAIT_KEYS distinct keys."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_WAIT_KEYS:
        raise InvalidRequest(f"keys must be a list of 1 to {MAX_WAIT_KEYS} keys")
    keys = [check_key(k) for k in value]
    if len(set(keys)) != len(keys):
        raise InvalidRequest("keys must be distinct")
    return keys


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"expected a non-negative integer, got {shown(value)}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"expected true or false, got {shown(value)}")
    return value


def _pid(value: Any) -> int | None:
    if value is not None and (type(value) is not int or not 0 < value < 1 << 31):
        raise InvalidRequest(f"expected a process id, got {shown(value)}")
    return value


def _opt_start(value: Any) -> int | None:
    return None if value is None else _int(value)


def _ring_slots(value: Any) -> list[tuple[int, int]]:
    """Ring slots a subscriber found idle, flat: [queue id, version, ...] (one array, not an
    array per slot: Budget; Note [broadcast ring])."""
    if (
        not isinstance(value, list) or len(value) % 2 or len(value) > MAX_ARRAY
        or not all(type(v) is int and v >= 0 for v in value)
    ):  # fmt: skip
        raise InvalidRequest(f"expected [queue id, version, ...], got {shown(value)}")
    return list(zip(value[::2], value[1::2], strict=True))


def _str(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise InvalidRequest(f"expected a short string, got {shown(value)}")
    return value


def _lease_pairs(value: Any) -> list[tuple[int, int]]:
    """The leases a client that comes back holds, flat: [lease id, object id, ...] (one
    array, not an array per lease: Budget)."""
    if (
        not isinstance(value, list)
        or len(value) % 2
        or not all(type(x) is int and x >= 0 for x in value)
    ):
        raise InvalidRequest("leases must be a flat list of lease id, object id, ...")
    return list(zip(value[::2], value[1::2], strict=True))


def _ids(value: Any) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > MAX_RELEASES
        or not all(type(x) is int and x >= 0 for x in value)
    ):
        raise InvalidRequest("expected a list of ids (request or lease ids)")
    return value


def _direct(value: Any) -> list[Any]:
    if (
        not isinstance(value, list)
        or len(value) != 4
        or type(value[1]) is not str
        or not all(type(v) is int and 0 <= v < 1 << 63 for v in (value[0], *value[2:]))
    ):
        raise InvalidRequest("expected [token, session, lease, version]")
    return value


# op -> {field: (validator, required)}
_Check = Callable[[Any], Any]
FIELDS: dict[str, dict[str, tuple[_Check, bool]]] = {
    Op.HELLO: {
        "version": (_int, True),
        "session": (_str, True),
        "pid": (_pid, False),
        "boot_id": (_str, False),
        "start_time": (_opt_start, False),
        "leases": (_lease_pairs, False),
        "calls": (_ids, False),
    },
    Op.PUT: {
        "key": (check_key, True),
        "tensors": (check_tensor_specs, True),
        "bundle": (_bool, False),
        "device": (check_device, False),
        "evictable": (_bool, False),
    },
    Op.SEAL: {"put": (_int, True), "keep": (_bool, False), "item": (_bool, False)},
    Op.ABORT: {"put": (_int, True), "keep": (_bool, False)},
    Op.GRANT: {"size": (_int, True), "device": (check_device, False)},
    Op.WRITE: {
        "put": (_int, True),
        "key": (check_key, False),
        "queue": (_int, False),
        "name": (check_key, False),
        "tensors": (check_tensor_specs, True),
        "bundle": (_bool, False),
        "evictable": (_bool, False),
        "direct": (_direct, False),  # [grant token, consumer's session, lease, version]
        "undone": (_int, False),  # a grant claimed and not filled (Note [direct handoff])
    },
    Op.GET: {
        "key": (check_key, True),
        "timeout": (check_timeout, False),
        "after": (_int, False),
        "deletes": (_bool, False),  # a watch: answer {"deleted"} once the key is gone
    },
    Op.WAIT: {"keys": (check_keys, True), "num": (_int, True), "timeout": (check_timeout, False)},
    Op.WATCH_PREFIX: {
        "prefix": (check_prefix, True),
        "after": (_int, False),
        "run": (_int, False),
        "timeout": (check_timeout, False),
    },
    Op.DELETE: {"key": (check_key, True)},
    Op.EXISTS: {"key": (check_key, True)},
    Op.KEYS: {},
    Op.STATS: {},
    Op.RELEASE: {"done": (_ring_slots, False)},
    Op.PING: {},
    Op.CHUNK: {"device": (check_device, True), "segment": (_str, True)},
    Op.HEARTBEAT: {},
    Op.BYE: {"keep_leases": (_bool, False)},
    Op.QOPEN: {
        "name": (check_key, True),
        "maxsize": (_int, False),
        "broadcast": (_bool, False),
        "ring": (_bool, False),  # the client can use a queue ring (Note [queue ring])
    },
    Op.QSUB: {"queue": (_int, True), "name": (check_key, False), "ring": (_bool, False)},
    Op.QUNSUB: {"queue": (_int, True), "sub": (_int, True), "name": (check_key, False)},
    # Queue ops name the queue by the id `qopen` gave; "name" only words their errors.
    Op.QPUT: {
        "queue": (_int, True),
        "name": (check_key, False),
        "tensors": (check_tensor_specs, True),
        "bundle": (_bool, False),
        "timeout": (check_timeout, False),
        "device": (check_device, False),
        "ring": (_int, False),  # the position in the queue's ring it was claimed for
    },
    Op.QGET: {
        "queue": (_int, True),
        "name": (check_key, False),
        "timeout": (check_timeout, False),
        "sub": (_int, False),
        "ring": (_int, False),  # the item at this position, taken from the ring
        "mailbox": (_bool, False),  # it waits on its bell (Note [direct handoff])
    },
    Op.QCREDIT: {
        "queue": (_int, True),
        "name": (check_key, False),
        "timeout": (check_timeout, False),
    },
    Op.QCLOSE: {"queue": (_int, True), "name": (check_key, False)},
    Op.QBACK: {"queue": (_int, True), "leases": (_ids, False), "ring": (_int, False)},
    Op.QUNCLAIM: {"queue": (_int, True), "ring": (_int, True)},
    Op.QINFO: {"queue": (_int, True), "name": (check_key, False)},
    Op.QDELETE: {"name": (check_key, True)},
    Op.CANCEL: {"call": (_int, True)},
    Op.LIST: {
        "prefix": (check_prefix, False),
        "after": (check_key, False),
        "limit": (_int, False),
        "by": (_str, False),
    },
    Op.QLIST: {},
    Op.CLIENTS: {},
}


def parse_request(message: dict[str, Any]) -> Request:
    """Validate a decoded request. ProtocolError when it cannot be answered by id at all is
    impossible to avoid; otherwise the error carries the request id for the reply."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a msgpack map, got {type(message).__name__}")
    op, req_id = message.get("op"), request_id(message)
    if req_id is None:
        raise ProtocolError(
            f"request id must be a non-negative integer, got {shown(message.get('id'))}"
        )
    spec = FIELDS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise ProtocolError(f"unknown op {shown(op)}; this broker speaks {', '.join(FIELDS)}")
    fields: dict[str, Any] = {}
    for name, (check, required) in spec.items():
        if name in message:
            try:
                fields[name] = check(message[name])
            except InvalidRequest as exc:
                raise InvalidRequest(f"{op}: field {name!r}: {exc}") from None
        elif required:
            raise InvalidRequest(f"{op}: missing field {name!r}")
    releases = message.get("rel", [])
    if (
        not isinstance(releases, list)
        or len(releases) > MAX_RELEASES
        or not all(type(r) is int and r >= 0 for r in releases)
    ):
        raise InvalidRequest(f"{op}: 'rel' must be a list of lease ids")
    return Request(str(op), req_id, fields, releases)
