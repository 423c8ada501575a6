"""A seeded fuzzer of the broker's requests, run as a process of its own (so that every
session it opens ends when it exits): `python fuzz.py ADDRESS SEED FRAMES`.

Each frame is a request of a random op (every op of the protocol) whose fields are kept,
dropped, or replaced by hostile values (wrong types, huge numbers, deep or long lists,
long strings), with a random `rel`; one in ten is random or truncated bytes. Valid fields are
common enough that puts, queues and waits really happen. Replies are read as the frames go.
It prints one JSON line: frames sent, replies read (by code), and the replies that are neither a
success nor a plain error (an internal error, an unknown code, a reply that is no map).
"""

from __future__ import annotations

import collections
import json
import os
import random
import secrets
import sys
from typing import Any

import msgpack
import zmq

from tensorbroker.common import host
from tensorbroker.common.fields import FIELDS as _FIELDS
from tensorbroker.common.protocol import PROTOCOL_VERSION, decode, encode

PLAIN_ERRORS = {
    "invalid", "protocol", "not_found", "capacity", "timeout", "hello_first", "queue_closed",
}  # fmt: skip


def valid(rng: random.Random, field: str) -> Any:
    """A plausible value for a field, so that requests get past validation often."""
    choices: dict[str, list[Any]] = {
        "key": [f"k{rng.randrange(8)}", "q"],
        "name": ["q", "r", f"k{rng.randrange(8)}"],
        "tensors": [
            [["", rng.choice(["float32", "uint8", "int64"]), [rng.randrange(0, 5000)]]],
            [["a", "float32", [2, 3]], ["b", "uint8", [7]]],
        ],
        "timeout": [0, 0.001, 0.01, None],
        "put": [rng.randrange(1, 64)],
        "queue": [rng.randrange(1, 8)],
        "maxsize": [0, 1, 2, 8],
        "size": [rng.choice([1, 4096, 1 << 20, 1 << 40])],
        "after": [rng.randrange(0, 4)],
        "bundle": [True, False],
        "keep": [True, False],
        "keep_leases": [True, False],
        "device": ["cpu", "cuda:0", "cuda:9999"],
        "version": [PROTOCOL_VERSION],
        "session": [secrets.token_hex(16)],
        "pid": [os.getpid()],
        "boot_id": [host.boot_id()],
        "start_time": [host.start_time(os.getpid())],
        "leases": [[rng.randrange(100), rng.randrange(100)]],
        "calls": [[rng.randrange(100)]],
        "keys": [[f"k{i}" for i in range(rng.randrange(1, 9))], ["q", "q"]],
        "num": [1, 2, 9],
        "prefix": ["", "k", "frames/"],
        "broadcast": [True, False],
        "sub": [rng.randrange(1, 4)],
    }
    return rng.choice(choices.get(field, [0]))


def hostile(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(14)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63)])
    if kind == 1:
        return rng.choice([0.0, -1.5, 1e308, float("inf"), float("nan")])
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return "x" * rng.choice([0, 1, 255, 1025, 5000])
    if kind == 4:
        return rng.choice(["\udc80", "é" * 600, "\x00", "cuda:", "float99"])
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 80))
    if kind == 6 and depth < 3:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 7 and depth < 3:
        keys = ["a", "op", "id", "", "é" * 10, "rel"]
        return {rng.choice(keys): hostile(rng, depth + 1) for _ in range(rng.randrange(3))}
    if kind == 8:
        value: Any = 1
        for _ in range(rng.choice([10, 100, 1000])):
            value = [value]
        return value
    if kind == 9:
        return [rng.randrange(-5, 2**40) for _ in range(rng.choice([0, 1, 33, 5000]))]
    if kind == 10:
        return [[]] * rng.choice([10, 9000, 60000])
    if kind == 11:
        return [["", "float32", [rng.randrange(-3, 2**50)]]] * rng.choice([1, 4097])
    if kind == 12:
        return [[str(i), "int8", [1] * rng.choice([1, 33])] for i in range(rng.choice([1, 3]))]
    return rng.randrange(0, 2**20)


def frame(rng: random.Random, ops: list[str]) -> bytes:
    if rng.random() < 0.1:  # not a request at all
        if rng.random() < 0.5:
            return rng.randbytes(rng.randrange(0, 200))
        return encode({"op": rng.choice(ops), "id": 1, "key": "k"})[: -rng.randrange(1, 4)]
    op = rng.choice(ops)
    message: dict[str, Any] = {"op": op, "id": rng.randrange(1, 2**20)}
    for field in _FIELDS[op]:
        roll = rng.random()
        if roll < 0.6:
            message[field] = valid(rng, field)
        elif roll < 0.85:
            message[field] = hostile(rng)
    if rng.random() < 0.2:
        message["rel"] = rng.choice([[rng.randrange(1, 100)], hostile(rng)])
    if rng.random() < 0.05:
        message[rng.choice(["extra", "", "\udc80", "x" * 300])] = hostile(rng)
    if rng.random() < 0.05:
        message["id"] = hostile(rng)
    try:
        return encode(message)
    except (TypeError, ValueError, OverflowError):  # a key msgpack cannot pack
        return encode({"op": op, "id": 1})


def main(address: str, seed: int, frames: int) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    ops = sorted(_FIELDS)
    hello = {"op": "hello", "id": 0, "version": PROTOCOL_VERSION, "session": secrets.token_hex(16)}
    sock.send(encode(hello))
    replies, odd, codes = 0, [], collections.Counter()

    def read(timeout_ms: int) -> bool:
        nonlocal replies
        if not sock.poll(timeout_ms):
            return False
        data = sock.recv()
        replies += 1
        try:
            reply = decode(data)
        except Exception as exc:
            odd.append(f"undecodable reply: {exc}")
            return True
        ok, code, error = reply.get("ok"), reply.get("code"), str(reply.get("error", ""))
        codes[str(code) if ok is not True else "ok"] += 1
        if ok is not True and (code not in PLAIN_ERRORS or "internal error" in error):
            odd.append(str(reply)[:300])
        return True

    for i in range(frames):
        sock.send(frame(rng, ops))
        if i % 50 == 49:
            while read(0):
                pass
        if i % 50 == 49:  # say hello again (a fuzzed bye ends the session), now and then anew
            if i % 1000 == 999:
                hello["session"] = secrets.token_hex(16)
            sock.send(encode(hello))
    while read(1000):
        pass
    sock.send(msgpack.packb({"op": "bye", "id": 0}))
    sock.close(linger=1000)
    ctx.term()
    summary = {"frames": frames, "replies": replies, "codes": codes, "odd": odd[:20]}
    print(json.dumps({**summary, "odd_count": len(odd)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
