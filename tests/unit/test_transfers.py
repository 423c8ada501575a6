"""The agents of a cluster's brokers (server/cluster/transfers.py): a peer's agent metadata, the
newest kept; reads run off the broker's loop (mover.py). NIXL's agent is stood in for (the
integration tests run the real one)."""

from __future__ import annotations

import select
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tensorbroker.server.cluster.transfers import (
    CHUNK,
    INLINE,
    POPULATED,
    WINDOW,
    Transfers,
)
from tests.support import in_thread, wait_until


class Agent:
    """NIXL's agent as Transfers uses it for metadata: it names what is registered."""

    def __init__(self, name: str) -> None:
        self.name, self.segments, self.remote = name, 0, {}  # type: ignore[var-annotated]
        self.added: list[bytes] = []
        self.lock = threading.Lock()  # NIXL's (held while a transfer is posted)
        self.calls = 0  # agents added

    def register_memory(self, regions: Any, kind: str) -> None:
        self.segments += 1

    def get_agent_metadata(self) -> bytes:
        return f"{self.name}:{self.segments}".encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        with self.lock:
            name = metadata.split(b":")[0]
            self.remote[name.decode()] = metadata
            self.added.append(metadata)
            self.calls += 1
            return name

    def remove_remote_agent(self, name: str) -> None:
        with self.lock:
            del self.remote[name]


def _transfers(name: str, shm: Path, agent: Any = None) -> Transfers:
    t = Transfers(name, str(shm), agent or Agent(name))
    t.incarnation = 7
    return t


def test_older_agent_metadata_does_not_undo_newer(tmp_path: Path) -> None:
    """a's `lent` (on its ROUTER) and its `agent` message (on its DEALER) keep no order
    between them: metadata of before a segment was registered, read after the one of after,
    must not make b forget that segment."""
    a, b = _transfers("a", tmp_path), _transfers("b", tmp_path)
    old = a.agent_fields()
    (tmp_path / "seg").write_bytes(bytes(4096))
    a.register("seg")
    new = a.agent_fields()
    assert new["agent_v"] == [7, 1] and new["agent"] != old["agent"]
    b.add_peer("a", new["agent"], new["agent_v"])
    b.add_peer("a", old["agent"], old["agent_v"])
    b.add_peer("a", old["agent"], [8, 0])  # a restarted (a new incarnation): taken
    assert wait_until(lambda: b.agent.calls == 2, 5)  # (on the mover's thread)
    assert b.agent.remote["a"] == old["agent"] and b.agent.added == [new["agent"], old["agent"]]
    a.close()
    b.close()


class Reading(Agent):
    """An agent whose reads are under way until the test says (`over`), and whose post of a
    read and look at it block while `stuck` (as one `check_xfer_state` did for 2.84 s on a
    busy host, and a `transfer` for 4.2 s)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.over, self.state = threading.Event(), "DONE"
        self.stuck, self.looking = threading.Event(), threading.Event()
        self.posting = threading.Event()
        self.released: list[Any] = []

    def get_xfer_descs(self, regions: Any, kind: str) -> Any:
        return regions

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        if node == "nobody":
            raise RuntimeError("nixlNotFoundError")
        return object()

    def transfer(self, handle: Any) -> str:
        with self.lock:
            self.posting.set()
            if self.stuck.is_set():
                assert self.over.wait(10), "the test never let the read end"
            return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        self.looking.set()
        if self.stuck.is_set():
            assert self.over.wait(10), "the test never let the read end"
        return self.state if self.over.is_set() else "PROC"

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)


def _ended(t: Transfers) -> bool:
    return bool(select.select([t.fd], [], [], 5)[0])


def test_a_read_whose_nixl_look_blocks_does_not_block_the_loop(tmp_path: Path) -> None:
    """Issue 50's second fault: NIXL's look at a read blocked the broker's loop. Now the
    mover's thread looks; the loop's `done` makes no NIXL call, and the loop is woken (`fd`)
    when the read ends."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    read = t.read("a", 1000, 2000, 4096)
    assert agent.looking.wait(5)  # the thread is in NIXL's look, then stays in the next
    agent.stuck.set()
    for _ in range(3):
        assert not t.done(read)  # (it would hang here if it called NIXL)
    agent.over.set()
    assert _ended(t) and t.done(read) and agent.released == [read.reads[0].handle]
    t.close()


def test_reads_that_fail_say_why_when_the_loop_looks(tmp_path: Path) -> None:
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    refused = t.read("nobody", 1000, 2000, 4096)
    assert _ended(t)
    with pytest.raises(OSError, match="could not start a read of 4096 bytes from 'nobody'"):
        t.done(refused)
    agent.state = "ERR"
    failed = t.read("a", 1000, 2000, 4096)
    agent.over.set()
    assert wait_until(failed.ended, 5)
    with pytest.raises(OSError, match="ended in state ERR"):
        t.done(failed)
    t.close()


def test_a_peer_agent_replaced_while_a_read_is_posted_does_not_block_the_loop(
    tmp_path: Path,
) -> None:
    """A peer's new metadata (it registered a segment) came while a 512 MiB read was being
    posted: the loop waited 4.2 s in NIXL's remove_remote_agent for the lock the post held,
    answering nothing, its process's other threads frozen too (its etcd lease expired). Now
    NIXL hears of the peer's agent on the mover's thread, in order with the reads."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    t.add_peer("a", b"a:0", [7, 0])
    agent.stuck.set()
    read = t.read("a", 1000, 2000, 4096)
    assert agent.posting.wait(5)  # the thread is posting it, and stays there
    adding, _ = in_thread(lambda: t.add_peer("a", b"a:1", [7, 1]))
    adding.join(1.0)
    alive, _ = adding.is_alive(), agent.over.set()
    assert not alive, "add_peer waited for NIXL's lock"
    assert wait_until(lambda: agent.remote["a"] == b"a:1", 5) and _ended(t) and t.done(read)
    t.close()


class Forgetful(Reading):
    """A Reading agent that will not start a transfer with a peer whose agent it does not
    know, as NIXL's createXferReq (nixlNotFoundError). NIXL drops a peer's agent by itself
    when a transfer finds the connection to it gone (the test does it here)."""

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        if node not in self.remote:
            raise RuntimeError("nixlNotFoundError")
        return object()


def test_a_peer_agent_nixl_dropped_is_loaded_again_from_its_next_message(tmp_path: Path) -> None:
    """NIXL dropped a's agent (its current source does when a transfer finds the connection
    gone). Transfers took the same metadata in a's next offer for known, and every read of
    a was refused until a registered a segment. A read NIXL refused, or one that ended in
    error, makes the next message's metadata load again."""
    agent = Forgetful("b")
    t = _transfers("b", tmp_path, agent)
    t.add_peer("a", b"a:1", [7, 1])
    assert wait_until(lambda: "a" in agent.remote, 5)
    agent.over.set()
    with agent.lock:
        del agent.remote["a"]  # (NIXL's doing)
    refused = t.read("a", 1000, 2000, 4096)
    assert _ended(t)
    with pytest.raises(OSError, match="could not start a read of 4096 bytes from 'a'"):
        t.done(refused)
    t.add_peer("a", b"a:1", [7, 1])  # the offer of the lend read again: the same metadata
    again = t.read("a", 1000, 2000, 4096)
    assert wait_until(again.ended, 5), "the read was refused again"
    assert t.done(again) and agent.calls == 2
    agent.state = "ERR"  # (a transfer that found the connection gone: NIXL drops the agent)
    failed = t.read("a", 1000, 2000, 4096)
    assert wait_until(failed.ended, 5)
    with pytest.raises(OSError, match="ended in state ERR"):
        t.done(failed)
    t.add_peer("a", b"a:1", [7, 1])
    assert wait_until(lambda: agent.calls == 3, 5)
    t.close()


class Keyed(Reading):
    """A Reading agent that notes, as each transfer is posted, which metadata of its peer it
    knew then, and whether that peer's agent was replaced under a transfer with it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.posted_with: list[tuple[str, bytes]] = []
        self.under: list[str] = []
        self.open: list[str] = []

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        self.posted_with.append((node, self.remote.get(node, b"")))
        self.open.append(node)
        return [node]

    def remove_remote_agent(self, name: str) -> None:
        if name in self.open:
            self.under.append(name)  # (NIXL takes its endpoint and keys away)
        super().remove_remote_agent(name)

    def release_xfer_handle(self, handle: Any) -> None:
        self.open.remove(handle[0])


def test_a_peer_agent_is_replaced_only_once_no_transfer_with_it_is_under_way(
    tmp_path: Path,
) -> None:
    """NIXL's remove_remote_agent takes away the peer's endpoint and keys, under the
    transfers with it: a replace waits for them to end, and a transfer with that peer
    handed over after it waits for it (it may lie in the peer's new segment). Transfers with
    other peers go on meanwhile."""
    agent = Keyed("b")
    t = _transfers("b", tmp_path, agent)
    t.add_peer("a", b"a:0", [7, 0])
    t.add_peer("c", b"c:0", [7, 0])
    first = t.read("a", 1000, 2000, 4096)
    assert wait_until(lambda: len(agent.posted_with) == 1, 5)
    t.add_peer("a", b"a:1", [7, 1])  # (a registered a segment)
    after = t.read("a", 1000, 2000, 4096)
    other = t.read("c", 1000, 2000, 4096)
    assert wait_until(lambda: ("c", b"c:0") in agent.posted_with, 5)
    assert agent.remote["a"] == b"a:0" and len(agent.posted_with) == 2  # (waiting)
    agent.over.set()
    assert wait_until(lambda: t.done(first) and t.done(other) and t.done(after), 5)
    assert agent.posted_with == [("a", b"a:0"), ("c", b"c:0"), ("a", b"a:1")]
    assert not agent.under
    t.close()


def test_a_large_read_goes_in_chunks_and_a_partial_one_as_its_relay_says(tmp_path: Path) -> None:
    """A version's bytes are read in CHUNK reads; a relay's offer of a version it is still
    pulling names its first bytes ready, the others are read as it says (`extend`), and
    the read is done once all were asked for and read."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    size = 2 * CHUNK + 4096
    whole = t.read("a", 0, 0, size)
    assert [r.size for r in whole.reads] == [CHUNK, CHUNK, 4096]
    partial = t.read("a", 0, 0, size, ready=CHUNK)  # the relay has its first chunk
    assert [r.size for r in partial.reads] == [CHUNK]
    agent.over.set()
    assert wait_until(lambda: t.done(whole) and partial.ended(), 5)
    assert partial.ready() == CHUNK and not t.done(partial)  # (the rest not asked for yet)
    t.extend(partial, size)
    assert [r.size for r in partial.reads] == [CHUNK, CHUNK, 4096]
    assert wait_until(lambda: t.done(partial), 5) and partial.ready() == size
    t.close()


class Counting(Reading):
    """A Reading agent that counts the reads under way (posted, not yet released)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.posted, self.most = 0, 0

    def transfer(self, handle: Any) -> str:
        self.posted += 1
        self.most = max(self.most, self.posted - len(self.released))
        return super().transfer(handle)


def test_a_large_read_has_at_most_a_window_of_reads_under_way(tmp_path: Path) -> None:
    """UCX moves the reads under way side by side: with all 32 reads of a 512 MiB version
    asked for at once, its first ended only with 352 MiB of the others, 283 ms after it
    began, and a relay's borrower waited that long for its first bytes (Note [relays]). A
    read asks for WINDOW chunks, and for the next ones as those end."""
    agent = Counting("b")
    t = _transfers("b", tmp_path, agent)
    chunks = WINDOW + 3
    read = t.read("a", 0, 0, chunks * CHUNK)
    assert [r.size for r in read.reads] == [CHUNK] * WINDOW
    assert not t.done(read) and len(read.reads) == WINDOW  # (none ended: no more asked)
    agent.over.set()
    assert wait_until(lambda: t.done(read), 5)
    assert [r.size for r in read.reads] == [CHUNK] * chunks and read.ready() == chunks * CHUNK
    assert agent.most <= WINDOW
    partial = t.read("a", 0, 0, chunks * CHUNK, ready=CHUNK)  # a relay's: as it says
    assert wait_until(lambda: partial.ended(), 5) and not t.done(partial)
    t.extend(partial, chunks * CHUNK)
    assert wait_until(lambda: t.done(partial), 5) and len(partial.reads) == chunks
    t.close()


def test_a_read_populates_only_memory_it_has_not_populated_before(tmp_path: Path) -> None:
    """A read into host memory faults its pages in first, in one call (mover.py: UCX's copies
    faulted them one by one), but a block read into before is populated already, in this
    broker's mapping, for as long as it runs: populating a 512 MiB version's block again
    cost each reader 22 ms of CPU for nothing."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    block = 8 * POPULATED  # (an address in host memory, aligned or not)
    fills = lambda r: [x.fill for x in r.reads]  # noqa: E731
    first = t.read("a", 0, block + 64, 4 * POPULATED)
    assert fills(first) == [block + 64]  # new: populated
    assert fills(t.read("a", 0, block + 64, 4 * POPULATED)) == [0]  # the same block again
    assert fills(t.read("a", 0, block + POPULATED, 2 * POPULATED)) == [0]  # inside it
    later = t.read("a", 0, block + 2 * POPULATED, 4 * POPULATED)  # partly new memory
    assert fills(later) == [block + 2 * POPULATED]
    assert fills(t.read("a", 0, block + 5 * POPULATED, POPULATED)) == [0]
    agent.over.set()
    t.close()


def _object(segment: str, offset: int, size: int, device: str = "cpu") -> Any:
    """A StoredObject as Transfers sees it: one uint8 tensor in a block of `segment`."""
    block = SimpleNamespace(segment=segment, offset=offset, size=size)
    tensor = SimpleNamespace(name="", dtype="uint8", shape=(size,))
    return SimpleNamespace(block=block, device=device, bundle=False, tensors=[tensor], nbytes=size)


def test_a_small_host_object_goes_with_its_offer_and_is_copied_not_read(tmp_path: Path) -> None:
    """Note [inline]: a 4 KiB queue item took 1.7-2.4 ms to a consumer on another node, a
    pulled 4 KiB get 1.2-1.4 ms, most of it a NIXL READ and the handoffs to and from the
    mover's thread. An object in host memory of at most INLINE bytes goes with its offer;
    the reader copies it into its block, no read posted, done at once. A larger one, or
    one not asked inline (an announcement's offer), is read as before."""
    (tmp_path / "seg").write_bytes(bytes(range(256)) * (2 * INLINE // 256))
    (tmp_path / "mine").write_bytes(bytes(2 * INLINE))
    a, agent = _transfers("a", tmp_path), Counting("b")
    b = _transfers("b", tmp_path, agent)
    small = a.offer(_object("seg", 256, 4096), inline=True)
    assert small["data"] == bytes(range(256)) * 16
    assert "data" not in a.offer(_object("seg", 0, 4096))  # (not asked: an announcement's)
    assert "data" not in a.offer(_object("seg", 0, INLINE + 1), inline=True)
    into = _object("mine", 64, 4096)
    reading, size = b.take("a", small, into)
    assert size == 4096 and b.done(reading) and reading.ready() == 4096
    assert bytes(b._mapped["mine"][0][64 : 64 + 4096]) == small["data"] and agent.posted == 0
    large = a.offer(_object("seg", 0, INLINE + 64), inline=True)
    read, _ = b.take("a", large, _object("mine", 0, INLINE + 64))
    assert wait_until(lambda: agent.posted == 1, 5) and not b.done(read)  # (a NIXL read)
    agent.over.set()
    assert wait_until(lambda: b.done(read), 5)
    a.close()
    b.close()


def test_a_read_failed_as_the_loop_looked_is_never_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mover's thread may fail a read between the loop's look at the reads' errors and
    its look at whether they all ended: `done` must not then say the version was read (its
    replica, or queue item, would be sealed with bytes missing)."""
    agent = Reading("b")
    t = _transfers("b", tmp_path, agent)
    read = t.read("a", 0, 0, 2 * CHUNK)
    agent.over.set()
    assert wait_until(read.ended, 5)
    asked = t._ask

    def failing_meanwhile(reading: Any) -> None:
        asked(reading)
        reading.reads[-1].finished, reading.reads[-1].error = False, "ended in state ERR"

    monkeypatch.setattr(t, "_ask", failing_meanwhile)
    with pytest.raises(OSError, match="ERR"):
        t.done(read)
    t.close()


class Undescribed(Counting):
    """An agent that cannot describe the reads after the first two (NIXL's own error)."""

    def get_xfer_descs(self, regions: Any, kind: str) -> Any:
        if regions[0][0] >= 2 * CHUNK:
            raise RuntimeError("nixlInvalidParamError")
        return regions


def test_a_read_that_cannot_be_asked_for_fails_only_once_those_under_way_ended(
    tmp_path: Path,
) -> None:
    """A chunk NIXL cannot describe fails the whole read, but only once the reads already
    asked for ended: until then NIXL may write into the block, which must not go to
    another put."""
    agent = Undescribed("b")
    t = _transfers("b", tmp_path, agent)
    read = t.read("a", 0, 0, 4 * CHUNK)
    assert len(read.reads) == 2 and read.failed is not None
    assert not t.done(read)  # (two reads under way)
    agent.over.set()
    assert wait_until(read.ended, 5)
    with pytest.raises(OSError, match="could not describe"):
        t.done(read)
    with pytest.raises(OSError, match="could not describe"):  # (none asked for: at once)
        t.read("a", 2 * CHUNK, 2 * CHUNK, CHUNK)
    t.close()
