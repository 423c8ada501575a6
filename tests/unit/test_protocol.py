"""Unit tests for the wire protocol (common/protocol.py, common/fields.py) and the error tree
(common/errors.py)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

import tensorbroker as tb
from tensorbroker.common.dtypes import DTYPES
from tensorbroker.common.errors import (
    BrokerError,
    BrokerUnavailable,
    CapacityError,
    InvalidRequest,
    NotFound,
    ProtocolError,
    QueueClosed,
    Timeout,
    error_from_wire,
)
from tensorbroker.common.fields import check_key, check_shape, check_tensor_specs, parse_request
from tensorbroker.common.protocol import (
    MAX_KEY_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_NDIM,
    MAX_RELEASES,
    NO_REPLY,
    Op,
    decode,
    encode,
    reply_error,
    reply_ok,
)

# -- encode / decode ------------------------------------------------------------------------


def test_encode_decode_round_trip() -> None:
    message = {
        "op": "put",
        "id": 2**62,
        "key": "caf\u00e9/\u6f22\u5b57",
        "tensors": [["w", "float32", [3, 4]], ["", "bfloat16", []]],
        "bundle": True,
        "timeout": 1.5,
        "none": None,
        "blob": b"\x00\xff",
        "rel": [1, 2, 3],
    }
    assert decode(encode(message)) == message


def test_reply_helpers_round_trip() -> None:
    assert decode(reply_ok(7, version=3)) == {"id": 7, "ok": True, "version": 3}
    err = decode(reply_error(8, NotFound("no object 'k'")))
    assert err == {"id": 8, "ok": False, "code": "not_found", "error": "no object 'k'"}


def test_decode_refuses_oversized_frames() -> None:
    # A real map, valid msgpack, just too long: the size check comes before unpacking.
    frame = encode({"op": "ping", "pad": "x" * MAX_MESSAGE_BYTES})
    assert len(frame) > MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError, match=str(MAX_MESSAGE_BYTES)):
        decode(frame)
    small = encode({"op": "ping", "pad": "x" * 100})
    with pytest.raises(ProtocolError, match="exceeds 50"):
        decode(small, limit=50)
    assert decode(small, limit=len(small))["op"] == "ping"


@pytest.mark.parametrize(
    "value", [[1, 2], 3, -1, "ping", None, 1.5, b"bytes", True], ids=lambda v: type(v).__name__
)
def test_decode_refuses_non_maps(value: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        decode(encode(value))


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xc1", b"\x92\x01", b"\x80\x80", b"\xdb\xff\xff\xff\xff", b"\xa3\xff\xfe\xfd"],
    ids=["empty", "never-used-byte", "truncated", "extra-data", "huge-str-len", "bad-utf8"],
)
def test_decode_refuses_garbage(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="undecodable"):
        decode(frame)


@pytest.mark.parametrize(
    "key", [1, -1, None, 1.5, (1, 2)], ids=["int", "neg", "nil", "float", "array"]
)
def test_decode_refuses_maps_with_non_str_keys(key: Any) -> None:
    frame = msgpack.packb({"op": "ping", key: 1}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode(frame)


def test_bytes_keys_do_not_make_a_request() -> None:
    # msgpack's strict_map_key lets bin keys through decode; they must still not parse as fields
    message = decode(msgpack.packb({b"op": "ping", b"id": 1}, use_bin_type=True))
    with pytest.raises(ProtocolError, match="unknown op"):
        parse_request(message)


# -- parse_request --------------------------------------------------------------------------


def test_parse_request_accepts_a_good_request() -> None:
    req = parse_request(
        {"op": "put", "id": 5, "key": "k", "tensors": [["", "int64", [2, 3]]], "rel": [9, 10]}
    )
    assert (req.op, req.id, req.releases) == ("put", 5, [9, 10])
    assert req.fields == {"key": "k", "tensors": [("", "int64", (2, 3))]}


def test_parse_request_defaults() -> None:
    req = parse_request({"op": "hb"})
    assert (req.op, req.id, req.fields, req.releases) == ("hb", 0, {}, [])
    assert {Op.RELEASE, Op.HEARTBEAT, Op.BYE} == NO_REPLY


@pytest.mark.parametrize("op", ["frobnicate", "", "PUT", 3, None, ["put"]])
def test_unknown_op_is_a_protocol_error(op: Any) -> None:
    with pytest.raises(ProtocolError, match="unknown op") as info:
        parse_request({"op": op, "id": 1})
    assert "ping" in str(info.value)  # it lists the ops it does speak


def test_missing_op_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unknown op"):
        parse_request({"id": 1})


@pytest.mark.parametrize("request_id", [-1, "1", 1.0, True, None, 2**63, [1]])
def test_bad_request_id_is_a_protocol_error(request_id: Any) -> None:
    with pytest.raises(ProtocolError, match="request id"):
        parse_request({"op": "ping", "id": request_id})


def test_largest_request_id_is_accepted() -> None:
    assert parse_request({"op": "ping", "id": 2**63 - 1}).id == 2**63 - 1


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"op": "put", "tensors": [["", "int8", [1]]]}, "key"),
        ({"op": "put", "key": "k"}, "tensors"),
        ({"op": "seal"}, "put"),
        ({"op": "abort"}, "put"),
        ({"op": "get"}, "key"),
        ({"op": "delete"}, "key"),
        ({"op": "exists"}, "key"),
        ({"op": "hello", "session": "s"}, "version"),
        ({"op": "hello", "version": 1}, "session"),
    ],
)
def test_missing_field_is_named(message: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=f"missing field '{field}'") as info:
        parse_request({"id": 1, **message})
    assert str(info.value).startswith(message["op"])


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"op": "put", "key": 5, "tensors": [["", "int8", [1]]]}, "key"),
        ({"op": "put", "key": "k", "tensors": "int8"}, "tensors"),
        ({"op": "put", "key": "k", "tensors": [["", "int8", [1]]], "bundle": 1}, "bundle"),
        ({"op": "seal", "put": "1"}, "put"),
        ({"op": "seal", "put": -1}, "put"),
        ({"op": "seal", "put": 1.0}, "put"),
        ({"op": "seal", "put": 1, "keep": "yes"}, "keep"),
        ({"op": "abort", "put": None}, "put"),
        ({"op": "get", "key": "k", "timeout": -1}, "timeout"),
        ({"op": "get", "key": "k", "timeout": "1"}, "timeout"),
        ({"op": "get", "key": "k", "timeout": True}, "timeout"),
        ({"op": "get", "key": "k", "timeout": float("nan")}, "timeout"),
        ({"op": "hello", "version": "1", "session": "s"}, "version"),
        ({"op": "hello", "version": 1, "session": 7}, "session"),
        ({"op": "hello", "version": 1, "session": "s" * 257}, "session"),
        ({"op": "hello", "version": 1, "session": "s", "pid": -5}, "pid"),
        ({"op": "hello", "version": 1, "session": "s", "boot_id": 1}, "boot_id"),
        ({"op": "hello", "version": 1, "session": "s", "start_time": "x"}, "start_time"),
        ({"op": "bye", "keep_leases": 0}, "keep_leases"),
    ],
)
def test_ill_typed_field_is_named(message: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=f"field '{field}'") as info:
        parse_request({"id": 1, **message})
    assert str(info.value).startswith(message["op"])


def test_optional_fields_accept_none_where_allowed() -> None:
    req = parse_request({"op": "get", "id": 1, "key": "k", "timeout": None})
    assert req.fields["timeout"] is None
    req = parse_request({"op": "hello", "id": 1, "version": 1, "session": "s", "pid": None})
    assert req.fields["pid"] is None


# -- keys -----------------------------------------------------------------------------------


def test_key_limits() -> None:
    assert check_key("k" * MAX_KEY_BYTES) == "k" * MAX_KEY_BYTES
    two_byte = "\u00e9" * (MAX_KEY_BYTES // 2)  # the limit counts UTF-8 bytes, not characters
    assert check_key(two_byte) == two_byte
    with pytest.raises(InvalidRequest, match=f"{MAX_KEY_BYTES + 1} bytes"):
        check_key("k" * (MAX_KEY_BYTES + 1))
    with pytest.raises(InvalidRequest, match=f"{MAX_KEY_BYTES + 1} bytes"):
        check_key(two_byte + "a")
    with pytest.raises(InvalidRequest, match="non-empty"):
        check_key("")


@pytest.mark.parametrize("key", [b"k", 1, None, ["k"], 1.5])
def test_key_must_be_a_string(key: Any) -> None:
    with pytest.raises(InvalidRequest, match="non-empty string"):
        check_key(key)


def test_key_limits_through_parse_request() -> None:
    ok = parse_request({"op": "exists", "id": 1, "key": "k" * MAX_KEY_BYTES})
    assert ok.fields["key"] == "k" * MAX_KEY_BYTES
    with pytest.raises(InvalidRequest, match="field 'key'"):
        parse_request({"op": "exists", "id": 1, "key": "k" * (MAX_KEY_BYTES + 1)})


# -- shapes and tensor specs ----------------------------------------------------------------


def test_shapes_within_limits() -> None:
    assert check_shape([]) == ()
    assert check_shape([0, 3]) == (0, 3)
    assert check_shape((2**48 - 1,)) == (2**48 - 1,)
    assert check_shape([1] * MAX_NDIM) == (1,) * MAX_NDIM


@pytest.mark.parametrize(
    "shape",
    [
        [-1],
        [3, -2],
        [2**48],
        [2**64],
        [True],
        [1, False],
        [1.0],
        ["3"],
        [None],
        [1] * (MAX_NDIM + 1),
    ],
    ids=["neg", "neg2", "2**48", "2**64", "true", "false", "float", "str", "nil", "too-many-dims"],
)
def test_bad_shapes_are_refused(shape: list[Any]) -> None:
    with pytest.raises(InvalidRequest, match="shape"):
        check_shape(shape)


@pytest.mark.parametrize("shape", ["3", 3, {"a": 1}, None, b"\x03"])
def test_shape_must_be_a_list(shape: Any) -> None:
    with pytest.raises(InvalidRequest, match="shape must be a list"):
        check_shape(shape)


def test_bad_shape_through_parse_request_names_the_field() -> None:
    with pytest.raises(InvalidRequest, match="field 'tensors'.*shape"):
        parse_request({"op": "put", "id": 1, "key": "k", "tensors": [["", "int8", [-4]]]})


def test_tensor_specs_are_validated() -> None:
    specs = check_tensor_specs([["a", "float32", [2]], ["b", "uint8", []]])
    assert specs == [("a", "float32", (2,)), ("b", "uint8", ())]
    for name in DTYPES:
        assert check_tensor_specs([["", name, [1]]])[0][1] == name


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(InvalidRequest, match="'float8'") as info:
        check_tensor_specs([["", "float8", [1]]])
    assert "float32" in str(info.value)  # and the supported ones are listed


def test_duplicate_tensor_names_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="unique"):
        check_tensor_specs([["a", "int8", [1]], ["a", "int8", [2]]])


@pytest.mark.parametrize(
    "tensors",
    [
        [],
        "x",
        [["a", "int8"]],
        [("a", "int8", [1])],
        [[1, "int8", [1]]],
        [["n" * 1025, "int8", [1]]],
    ],
    ids=["empty", "not-list", "two-items", "tuple-item", "int-name", "long-name"],
)
def test_malformed_tensor_specs_are_refused(tensors: Any) -> None:
    with pytest.raises(InvalidRequest):
        check_tensor_specs(tensors)


@pytest.mark.parametrize("dtype", [["float32"], {"name": "float32"}], ids=["list", "map"])
def test_unhashable_dtype_is_an_invalid_request(dtype: Any) -> None:
    with pytest.raises(InvalidRequest, match="dtype"):
        check_tensor_specs([["", dtype, [1]]])


# -- 'rel' ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    ["1", 1, [-1], [True], [1.0], ["1"], [None], {"1": 1}, [0] * (MAX_RELEASES + 1)],
    ids=["str", "int", "neg", "bool", "float", "str-item", "nil", "map", "too-many"],
)
def test_bad_rel_is_refused(rel: Any) -> None:
    with pytest.raises(InvalidRequest, match="'rel'"):
        parse_request({"op": "ping", "id": 1, "rel": rel})


def test_rel_within_limits() -> None:
    assert parse_request({"op": "release", "rel": [0, 5, 2**63]}).releases == [0, 5, 2**63]
    assert len(parse_request({"op": "ping", "rel": [1] * MAX_RELEASES}).releases) == MAX_RELEASES


# -- errors ---------------------------------------------------------------------------------

WIRE_CODES = {
    "broker_error": BrokerError,
    "unavailable": BrokerUnavailable,
    "timeout": Timeout,
    "not_found": NotFound,
    "capacity": CapacityError,
    "invalid": InvalidRequest,
    "protocol": ProtocolError,
    "queue_closed": QueueClosed,
}


@pytest.mark.parametrize(("code", "cls"), WIRE_CODES.items())
def test_error_from_wire_maps_each_code(code: str, cls: type[BrokerError]) -> None:
    err = error_from_wire(code, f"something about {code}")
    assert type(err) is cls
    assert cls.code == code
    assert str(err) == f"something about {code}"
    # and an error sent by the broker comes back as the same class
    sent = decode(reply_error(1, cls("msg")))
    assert type(error_from_wire(sent["code"], sent["error"])) is cls


def test_error_from_wire_unknown_code_is_a_broker_error() -> None:
    err = error_from_wire("no_such_code", "what happened")
    assert type(err) is BrokerError
    assert str(err) == "what happened"


def test_error_class_tree() -> None:
    for cls in WIRE_CODES.values():
        assert issubclass(cls, BrokerError)
    assert issubclass(NotFound, KeyError)
    assert issubclass(Timeout, TimeoutError)
    assert issubclass(InvalidRequest, ValueError)
    assert not issubclass(ProtocolError, ValueError)
    with pytest.raises(KeyError):
        raise NotFound("k")
    with pytest.raises(TimeoutError):
        raise Timeout("t")
    with pytest.raises(ValueError):
        raise InvalidRequest("v")
    # the public names are the same classes
    assert (tb.NotFound, tb.Timeout, tb.InvalidRequest) == (NotFound, Timeout, InvalidRequest)


def test_not_found_reads_as_plain_text() -> None:
    assert str(NotFound("x")) == "x"
    assert str(NotFound("no object 'k'")) == "no object 'k'"
    assert str(BrokerError()) == "broker_error"
