"""The bytes between brokers, moved by NIXL (UCX underneath: RDMA where the hardware has it,
TCP or shared memory otherwise). Each broker has one NIXL agent, named after its node; the
arena's segments are registered with it once, as they are made, never per transfer. Agent
metadata travels in the cluster's own msgpack messages (cluster.py): NIXL's listener thread
and its pickled descriptors are never used, so nothing from the network is unpickled.

The puller drives: it asks for the bytes of a block its peer lent it in pieces, a window of
them under way (reads.py). Each piece is READ into a block of its own, or, for a version lent
in host memory of at least PUSH_MIN bytes, written there by the lender at its request (Note
[pushes] in pushes.py: UCX's TCP has no zero-copy READ). NIXL's transfers run on a thread of
their own (mover.py: no NIXL call of a transfer runs on the broker's loop), and the loop
looks whether they ended when that thread wakes it (`fd`); the lender keeps the block
pinned until the puller says it is through.

A GPU object's bytes go the same way between device chunks, registered with NIXL as VRAM
as each chunk is made (`register_chunk`): NIXL's UCX backend moves them device to device
(GPUDirect RDMA where the hardware has it). Its replica goes to the same device on the
reader's node.

Note [inline]

A queue item of 4 KiB took 1.7-2.4 ms from its put to its consumer on another node (a
ZeroMQ round trip: 59 us), and a get that pulled 4 KiB 1.2-1.4 ms. Traced: the item's
NIXL READ took 450-530 us from its post to its end (the lender's progress thread woken,
the reader's thread looking every 0.2 ms), and 300-400 us more went handing it to the
mover's thread and back to the loop. So an object in host memory of at most INLINE bytes
goes with its `lent` or `qitem` (`offer(inline=True)`), msgpack bytes in the message
that says where it is, and the reader copies them into its block (`take`): no read. All
else is as for a read: the lender pins it until the reader says it is through, and the
reader seals it in its order. An announcement's offer (Note [offers]) goes without: most
peers that hear it never read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import mmap
import os
from typing import Any

from ...common.errors import InvalidRequest
from .mover import Mover
from .pushes import Pushes
from .reads import CHUNK, INLINE, POPULATED, WINDOW, Reading, Reads

PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")  # tensorbroker[cluster] installs one of these
# The progress thread's pause between rounds, in microseconds. The reads' target needs the
# thread (UCX over TCP emulates them with messages): without it a read from a broker whose
# loop sleeps never ends. The thread waits in poll() on its UCX worker's event fd (armed:
# UCX's traffic wakes it at once) with this as the timeout, rounded up to whole ms (0: it
# spins, NIXL Python agent's default: three idle brokers took 22 CPU-s in 26 s). A round
# without an event only covers what UCX leaves unsignalled: 50 ms costs an idle broker
# 0.05% of a core (1 ms: 1.7%), and a pull is as fast as with 1 ms (it is woken anyway).
PROGRESS_PAUSE_US = 50_000


def load_nixl() -> Any:
    """NIXL's Python API; InvalidRequest saying how to install it if it is missing."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # NIXL loads NumPy: no BLAS pool here
    # UCX's memory events (hooks patched into mmap and friends, for its registration cache)
    # cost 0.4 CPU-s at each agent's start, 90% of it. NIXL hands UCX the handle of memory
    # registered beforehand, and every byte moved here is in a segment registered once
    # (`register`): no cache to invalidate. An operator's own setting stands.
    os.environ.setdefault("UCX_MEM_EVENTS", "no")
    # Two threads use the UCX worker (the mover's, asking whether its reads ended, and NIXL's
    # progress thread), and UCX guards it with a spinlock by default: the one that waits
    # spins for as long as the other moves bytes. With 4 brokers on this 2-core VM, a 512
    # MiB weight sync spent 11-14% of all CPU in pthread_spin_lock; with a mutex, none, and
    # a version reached the last of 3 readers in 523-660 ms instead of 693-896 ms.
    os.environ.setdefault("UCX_USE_MT_MUTEX", "y")
    # UCX's TCP transport cuts what it moves into segments; with its default sizes a 256 MiB
    # read between two brokers on this 2-core VM took 326-373 ms (median of 5), with 1 MiB
    # segments 124-140 ms (64 KiB: 202, 512 KiB: 140, 4 MiB: 138), small gets and the
    # brokers' memory unchanged. Other transports (RDMA, shared memory) do not read these.
    for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
        os.environ.setdefault(name, "1m")
    for name in PACKAGES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise InvalidRequest(
        "a cluster needs NIXL: pip install 'tensorbroker[cluster]' (or nixl-cu12 / nixl-cu13 "
        "with --no-deps next to the torch you have)"
    )


def new_agent(node: str) -> Any:
    """A NIXL agent named `node` as a broker makes it: UCX, NIXL's read-write thread mode (the
    mover's thread reads while the loop registers memory), its progress thread paced."""
    api = load_nixl()
    config = api.nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    )  # fmt: skip
    return _paced_agent(api, node, config)


def _paced_agent(api: Any, node: str, config: Any) -> Any:
    """NIXL's agent, with its progress thread pausing PROGRESS_PAUSE_US between rounds (the
    Python agent offers no such option: the config class it makes is swapped for the call)."""
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig

    class Paced(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "pthrDelay":
                value = max(int(value), PROGRESS_PAUSE_US)
            super().__setattr__(name, value)

    bindings.nixlAgentConfig = Paced
    try:
        return api.nixl_agent(node, config)
    finally:
        bindings.nixlAgentConfig = base


__all__ = ["CHUNK", "INLINE", "POPULATED", "WINDOW", "Reading", "Transfers", "new_agent"]


class Transfers(Pushes, Reads):
    """This broker's NIXL agent, its registered segments (mapped here for NIXL: the broker maps
    no segment otherwise) and the reads under way."""

    def __init__(self, node: str, shm_dir: str, agent: Any = None) -> None:
        """`agent`: NIXL's, made here if None (a test's stand-in otherwise)."""
        super().__init__()
        self.node = node
        self.agent = new_agent(node) if agent is None else agent
        self.mover = Mover(self.agent)
        self.fd = self.mover.fd  # readable when a read ended (the loop polls it)
        self.shm_dir = shm_dir
        self._mapped: dict[str, tuple[mmap.mmap, int]] = {}  # segment -> (mapping, address)
        self._chunks: dict[str, tuple[int, int]] = {}  # device chunk -> (pointer, device)
        self._peers: dict[str, bytes] = {}  # node -> the metadata its agent was added with
        self._versions: dict[str, tuple[int, int]] = {}  # node -> that metadata's version
        self.incarnation = 0  # this broker's (the cluster sets it): metadata versions
        self._registered = 0  # segments registered so far (the other half)
        self._metadata: tuple[int, bytes] = (-1, b"")  # (_registered, metadata) when last asked
        self._populated: set[int] = set()  # address // POPULATED of host memory read into

    # -- memory ------------------------------------------------------------------------------

    def register(self, segment: str) -> None:
        """Map `segment` (an arena segment, in shm_dir) and register it with NIXL, once. A
        peer knows it from metadata taken after this (`metadata`), not before."""
        if segment in self._mapped:
            return
        fd = os.open(os.path.join(self.shm_dir, segment), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.agent.register_memory([(address, size, 0, segment)], "DRAM")
        self._mapped[segment] = (mapping, address)
        self._registered += 1

    def register_chunk(self, name: str, ptr: int, size: int, device: int) -> None:
        """Register a device chunk (of the broker's, never freed before it stops) with NIXL as
        VRAM, once. OSError if NIXL cannot (a build without CUDA, say): its objects are then
        not lent."""
        if name in self._chunks:
            return
        try:
            self.agent.register_memory([(ptr, size, device, name)], "VRAM")
        except Exception as exc:
            raise OSError(f"NIXL could not register {name} as VRAM: {exc!r}") from None
        self._chunks[name] = (ptr, device)
        self._registered += 1

    def address(self, segment: str, offset: int) -> int:
        """Where byte `offset` of a registered segment lies in this process."""
        return self._mapped[segment][1] + offset

    def _place(self, obj: Any) -> tuple[int, str, int]:
        """Where a StoredObject's bytes are: address, NIXL memory type, device id."""
        block = obj.block
        if obj.device == "cpu":
            self.register(block.segment)
            return self.address(block.segment, block.offset), "DRAM", 0
        chunk = self._chunks.get(block.segment)
        if chunk is None:
            raise OSError(f"{block.segment} is not registered with NIXL (no VRAM here)")
        return chunk[0] + block.offset, "VRAM", chunk[1]

    # -- peers -------------------------------------------------------------------------------

    @property
    def metadata(self) -> bytes:
        """This agent's metadata, asked of NIXL again only once a segment or chunk was
        registered since: it changes with nothing else, and NIXL takes its lock for it, which
        a read on the mover's thread may hold (a hello to a peer every BEAT waited 1.45 s so
        during a 512 MiB pull, the loop answering nothing meanwhile)."""
        if self._metadata[0] != self._registered:
            self._metadata = (self._registered, bytes(self.agent.get_agent_metadata()))
        return self._metadata[1]

    def agent_fields(self) -> dict[str, Any]:
        """This agent's metadata of now, for a message, with its version (`add_peer`)."""
        return {"agent": self.metadata, "agent_v": [self.incarnation, self._registered]}

    def add_peer(self, node: str, metadata: bytes, version: Any = None) -> None:
        """Know the agent of `node` (again, if it restarted, or registered a segment since: its
        metadata is new). Metadata older than what is known (`version`: its incarnation, then
        its segments registered; messages on two links keep no order between them) is not
        taken: it would make NIXL forget the newer segments."""
        v = None
        if isinstance(version, list) and len(version) == 2:
            v = (int(version[0]), int(version[1]))
        known = self._versions.get(node)
        if v is not None and known is not None and v < known:
            return
        if v is not None:
            self._versions[node] = v
        if self._peers.get(node) == metadata:
            return
        replaced = node in self._peers
        self._peers[node] = metadata
        self.mover.call(lambda: self._load(node, metadata, replaced), node if replaced else None)

    def unknown(self, node: str) -> None:
        """NIXL failed a transfer with `node` (would not start it, or it ended in error): it
        may have dropped that peer's agent. NIXL's current source does so itself when a
        transfer finds the connection gone (NIXL_ERR_REMOTE_DISCONNECT, a network blip with
        the peer alive, say); the 1.5.1 here kept it in a scratch test. The metadata the next
        message of `node` carries is loaded again then, even if it is what was loaded: else
        it is taken for known, and every transfer with `node` is refused (nixlNotFoundError)
        until the peer registers a segment."""
        if node in self._peers:
            self._peers[node] = b""  # (loaded in place of what NIXL may still have)

    def _load(self, node: str, metadata: bytes, replaced: bool) -> None:
        """NIXL told of `node`'s agent `metadata` (on the mover's thread: Mover.call), in place
        of the one it knew. ValueError if NIXL refused it (logged there): reads from `node`
        fail until it sends other metadata (it restarted, or registered a segment)."""
        if replaced:
            with contextlib.suppress(Exception):  # (none, if NIXL refused the last one)
                self.agent.remove_remote_agent(node)
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise ValueError(f"NIXL refused the agent of node {node!r}: {exc!r}") from None
        if (name.decode() if isinstance(name, bytes) else name) != node:
            self.agent.remove_remote_agent(name)
            raise ValueError(f"the peer {node!r} sent the metadata of agent {name!r}")

    # -- offers: an object's bytes lent to a peer, and read from one ---------------------------

    def offer(self, obj: Any, agent: bool = True, inline: bool = False) -> dict[str, Any]:
        """Where a StoredObject's bytes are, for a peer to read them (the fields of a `lent`
        or a `qitem`): its layout and address, and, if `agent`, this agent's metadata of now
        (it knows the segment: an adopted one, say; an offer sent with an announcement goes
        without, Note [offers]); `inline`: its bytes too, if it is in host memory and at most
        INLINE bytes (Note [inline]; the caller has it pinned)."""
        address, _, _ = self._place(obj)
        offer = {
            "bundle": obj.bundle, "specs": [[t.name, t.dtype, list(t.shape)] for t in obj.tensors],
            "size": obj.nbytes, "address": address,
        }  # fmt: skip
        if obj.device != "cpu":
            offer["device"] = obj.device
        elif inline and obj.nbytes <= INLINE:
            offer["data"] = ctypes.string_at(address, obj.nbytes)
        if agent:
            offer.update(self.agent_fields())
        return offer

    def layout(self, node: str, offer: dict[str, Any]) -> tuple[list[Any], bool, str]:
        """The specs, bundle flag and device of `node`'s `offer`, for a block of its size
        here (its agent known from now on, if it sent its metadata)."""
        if "agent" in offer:
            self.add_peer(node, bytes(offer["agent"]), offer.get("agent_v"))
        specs = [(str(n), str(d), tuple(s)) for n, d, s in offer["specs"]]
        return specs, bool(offer["bundle"]), str(offer.get("device", "cpu"))

    def close(self) -> bool:
        """Whether the transfers under way ended (else NIXL may still use the segments:
        they are left mapped)."""
        if not self.mover.close():
            return False
        for mapping, _ in self._mapped.values():
            try:
                mapping.close()
            except BufferError:  # the address handed to NIXL still points into it
                pass
        self._mapped.clear()
        return True
