"""Device names, --cuda-memory, and the broker's device memory on a simulated runtime."""

from __future__ import annotations

import numpy as np
import pytest
from simcuda import SimRuntime

import tensorbroker as tb
from tensorbroker.common.config import parse_cuda_memory
from tensorbroker.common.cudart import CudaUnavailable, parse_device
from tensorbroker.common.descriptors import DEVICE_ALIGN, grant_class
from tensorbroker.common.fields import check_device
from tensorbroker.server.store.arena import Arena
from tensorbroker.server.store.devices import DeviceMemory
from tensorbroker.server.store.records import Session, StoredObject
from tensorbroker.server.store.registry import Registry

MiB = 1 << 20


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        (None, None),
        ("auto", None),
        ("off", {}),
        ("0:8GiB", {0: 8 << 30}),
        ("0:8GiB, 1:512MiB", {0: 8 << 30, 1: 512 * MiB}),
        ("0,1", {0: 0, 1: 0}),
    ],
)
def test_parse_cuda_memory(text: str | None, spec: dict[int, int] | None) -> None:
    assert parse_cuda_memory(text) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [("gpu:8GiB", "DEVICE:SIZE"), ("0:8GiB,0:1GiB", "twice"), ("0:1MiB", "at least 2MiB"),
     ("0:lots", "cannot read size")],
)  # fmt: skip
def test_parse_cuda_memory_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cuda_memory(text)


@pytest.mark.parametrize(
    ("given", "name"),
    [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:3", "cuda:3"), ((2, 1), "cuda:1"), ((1, 0), "cpu")],
)
def test_parse_device(given: object, name: str) -> None:
    assert parse_device(given, "t") == name


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "CUDA:0", (7, 0), 3])
def test_parse_device_refuses(bad: object) -> None:
    with pytest.raises(tb.InvalidRequest, match="unknown device"):
        parse_device(bad, "t")


@pytest.mark.parametrize("bad", ["cuda:01", "cuda:x", "gpu", "cuda:99999", 0, None])
def test_wire_device_field(bad: object) -> None:
    assert check_device("cuda:12") == "cuda:12" and check_device("cpu") == "cpu"
    with pytest.raises(tb.InvalidRequest, match="device must be"):
        check_device(bad)


def _memory(rt: SimRuntime | None, spec: dict[int, int] | None = None) -> DeviceMemory:
    def load() -> SimRuntime:
        if rt is None:
            raise CudaUnavailable("CuPy is not installed here (simulated)")
        return rt

    devices = DeviceMemory(load=load, spec=spec)
    devices.start()
    return devices


def test_without_cuda_the_reason_is_in_the_refusal() -> None:
    devices = _memory(None)
    with pytest.raises(tb.InvalidRequest, match="cannot use CUDA: CuPy is not installed"):
        devices.arena("cuda:0")


def test_default_share_is_half_of_free_memory() -> None:
    rt = SimRuntime(devices=1, memory=100 * MiB)
    arena = _memory(rt).arena("cuda:0")
    assert arena.capacity == 50 * MiB // (2 * MiB) * (2 * MiB)


def test_device_blocks_are_aligned_and_chunks_whole_2mib_pages() -> None:
    rt = SimRuntime(devices=1)
    devices = _memory(rt, {0: 64 * MiB + 12345})
    registry = Registry(Arena(4 * MiB), devices=devices)
    session = Session("s", None)
    objs = []
    for n in (1, 100, 3000, 70_000):
        put, obj = registry.begin_put(
            session, f"k{n}", [("", "uint8", (n,))], False, device="cuda:0"
        )
        registry.seal(session, put, keep=False)
        objs.append(obj)
    assert all(o.block.offset % DEVICE_ALIGN == 0 for o in objs)
    assert all(size % (2 * MiB) == 0 for _, _, size in rt.called("malloc"))
    assert devices.arenas[0].capacity == 64 * MiB
    assert registry.arena.used_bytes == 0  # nothing went to host memory
    with pytest.raises(tb.CapacityError, match=r"on cuda:0.*--cuda-memory"):
        registry.begin_put(session, "huge", [("", "uint8", (65 * MiB,))], False, device="cuda:0")
    for key in ("k1", "k100", "k3000", "k70000"):
        registry.delete(key)
    assert devices.arenas[0].used_bytes == 0  # no reader ever recorded an event: back at once
    devices.close()
    assert len(rt.called("free")) == len(rt.called("malloc"))


def test_read_done_events_of_finished_readers_go_back_to_the_pool() -> None:
    """A long-lived object read many times keeps only the events of unfinished readers."""
    rt = SimRuntime(devices=1)
    devices = _memory(rt, {0: 8 * MiB})
    registry = Registry(Arena(4 * MiB), devices=devices)
    session = Session("s", None)
    put, obj = registry.begin_put(session, "w", [("", "float32", (16,))], False, device="cuda:0")
    registry.seal(session, put, keep=False)
    for _ in range(100):
        lease = registry.lease(session, obj, reader=True)
        registry.release(session, lease)
    assert obj.events is not None and len(obj.events) <= 2  # the write event and the last
    assert len(devices._events) <= 3
    np.testing.assert_equal(registry.stats()["leases"], 0)


def _device_object(registry: Registry, session: Session, key: str) -> StoredObject:
    put, obj = registry.begin_put(session, key, [("", "float32", (16,))], False, device="cuda:0")
    registry.seal(session, put, keep=False)
    return obj


def test_an_event_a_dead_reader_recorded_is_destroyed_never_handed_out_again() -> None:
    """A dead process's events never complete, even recorded again: reusing one would make
    every later reader of its next object wait forever."""
    rt = SimRuntime(devices=1)
    devices = _memory(rt, {0: 8 * MiB})
    registry = Registry(Arena(4 * MiB), devices=devices)
    writer, reader = Session("w", None), Session("r", None)
    obj = _device_object(registry, writer, "k")
    lease = registry.lease(reader, obj, reader=True)
    read_done = reader.read_events[lease]
    _, ev, _ = devices._events[read_done]
    rt.busy(0x99)
    rt.record(0, ev, 0x99)  # behind the reader's kernel, which its death takes with it
    rt.kill(0x99)
    devices.forget([read_done])
    registry.release(reader, lease)
    registry.delete("k")
    assert devices.arenas[0].used_bytes == 0  # counted as done: the memory is back
    assert ("destroy_event", 0, ev) in rt.calls
    for n in range(4):  # no later object or reader is given the dead event
        later = _device_object(registry, writer, f"k{n}")
        registry.lease(reader, later, reader=True)
        assert later.events is not None and read_done not in later.events
        assert read_done not in reader.read_events.values()


def test_a_producer_that_dies_before_its_copy_ran_loses_the_object() -> None:
    rt = SimRuntime(devices=1)
    devices = _memory(rt, {0: 8 * MiB})
    registry = Registry(Arena(4 * MiB), devices=devices)
    producer = Session("p", None)
    done = _device_object(registry, producer, "done")  # its copy ran: it stays
    queued = _device_object(registry, producer, "queued")
    assert queued.events is not None
    _, write, _ = devices._events[queued.events[0]]
    rt.busy(0x77)
    rt.record(0, write, 0x77)  # the copy waits behind a long kernel
    assert registry.writing(producer)
    rt.kill(0x77)
    assert registry.lose_unwritten(producer) == [queued]
    assert registry.objects == {"done": done}  # a later get finds no object that never held data
    assert devices.arenas[0].used_bytes == done.block.size  # and its memory is back
    assert ("destroy_event", 0, write) in rt.calls
    assert not registry.writing(producer)


@pytest.mark.parametrize(
    ("size", "host", "device"),
    [
        (1, 4096, 4096),
        (5000, 8192, 8192),
        (1 << 20, 1 << 20, 1 << 20),
        ((1 << 20) + 1, None, (1 << 20) + (1 << 17)),  # sixteenths of 2 MiB
        (600 * MiB, None, 640 * MiB),  # not 1 GiB: at most 1/8 more than the put
        (1 << 30, None, 1 << 30),
        ((1 << 32) + 1, None, None),  # too big to grant ahead: the put asks
    ],
)
def test_grant_classes_on_the_host_and_on_a_device(
    size: int, host: int | None, device: int | None
) -> None:
    assert grant_class(size) == host
    got = grant_class(size, device=True)
    assert got == device
    if got is not None:
        assert size <= got <= (max(4096, 2 * size) if size <= 1 << 20 else size + size // 8)
