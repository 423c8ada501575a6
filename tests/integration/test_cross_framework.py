"""Separate PyTorch, JAX and NumPy processes share tensors through the broker, with no copy."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import pytest
import workers
from support import CHILDREN, join_all

import tensorbroker as tb


def test_torch_producer_jax_and_numpy_readers_share_one_copy(broker: tb.BrokerProcess) -> None:
    results, holding, done = CHILDREN.Queue(), CHILDREN.Queue(), CHILDREN.Event()
    modified = CHILDREN.Event()
    producer = CHILDREN.Process(
        target=workers.torch_producer, args=(broker.address, done), name="torch"
    )
    readers = [
        CHILDREN.Process(
            target=workers.reader, name=fw, args=(fw, broker.address, results, holding, modified)
        )
        for fw in ("jax", "numpy")
    ]
    for p in [producer, *readers]:
        p.start()
    try:
        assert {holding.get(timeout=120), holding.get(timeout=120)} == {"jax", "numpy"}
        reports: dict[tuple[str, str], Any] = {}
        for _ in range(4):
            fw, what, *rest = results.get(timeout=10)
            reports[fw, what] = rest

        # The same values in both readers, as the producer wrote them.
        with tb.connect(broker.address) as c:
            f32, bf16 = c.get("f32"), c.get("bf16")
            expected = (f32.numpy().tobytes(), bf16.numpy().tobytes())
            assert struct.unpack("<3f", expected[0][:12]) == (0.0, 0.5, 1.0)
            for fw in ("jax", "numpy"):
                assert tuple(reports[fw, "values"]) == expected, fw
                # Each reader's arrays lie in a /dev/shm mapping of its own process.
                where = reports[fw, "where"]
                assert where[0] and where[0].startswith("/dev/shm/tb-"), (fw, where)
                assert where[1] and where[1].startswith("/dev/shm/tb-"), (fw, where)

            # Change the bytes through the test's own mapping of the segment: both readers,
            # which already hold their arrays, see the change. There is one copy.
            path, offset = workers.file_offset(f32.data_ptr)
            fd = os.open(path, os.O_RDWR)
            try:
                with mmap.mmap(fd, 0) as mm:
                    mm[offset + 4 : offset + 12] = struct.pack("<2f", 42.0, -7.0)
            finally:
                os.close(fd)
            del f32, bf16
        modified.set()
        after = {}
        for _ in range(2):
            fw, what, *rest = results.get(timeout=60)
            after[fw] = tuple(rest)
        assert after == {"jax": (42.0, -7.0), "numpy": (42.0, -7.0)}
    finally:
        modified.set()
        join_all([producer, *readers])


def test_every_dtype_round_trips_between_torch_jax_and_numpy(broker: tb.BrokerProcess) -> None:
    frameworks = ["torch", "jax", "numpy"]
    results, produced = CHILDREN.Queue(), CHILDREN.Queue()
    procs = [
        CHILDREN.Process(
            target=workers.dtype_roundtrip,
            name=fw,
            args=(fw, broker.address, [o for o in frameworks if o != fw], results, produced),
        )
        for fw in frameworks
    ]
    for p in procs:
        p.start()
    try:
        reports = dict(results.get(timeout=180) for _ in frameworks)
    finally:
        join_all(procs, timeout=60)
    failures = [
        f"{producer} -> {consumer} {name}: equal={equal} zero_copy={zero_copy} dtype={dtype}"
        for consumer, report in reports.items()
        for (producer, name), (equal, zero_copy, dtype) in report.items()
        if not (equal and zero_copy and dtype == name)
    ]
    assert len(reports) == 3 and all(
        len(r) == 2 * len(workers.DTYPE_NAMES) for r in reports.values()
    )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_consumer_arrays_point_into_the_broker_segment(client: tb.Client, framework: str) -> None:
    client.put("x", workers.reference("float32"))
    t = client.get("x")
    assert isinstance(t, tb.Tensor)
    array = workers.consume(framework, t)
    assert workers.data_ptr(framework, array) == t.data_ptr
    assert (workers.shm_mapping(t.data_ptr) or "").startswith("/dev/shm/tb-")
    assert t.data_ptr % 64 == 0  # JAX copies silently below 64-byte alignment
