"""The device path's protocol, on a simulated CUDA runtime (tests/simcuda.py): a broker
thread and clients in this process, with host memory standing in for the GPU.

What these prove: which stream each copy runs on and each event is recorded on, which stream
waits for which event, that handles are opened once, that memory comes back only after the
readers' GPU work has finished, and the errors. What they cannot prove (a real GPU's
ordering, IPC across processes, JAX / torch / CuPy taking the capsules) is in tests/gpu.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from simcuda import SimCudaTensor, SimRuntime
from support import wait_until

import tensorbroker as tb
from tensorbroker.client import _dlpack
from tensorbroker.common.cudart import CHUNK_ALIGN, STREAM_LEGACY, STREAM_PER_THREAD
from tensorbroker.server.broker import Broker
from tensorbroker.server.store.devices import DeviceMemory

MiB = 1 << 20
READER_STREAM = 0xBEEF  # a consumer's own stream


class SimBroker:
    def __init__(
        self, rt: SimRuntime, spec: dict[int, int] | None, handles: str = "legacy"
    ) -> None:
        self.rt = rt
        self._dir = tempfile.TemporaryDirectory(prefix="tb-sim-")
        self.address = f"ipc://{self._dir.name}/broker.sock"
        devices = DeviceMemory(load=lambda: rt, spec=spec, handles=handles)
        self.broker = Broker(self.address, 16 * MiB, devices=devices)
        self.broker.bind()
        self._thread = threading.Thread(target=self.broker.serve, daemon=True)
        self._thread.start()

    def connect(self) -> tb.Client:
        c = tb.connect(self.address)
        c._transfer.devices._runtime = self.rt  # the client's side of the same simulated GPU
        return c

    def stop(self) -> None:
        self.broker.stop()
        self._thread.join(10)
        self._dir.cleanup()


@pytest.fixture
def sim() -> Iterator[SimBroker]:
    b = SimBroker(SimRuntime(devices=2), spec={0: 64 * MiB})
    yield b
    b.stop()


@pytest.fixture
def c(sim: SimBroker) -> Iterator[tb.Client]:
    with sim.connect() as client:
        yield client


def device_stats(c: tb.Client, device: str = "cuda:0") -> dict[str, int]:
    stats: dict[str, int] = c.stats()["devices"][device]
    return stats


def test_put_copies_on_the_producer_stream_and_records_the_write_event_without_host_sync(
    sim: SimBroker, c: tb.Client
) -> None:
    src = SimCudaTensor(sim.rt, 0, np.arange(1000, dtype=np.float32))
    assert c.put("x", src) == 1
    # The producer was asked for the stream the copy runs on; neither side waited on the host.
    assert src.streams == [STREAM_LEGACY]
    copy, record = sim.rt.called("copy")[-1], sim.rt.records()[-1]
    assert copy[1:] == (0, STREAM_LEGACY, 4000)
    assert record[3] == STREAM_LEGACY
    assert not sim.rt.called("synchronize") and not sim.rt.called("stream_synchronize")
    assert sim.rt.calls.index(copy) < sim.rt.calls.index(record)


def test_get_is_a_device_tensor_over_the_opened_chunk_with_the_values(
    sim: SimBroker, c: tb.Client
) -> None:
    values = np.arange(12, dtype=np.int64).reshape(3, 4)
    c.put("x", SimCudaTensor(sim.rt, 0, values))
    t = c.get("x")
    assert isinstance(t, tb.Tensor)
    assert t.device == "cuda:0" and t.__dlpack_device__() == (2, 0)
    # The pointer is the opened chunk's base plus the object's offset in it.
    chunk = next(iter(c._transfer.devices._chunks.values()))
    assert chunk.address <= t.data_ptr < chunk.address + 64 * MiB
    got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * 12).from_address(t.data_ptr))
    np.testing.assert_array_equal(got.reshape(3, 4), values)
    info = _dlpack.capsule_info(t.__dlpack__(stream=READER_STREAM))
    assert info[0] == t.data_ptr and info[6:8] == (2, 0)
    with pytest.raises(tb.InvalidRequest, match="cuda:0.*NumPy"):
        t.numpy()


@pytest.mark.parametrize(
    ("stream", "waits_on"),
    [
        (None, STREAM_LEGACY),
        (1, STREAM_LEGACY),
        (2, STREAM_PER_THREAD),
        (READER_STREAM, READER_STREAM),
        (-1, None),
    ],
)
def test_dlpack_stream_rules(sim: SimBroker, c: tb.Client, stream: Any, waits_on: Any) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    write_event = sim.rt.records()[-1][2]
    t = c.get("x")
    before = len(sim.rt.called("wait"))
    t.__dlpack__(stream=stream)
    waits = sim.rt.called("wait")[before:]
    if waits_on is None:
        assert waits == []
    else:
        assert waits == [("wait", 0, waits_on, write_event)]


def test_stream_zero_is_refused(sim: SimBroker, c: tb.Client) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    with pytest.raises(BufferError, match="stream=0"):
        c.get("x").__dlpack__(stream=0)


def test_handles_and_events_are_opened_once_per_client(sim: SimBroker, c: tb.Client) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(256, np.float32)))
    for _ in range(20):
        t = c.get("x")
        t.__dlpack__(stream=READER_STREAM)
        del t
        gc.collect()
    mem_opens = [n for h, n in sim.rt.opened.items() if h.startswith(b"mem")]
    assert mem_opens == [1]  # one chunk, opened once
    assert all(n == 1 for n in sim.rt.opened.values())


def test_memory_comes_back_only_after_the_readers_kernels_finish(
    sim: SimBroker, c: tb.Client
) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4 * MiB // 4, np.float32)))
    t = c.get("x")
    t.__dlpack__(stream=READER_STREAM)
    sim.rt.busy(READER_STREAM)  # the reader's kernels are still running ...
    del t
    gc.collect()
    # ... when it lets go: the read-done event is recorded on its stream, then released.
    assert wait_until(lambda: c.stats()["leases"] == 0, 5)
    read_done = [r for r in sim.rt.records() if r[3] == READER_STREAM]
    assert len(read_done) == 1
    c.delete("x")
    stats = device_stats(c)
    assert stats["waiting_bytes"] >= 4 * MiB and stats["used_bytes"] >= 4 * MiB
    sim.rt.finish(READER_STREAM)
    assert wait_until(lambda: device_stats(c)["used_bytes"] == 0, 5)
    assert device_stats(c)["waiting_bytes"] == 0


def test_a_reader_that_never_took_the_tensor_on_a_stream_releases_at_once(
    sim: SimBroker, c: tb.Client
) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(1024, np.float32)))
    t = c.get("x")
    del t
    assert wait_until(lambda: c.stats()["leases"] == 0, 5)
    c.delete("x")
    assert wait_until(lambda: device_stats(c)["used_bytes"] == 0, 5)


def test_a_put_waits_for_memory_held_back_by_running_readers(sim: SimBroker, c: tb.Client) -> None:
    big = np.ones(40 * MiB // 4, np.float32)  # two do not fit in 64 MiB
    c.put("x", SimCudaTensor(sim.rt, 0, big))
    t = c.get("x")
    t.__dlpack__(stream=READER_STREAM)
    sim.rt.busy(READER_STREAM)
    del t
    assert wait_until(lambda: c.stats()["leases"] == 0, 5)
    c.delete("x")
    threading.Timer(0.3, sim.rt.finish, (READER_STREAM,)).start()
    assert c.put("y", SimCudaTensor(sim.rt, 0, big)) == 1  # waited in the broker, then fit


def test_queue_slots_open_only_when_device_memory_is_back(sim: SimBroker, c: tb.Client) -> None:
    q = c.queue("frames", maxsize=1)
    q.put(SimCudaTensor(sim.rt, 0, np.ones(1024, np.float32)))
    item = q.get()
    assert isinstance(item, tb.Tensor) and item.device == "cuda:0"
    item.__dlpack__(stream=READER_STREAM)
    sim.rt.busy(READER_STREAM)
    del item
    with pytest.raises(tb.Timeout):
        q.put(SimCudaTensor(sim.rt, 0, np.ones(1024, np.float32)), timeout=0.3)
    sim.rt.finish(READER_STREAM)
    assert q.put(SimCudaTensor(sim.rt, 0, np.ones(1024, np.float32)), timeout=5) == 2


def test_a_broadcast_queue_carries_device_items(sim: SimBroker, c: tb.Client) -> None:
    """Device items are not journaled: giving one to a subscriber must not ask the journal
    for its row."""
    cast = c.broadcast("steps", maxsize=2)
    with sim.connect() as reader:
        sub = reader.subscribe("steps")
        cast.put(SimCudaTensor(sim.rt, 0, np.full(16, 3.0, np.float32)))
        item = sub.get(timeout=5)
        assert isinstance(item, tb.Tensor) and item.device == "cuda:0"
        del item
    cast.close()


def test_create_on_a_device_records_the_write_event_on_the_writer_stream(
    sim: SimBroker, c: tb.Client
) -> None:
    writer = 0xF00D
    with c.create("y", (256,), "float32", device="cuda:0") as buf:
        assert buf.device == "cuda:0"
        buf.__dlpack__(stream=writer)  # a writer's stream does not wait on anything
        assert not [w for w in sim.rt.called("wait") if w[2] == writer]
    assert sim.rt.records()[-1][3] == writer
    assert c.get("y").version == 1


def test_bundle_on_a_device(sim: SimBroker, c: tb.Client) -> None:
    w = SimCudaTensor(sim.rt, 0, np.arange(6, dtype=np.float32))
    b = SimCudaTensor(sim.rt, 0, np.arange(3, dtype=np.int32))
    c.put("weights", {"w": w, "b": b})
    got = c.get("weights")
    assert isinstance(got, dict) and {t.device for t in got.values()} == {"cuda:0"}


def test_a_bundle_of_tensors_end_to_end_in_one_buffer_is_put_in_one_copy(
    sim: SimBroker, c: tb.Client
) -> None:
    """A state_dict over a flat parameter buffer: tensors that lie end to end, and whose
    places in the object do too, go in one cudaMemcpyAsync; a gap starts another."""
    page = 4096 // 4  # float32 elements in a page: tensors of 64 KiB and up start on a page
    flat = SimCudaTensor(sim.rt, 0, np.arange(20 * page, dtype=np.float32))
    bundle = {"a": flat.view(0, 16 * page), "b": flat.view(16 * page, 20 * page)}
    before = len(sim.rt.called("copy"))
    c.put("flat", bundle)
    assert [call[3] for call in sim.rt.called("copy")[before:]] == [20 * 4096]
    b = c.get("flat")["b"]
    got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * (4 * page)).from_address(b.data_ptr))
    np.testing.assert_array_equal(got, np.arange(16 * page, 20 * page, dtype=np.float32))
    gap = {"a": flat.view(0, 16 * page), "b": flat.view(17 * page, 20 * page)}
    before = len(sim.rt.called("copy"))
    c.put("gap", gap)
    assert len(sim.rt.called("copy")[before:]) == 2


def test_a_state_dict_of_tensors_apart_is_copied_in_one_call_asking_its_stream_once(
    sim: SimBroker, c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors of separate allocations (a state_dict of 40): their copies go to the runtime
    in one call, in order, and the producer's stream is looked up once for the put."""
    from tensorbroker.client import sources

    asked: list[int] = []
    real = sources.producer_stream
    monkeypatch.setattr(sources, "producer_stream", lambda o, d: asked.append(d) or real(o, d))
    state = {
        f"layer{i}": SimCudaTensor(sim.rt, 0, np.full(300 + i, i, np.float32)) for i in range(40)
    }
    batches, copies = len(sim.rt.called("copy_batch")), len(sim.rt.called("copy"))
    c.put("state", state)
    assert sim.rt.called("copy_batch")[batches:] == [("copy_batch", 0, 40)]
    assert len(sim.rt.called("copy")) - copies == 40 and asked == [0]
    got = c.get("state")
    for i in (0, 17, 39):
        t = got[f"layer{i}"]
        values = np.ctypeslib.as_array(
            (np.ctypeslib.ctypes.c_float * (300 + i)).from_address(t.data_ptr)
        )
        assert (values == i).all()
    del got, t


# -- blocks granted ahead (Note [grants] in server/store/grants.py) ----------------------------


def _requests(c: tb.Client) -> dict[str, int]:
    return dict(c.stats()["requests"])


def test_device_puts_after_the_first_are_one_message_into_blocks_granted_ahead(
    sim: SimBroker, c: tb.Client
) -> None:
    """A device put writes into a block the broker granted ahead and seals it with one
    `write`: no trip for its memory first, one copy, the write event recorded after it."""
    values = [np.full(256 * 1024, v, np.float32) for v in range(4)]  # 1 MiB each
    c.put("w", SimCudaTensor(sim.rt, 0, values[0]))  # the first asks for grants
    before = _requests(c)
    for v in range(1, 4):
        copies = len(sim.rt.called("copy"))
        assert c.put("w", SimCudaTensor(sim.rt, 0, values[v])) == v + 1
        assert len(sim.rt.called("copy")) == copies + 1  # one copy, on the producer's stream
        assert sim.rt.called("copy")[-1][1:3] == (0, STREAM_LEGACY)
        assert sim.rt.records()[-1][3] == STREAM_LEGACY  # then its write event
    after = _requests(c)
    assert after.get("write", 0) - before.get("write", 0) == 3
    assert all(after.get(op, 0) == before.get(op, 0) for op in ("put", "grant", "seal")), after
    assert not sim.rt.called("synchronize") and not sim.rt.called("stream_synchronize")
    t = c.get("w")
    got = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_float * values[3].size).from_address(t.data_ptr)
    )
    np.testing.assert_array_equal(got, values[3])
    assert device_stats(c)["granted_bytes"] > 0  # the next put's block, ahead
    del t


def test_device_blocks_granted_ahead_go_back_when_their_client_closes(sim: SimBroker) -> None:
    with sim.connect() as c:
        for i in range(3):
            c.put(f"x{i}", SimCudaTensor(sim.rt, 0, np.ones(4096, np.float32)))
        assert device_stats(c)["granted_bytes"] > 0
    with sim.connect() as c:
        for i in range(3):
            c.delete(f"x{i}")
        assert wait_until(lambda: device_stats(c)["used_bytes"] == 0, 5)
        assert device_stats(c)["granted_bytes"] == 0 and c.stats()["leases"] == 0


def test_a_device_block_granted_ahead_is_refused_for_a_direct_handoff(
    sim: SimBroker, c: tb.Client
) -> None:
    from tensorbroker.common.protocol import Op

    grants = c._call(Op.GRANT, size=4096, device="cuda:0")["grants"]
    put, _, _, _, _, device, _, _ = grants[0]
    assert device == "cuda:0"
    granted, leases = device_stats(c)["granted_bytes"], c.stats()["leases"]
    q = c.queue("q")
    with pytest.raises(tb.InvalidRequest, match="device's block cannot be handed over"):
        c._call(Op.WRITE, put=put, queue=q._id, name="q", direct=[0, "x", 0, 0],
                tensors=[["", "float32", [1024]]])  # fmt: skip
    assert device_stats(c)["granted_bytes"] == granted - 4096  # it went back with the refusal
    assert c.stats()["pending"] == 0 and c.stats()["leases"] == leases


def test_a_client_holds_at_most_an_eighth_of_a_devices_memory_in_grants(
    sim: SimBroker, c: tb.Client
) -> None:
    """Grants ahead are memory no one else can use: a client that put 20 MiB once holds no
    idle 20 MiB block after it (the arena: 64 MiB), and another client's put still fits."""
    c.put("a", SimCudaTensor(sim.rt, 0, np.ones(5 * MiB, np.float32)))  # 20 MiB
    assert device_stats(c)["granted_bytes"] <= 64 * MiB // 8
    with sim.connect() as other:
        other.put("b", SimCudaTensor(sim.rt, 0, np.ones(10 * MiB, np.float32)))  # 40 MiB
        assert device_stats(other)["used_bytes"] >= 60 * MiB


def test_a_gpu_out_of_memory_ends_grants_not_the_broker(
    sim: SimBroker, c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cudaMalloc fails (torch's cache took the GPU, say) while the broker makes a chunk for
    the grants it tops up after a write, outside any request: it grants none, and goes on;
    a put that needs a chunk is told why."""
    sim.broker.registry.devices.arena("cuda:0")._chunk_size = 2 * MiB  # a chunk a top-up
    src = SimCudaTensor(sim.rt, 0, np.ones(MiB // 4, np.float32))  # 1 MiB
    big = SimCudaTensor(sim.rt, 0, np.ones(4 * MiB, np.float32))  # 16 MiB

    def no_memory(device: int, size: int) -> int:
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")

    c.put("w0", src)  # grants of its class, in the chunks there are
    monkeypatch.setattr(sim.rt, "malloc", no_memory)
    stored = ["w0"]
    for i in range(1, 12):  # writes into them, all kept; their top-ups need new chunks
        try:
            c.put(f"w{i}", src)
            stored.append(f"w{i}")
        except tb.CapacityError as exc:  # no grant left, and no chunk for an asked block
            assert "cuda:0 could not allocate a chunk" in str(exc)
    assert c.ping()["pid"] == os.getpid()  # (the broker is a thread of this process)
    with pytest.raises(tb.CapacityError, match="cuda:0 could not allocate a chunk"):
        c.put("big", big)
    assert len(stored) > 1 and sorted(c.keys()) == sorted(stored)


def test_asyncio_copies_a_large_granted_put_off_the_event_loop(sim: SimBroker) -> None:
    """A host array put to a device (a pageable copy: the host waits for it) into a block
    granted ahead: the copy runs in a worker thread, as an asked put's does."""
    import asyncio
    import threading

    copied_on: list[str] = []
    real = sim.rt.copy_async

    def copy_async(device: int, dst: int, src: int, size: int, stream: int) -> None:
        copied_on.append(threading.current_thread().name)
        real(device, dst, src, size, stream)

    sim.rt.copy_async = copy_async  # type: ignore[method-assign]

    async def put_twice() -> str:
        async with tb.aio.connect(sim.address) as ac:
            ac.sync._transfer.devices._runtime = sim.rt
            x = np.ones(MiB, np.float32)  # 4 MiB
            for _ in range(2):  # the second into a block granted ahead
                await ac.put("x", x, device="cuda:0", copy=True)
            assert _requests(ac.sync).get("write", 0) >= 1
            return threading.current_thread().name

    loop_thread = asyncio.run(put_twice())
    assert len(copied_on) == 2 and loop_thread not in copied_on, (loop_thread, copied_on)


def test_a_gpu_out_of_events_refuses_the_put_and_keeps_no_memory(
    sim: SimBroker, c: tb.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No interprocess event can be made for a device object (CUDA out of resources): its
    grant and its put are refused with why, and the block it took goes back."""
    src = SimCudaTensor(sim.rt, 0, np.ones(1024, np.float32))

    def no_events(device: int, interprocess: bool) -> int:
        raise RuntimeError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(sim.rt, "new_event", no_events)
    with pytest.raises(tb.CapacityError, match="cannot store 'x': cuda:0 could not make an event"):
        c.put("x", src)
    assert device_stats(c)["used_bytes"] == 0 and device_stats(c)["granted_bytes"] == 0
    assert c.stats()["leases"] == 0 and c.ping()["pid"] == os.getpid()
    monkeypatch.undo()
    assert c.put("x", src) == 1


# -- chunks a file descriptor names (Note [device handles] in server/store/devices.py) ---------


@pytest.fixture
def vmm() -> Iterator[SimBroker]:
    b = SimBroker(SimRuntime(devices=2), spec={0: 64 * MiB}, handles="vmm")
    yield b
    b.stop()


def test_vmm_chunks_reach_clients_as_descriptors_not_legacy_handles(vmm: SimBroker) -> None:
    """A client process is passed a chunk's descriptor over its lane, once, and maps it; no
    one is given a legacy IPC handle (a bearer token any process could open)."""
    values = np.arange(4096, dtype=np.float32)
    with vmm.connect() as producer, vmm.connect() as consumer:
        producer.put("x", SimCudaTensor(vmm.rt, 0, values))
        producer.put("y", SimCudaTensor(vmm.rt, 0, values + 1))
        t = consumer.get("x")
        got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_float * 4096).from_address(t.data_ptr))
        np.testing.assert_array_equal(got, values)  # the producer's copy, through the memfd
        consumer.get("y")
        assert device_stats(consumer)["handles"] == "vmm"
        assert vmm.rt.called("vmm_malloc") and not vmm.rt.called("open_mem")
        assert all(size < CHUNK_ALIGN for _, _, size in vmm.rt.called("malloc"))  # (sources)
        # One chunk, asked for and mapped once in this process (its clients share a mapping,
        # as they share an opened IPC handle), not once per object.
        assert len(vmm.rt.called("vmm_open")) == 1 and _requests(consumer)["chunk"] == 1
        del t


def test_a_client_dropped_without_close_is_still_freed(sim: SimBroker) -> None:
    """Its device link asks it for descriptors through a weak reference: the release thread,
    which holds the link, keeps no Client alive."""
    import weakref

    c = sim.connect()
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(16, np.float32)))
    ref = weakref.ref(c)
    with pytest.warns(ResourceWarning, match="unclosed tensorbroker Client"):
        del c
        gc.collect()
    assert ref() is None


def test_a_restarted_brokers_chunk_of_the_same_name_is_mapped_anew(vmm: SimBroker) -> None:
    """Chunks are known by their handle, not their name (cuda:0/1 again after a restart):
    a client never reads a chunk of the broker before through the new one's name."""
    with vmm.connect() as c:
        c.put("x", SimCudaTensor(vmm.rt, 0, np.full(16, 1.0, np.float32)))
        link = c._transfer.devices
        first = link.chunk(0, "cuda:0/1", next(iter(link._chunks)))
        other = link._map_fd  # the same name under another handle: mapped again
        asked: list[str] = []
        link._map_fd = lambda rt, device, name: asked.append(name) or other(rt, device, name)  # type: ignore[method-assign]
        again = link.chunk(0, "cuda:0/1", b"vmm:" + bytes(16) + b":cuda:0/1")
        assert asked == ["cuda:0/1"] and again is not first


def test_a_chunk_is_refused_to_a_request_that_cannot_carry_its_descriptor(
    vmm: SimBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorbroker.common.protocol import Op

    with vmm.connect() as c:
        c.put("x", SimCudaTensor(vmm.rt, 0, np.ones(16, np.float32)))
        with pytest.raises(tb.InvalidRequest, match="cuda:0 has no chunk 'cuda:0/9'"):
            c._conn.fetch_fd(Op.CHUNK, device="cuda:0", segment="cuda:0/9")  # type: ignore[union-attr]
        with pytest.raises(tb.InvalidRequest, match="a chunk is a GPU's"):
            c._conn.fetch_fd(Op.CHUNK, device="cpu", segment="cuda:0/1")  # type: ignore[union-attr]
        with pytest.raises(tb.InvalidRequest, match="cannot place a tensor on cuda:1"):
            c._conn.fetch_fd(Op.CHUNK, device="cuda:1", segment="cuda:1/1")  # type: ignore[union-attr]
    monkeypatch.setenv("TENSORBROKER_LANES", "off")  # ZeroMQ: no descriptor can ride on it
    with vmm.connect() as c:
        with pytest.raises(tb.InvalidRequest, match="goes over a lane"):
            c.get("x")
        assert c.ping()["pid"] == os.getpid()


def test_a_descriptor_that_does_not_map_is_an_error_that_says_so(
    vmm: SimBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[int] = []
    real_close = os.close

    def refuse(device: int, fd: int, size: int) -> int:
        raise RuntimeError("cuMemImportFromShareableHandle failed: CUDA driver error 1")

    with vmm.connect() as c:
        c.put("x", SimCudaTensor(vmm.rt, 0, np.ones(16, np.float32)))
    with vmm.connect() as c:
        monkeypatch.setattr(vmm.rt, "vmm_open", refuse)
        monkeypatch.setattr(os, "close", lambda fd: closed.append(fd) or real_close(fd))
        with pytest.raises(tb.InvalidRequest, match="could not map cuda:0/1 from the descriptor"):
            c.get("x")
        assert len(closed) == 1  # the descriptor passed was closed, not leaked
        monkeypatch.undo()
        assert c.stats()["leases"] == 0


def test_a_lane_holds_a_descriptor_behind_replies_it_could_not_write_yet() -> None:
    """A reply that passes a descriptor, queued behind bytes the client has not read, goes
    with its own first byte, not with the earlier replies'."""
    import array
    import socket

    from tensorbroker.server.sessions.lanes import Lane, Lanes

    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    lanes = Lanes.__new__(Lanes)
    lane = Lane(ours, b"L" * 9)
    lanes.by_fd, lanes.by_route = {ours.fileno(): lane}, {lane.route: lane}
    lanes._watch = lanes._unwatch = lambda *a: None  # type: ignore[method-assign]
    lanes._delivered = lambda route: None  # type: ignore[method-assign]
    read, write = os.pipe()
    try:
        lane.out += b"earlier"  # (as if the socket had been full)
        lanes.send(lane.route, b"withfd", write)
        lanes.send(lane.route, b"after")
        lanes.write(ours.fileno())
        data, ancillary, _, _ = theirs.recvmsg(7, socket.CMSG_SPACE(4))
        assert data == b"earlier" and not ancillary  # no descriptor with the earlier bytes
        data, ancillary, _, _ = theirs.recvmsg(64, socket.CMSG_SPACE(4))
        assert data == b"withfdafter" and len(ancillary) == 1  # (sent in one sendmsg)
        fds = array.array("i")
        fds.frombytes(ancillary[0][2])
        os.write(fds[0], b"!")  # the pipe's write end, passed
        assert os.read(read, 1) == b"!"
        os.close(fds[0])
    finally:
        for fd in (read, write):
            os.close(fd)
        ours.close()
        theirs.close()


# -- placement and copies ---------------------------------------------------------------


def test_host_tensor_to_a_device_needs_copy(sim: SimBroker, c: tb.Client) -> None:
    host = np.arange(8, dtype=np.float32)
    with pytest.raises(tb.InvalidRequest, match=r"on cpu and device='cuda:0'.*copy=True"):
        c.put("x", host, device="cuda:0")
    c.put("x", host, device="cuda:0", copy=True)
    t = c.get("x")
    assert t.device == "cuda:0"
    back = c.get("x", device="cpu", copy=True)
    assert back.device == "cpu"
    np.testing.assert_array_equal(back.numpy(), host)


def test_get_into_another_device_needs_copy(sim: SimBroker, c: tb.Client) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    with pytest.raises(tb.InvalidRequest, match=r"stored on cuda:0 and device='cpu'.*copy=True"):
        c.get("x", device="cpu")
    assert c.stats()["leases"] == 0 or wait_until(lambda: c.stats()["leases"] == 0, 5)
    c.put("h", np.ones(4, np.float32))
    with pytest.raises(tb.InvalidRequest, match=r"stored on cpu and device='cuda:0'"):
        c.get("h", device="cuda:0")


def test_device_tensor_to_the_host_needs_copy(sim: SimBroker, c: tb.Client) -> None:
    src = SimCudaTensor(sim.rt, 0, np.arange(5, dtype=np.int32))
    with pytest.raises(tb.InvalidRequest, match=r"on cuda:0 and device='cpu'"):
        c.put("x", src, device="cpu")
    c.put("x", src, device="cpu", copy=True)
    np.testing.assert_array_equal(c.get("x").numpy(), np.arange(5))


def test_a_bundle_mixing_devices_is_refused(sim: SimBroker, c: tb.Client) -> None:
    mixed = {"a": np.ones(2, np.float32), "b": SimCudaTensor(sim.rt, 0, np.ones(2, np.float32))}
    with pytest.raises(tb.InvalidRequest, match=r"mixes devices \('a' on cpu, 'b' on cuda:0\)"):
        c.put("m", mixed)


# -- refusals ---------------------------------------------------------------------------


def test_device_not_served_and_out_of_range(sim: SimBroker, c: tb.Client) -> None:
    with pytest.raises(tb.InvalidRequest, match=r"cuda:1: this broker serves cuda:0"):
        with c.create("y", (4,), "float32", device="cuda:1"):
            pass
    with pytest.raises(tb.InvalidRequest, match=r"cuda:7: there is no such device.*sees 2"):
        with c.create("y", (4,), "float32", device="cuda:7"):
            pass
    with pytest.raises(tb.InvalidRequest, match="unknown device 'gpu0'"):
        with c.create("y", (4,), "float32", device="gpu0"):
            pass
    assert c.keys() == []


def test_a_broker_with_cuda_off_says_so() -> None:
    b = SimBroker(SimRuntime(), spec={})
    try:
        with b.connect() as c:
            with pytest.raises(tb.InvalidRequest, match="--cuda-memory off"):
                c.put("x", SimCudaTensor(b.rt, 0, np.ones(4, np.float32)))
            c.put("h", np.ones(4, np.float32))  # the host path is unaffected
    finally:
        b.stop()


def test_a_per_thread_stream_read_is_covered_by_a_legacy_stream_read_done_event(
    sim: SimBroker, c: tb.Client
) -> None:
    """The read-done event is recorded on the release thread, where stream 2 would be that
    thread's own: it goes on the legacy default stream, which orders after it."""
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    t = c.get("x")
    t.__dlpack__(stream=STREAM_PER_THREAD)
    before = len(sim.rt.records())
    del t
    assert wait_until(lambda: len(sim.rt.records()) > before, 5)
    assert sim.rt.records()[-1][3] == STREAM_LEGACY


def test_two_clients_in_one_process_share_one_opening_of_a_chunk(
    sim: SimBroker, c: tb.Client
) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    with sim.connect() as other:
        a, b = c.get("x"), other.get("x")
        assert a.data_ptr == b.data_ptr
    assert [n for h, n in sim.rt.opened.items() if h.startswith(b"mem")] == [1]


def test_a_reader_that_took_the_tensor_with_stream_minus_one_lets_the_device_finish_first(
    sim: SimBroker, c: tb.Client
) -> None:
    c.put("x", SimCudaTensor(sim.rt, 0, np.ones(4, np.float32)))
    t = c.get("x")
    t.__dlpack__(stream=-1)  # the consumer's streams are unknown to us
    del t
    assert wait_until(lambda: c.stats()["leases"] == 0, 5)
    assert sim.rt.called("synchronize") == [("synchronize", 0)]


def test_a_create_writer_that_keeps_its_buffer_is_covered_when_it_lets_go(
    sim: SimBroker, c: tb.Client
) -> None:
    writer = 0xF00D
    with c.create("y", (256,), "float32", device="cuda:0") as buf:
        buf.__dlpack__(stream=writer)
    write_event = sim.rt.records()[-1][2]
    sim.rt.busy(writer)  # it goes on using the buffer after the seal
    del buf
    assert wait_until(lambda: c.stats()["leases"] == 0, 5)
    assert sim.rt.records()[-1][2:] == (write_event, writer)  # recorded again, then released
    c.delete("y")
    assert device_stats(c)["waiting_bytes"] > 0
    sim.rt.finish(writer)
    assert wait_until(lambda: device_stats(c)["used_bytes"] == 0, 5)
