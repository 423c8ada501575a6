"""Reads pushed by their lender (server/cluster/pushes.py, Note [pushes]): the reader asks for
each piece, the lender WRITEs it and says so; a piece given up keeps its block out of use
until the lender may no longer write into it. NIXL's agent is stood in for by one that
copies the bytes (the integration tests run the real one)."""

from __future__ import annotations

import ctypes
import select
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorbroker.server.cluster import pushes
from tensorbroker.server.cluster.reads import CHUNK, PUSH_MIN, Reading
from tensorbroker.server.cluster.transfers import Transfers

SIZE = PUSH_MIN + CHUNK // 2  # (a last piece smaller than the others)


class Copying:
    """NIXL's agent, its WRITEs copying at once (`hold`: those to the held addresses wait
    for the test, as a lender taken for down may still be writing)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held: set[int] = set()
        self.waiting: list[Any] = []

    def register_memory(self, regions: Any, kind: str) -> None: ...

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata

    def get_xfer_descs(self, regions: Any, kind: str) -> Any:
        return regions

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        assert op == "WRITE", "a pushed read is never READ"
        return [local[0], remote[0]]

    def transfer(self, handle: Any) -> str:
        (src, size, _), (dst, _, _) = handle
        if dst in self.held:
            self.waiting.append(handle)
        else:
            ctypes.memmove(dst, src, size)
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        return "PROC" if handle in self.waiting else "DONE"

    def release_xfer_handle(self, handle: Any) -> None: ...

    def finish(self) -> None:
        """The WRITEs held back end (their bytes land)."""
        for (src, size, _), (dst, _, _) in self.waiting:
            ctypes.memmove(dst, src, size)
        self.waiting.clear()


class Pair:
    """A reader `r` and its lender `l`, their messages carried by hand (`carry`)."""

    def __init__(self, tmp: Path, lender: Copying | None = None) -> None:
        self.lender_agent = lender or Copying("l")
        self.l = Transfers("l", str(tmp), self.lender_agent)
        self.r = Transfers("r", str(tmp), Copying("r"))
        self.asked: list[dict[str, Any]] = []  # requests r sent l, not carried yet
        self.r.send = lambda node, m: node == "l" and not self.asked.append(m)  # type: ignore[func-returns-value]
        self.src = np.random.default_rng(0).integers(0, 255, SIZE, np.uint8)
        self.dst = np.zeros(SIZE, np.uint8)

    def read(self) -> Reading:
        reading = Reading("l", self.src.ctypes.data, self.dst.ctypes.data, SIZE,
                          ("DRAM", 0), ("DRAM", 0), push=True, inc=0)  # fmt: skip
        self.r.extend(reading, SIZE)
        return reading

    def carry(self, reading: Reading) -> bool:
        """Carry the requests to l and its answers back until the read ended: `done`."""
        for _ in range(500):
            self.deliver()
            for _, answer in self.l.served():
                self.r.wrote("l", answer)
            if reading.asked == reading.size and reading.ended():
                return self.r.done(reading)
            self.r.done(reading)  # (asks for the next pieces)
            select.select([self.l.fd], [], [], 0.01)
            self.l.mover.woken()
        raise AssertionError("the read never ended")

    def deliver(self) -> None:
        """Carry r's requests to l."""
        asked, self.asked = self.asked, []
        for m in asked:
            if m["op"] == "write":
                self.l.serve("r", m)
            else:
                self.l.writing(m["node"], m["tokens"], m["inc"])

    def answer(self) -> None:
        """Carry l's answers (those over now) to r."""
        for _, answer in self.l.served():
            self.r.wrote(answer["node"], answer)

    def close(self) -> None:
        self.lender_agent.finish()
        self.l.close()
        self.r.close()


def _woken(t: Transfers) -> bool:
    return bool(select.select([t.fd], [], [], 5)[0])


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    p = Pair(tmp_path)
    yield p
    p.close()


def test_a_lent_version_is_written_by_its_lender_piece_by_piece(pair: Pair) -> None:
    reading = pair.read()
    assert len(pair.asked) == 3 and all(m["size"] <= CHUNK for m in pair.asked)
    assert pair.asked[0]["agent"] == b"r"  # (its block's segment known to the lender)
    assert pair.carry(reading)
    np.testing.assert_array_equal(pair.dst, pair.src)
    assert pair.l.bytes_pushed == SIZE


def test_a_piece_the_lender_could_not_write_fails_the_read(pair: Pair) -> None:
    reading = pair.read()
    pair.asked[1]["size"] = 0  # (a request it cannot take)
    with pytest.raises(OSError, match="could not write"):
        pair.carry(reading)


def test_a_piece_given_up_keeps_its_block_until_its_lender_says_it_is_over(pair: Pair) -> None:
    """The lender taken for down may be alive and still writing: the reader's block is not
    reused (the pull's put not aborted) until the late `wrote` comes."""
    reading = pair.read()
    pair.lender_agent.held = {pair.dst.ctypes.data}  # the first piece's WRITE stays under way
    for m in pair.asked:
        pair.l.serve("r", m)
    pair.asked.clear()
    pair.r.abandon("l", "node 'l' went down")
    with pytest.raises(OSError, match="went down"):
        pair.r.done(reading)
    released: list[bool] = []
    assert pair.r.hold(reading.reads, lambda: released.append(True))
    assert pair.r.blocks_held == 1
    answers: list[Any] = []
    assert _wait(lambda: answers.extend(pair.l.served()) or len(answers) == 2)
    for _, answer in answers:  # the pieces that ended: not yet the first
        pair.r.wrote("l", answer)
    assert not released and pair.r.blocks_held == 1
    pair.lender_agent.finish()  # the late piece lands, and its lender says so

    def answered() -> bool:
        for _, answer in pair.l.served():
            pair.r.wrote("l", answer)
        return bool(released)

    assert _wait(answered)
    assert released == [True] and pair.r.blocks_held == 0


def _wait(f: Any) -> bool:
    for _ in range(500):
        if f():
            return True
        select.select([], [], [], 0.01)
    return False


def test_pieces_a_lender_never_took_or_that_went_with_its_process_hold_nothing(
    pair: Pair,
) -> None:
    reading = pair.read()
    tokens = [m["token"] for m in pair.asked]
    pair.r.abandon("l", "node 'l' went down")
    released: list[int] = []
    assert pair.r.hold(reading.reads, lambda: released.append(1))
    pair.r.unwritten("l", tokens[:2])  # its hello_first: it dropped those
    assert not released
    pair.r.restarted("l")  # (the last went with its old process)
    assert released == [1] and pair.r.blocks_held == 0


def test_a_lender_that_says_it_stopped_holds_no_block_for_its_pieces(pair: Pair) -> None:
    """The lender stopped (Cluster.close: its writes ended first): every piece asked of that
    process is over, those given up included. One another process of the node says it
    stopped (an older one's word, late) ends nothing of this one's."""
    pair.l.incarnation = 8
    reading = Reading("l", pair.src.ctypes.data, pair.dst.ctypes.data, SIZE,
                      ("DRAM", 0), ("DRAM", 0), push=True, inc=8)  # fmt: skip
    pair.r.extend(reading, SIZE)
    pair.r.abandon("l", "node 'l' went down")
    released: list[int] = []
    assert pair.r.hold(reading.reads, lambda: released.append(1))
    pair.r.stopped("l", 7)
    assert not released and pair.r.blocks_held == 1
    pair.r.stopped("l", 8)
    assert released == [1] and pair.r.blocks_held == 0


def test_a_piece_whose_request_was_lost_is_asked_about_and_never_written_after(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request lost on the way (a connection broken and back): the reader asks about its
    piece after ASK_AFTER; its lender, not writing it, says so, and refuses it if it comes
    after all. The read fails (the pull reads again), and nothing is held."""
    reading = pair.read()
    lost = pair.asked.pop(0)
    pair.deliver()
    pair.r.ask_about(time.monotonic())
    assert not pair.asked  # (not yet due)
    monkeypatch.setattr(pushes, "ASK_AFTER", 0.0)
    pair.r.ask_about(time.monotonic())
    (question,) = pair.asked
    assert question["op"] == "writing" and lost["token"] in question["tokens"]
    pair.deliver()
    assert _wait(lambda: pair.answer() or reading.ended())
    with pytest.raises(OSError, match="not being written there"):
        pair.r.done(reading)
    assert not pair.r.hold(reading.reads, lambda: None)
    pair.dst[:CHUNK] = 0
    pair.l.serve("r", lost)  # it comes after all: refused
    (answer,) = [a for _, a in pair.l.served()]
    assert "error" in answer and not pair.dst[:CHUNK].any()


def test_a_piece_given_up_whose_answer_was_lost_is_released_once_asked_about(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    reading = pair.read()
    pair.deliver()
    answers: list[Any] = []
    assert _wait(lambda: answers.extend(pair.l.served()) or len(answers) == 3)  # (all lost)
    pair.r.abandon("l", "node 'l' went down")
    with pytest.raises(OSError):
        pair.r.done(reading)
    released: list[int] = []
    assert pair.r.hold(reading.reads, lambda: released.append(1))
    monkeypatch.setattr(pushes, "ASK_AFTER", 0.0)
    pair.r.ask_about(time.monotonic())
    pair.deliver()
    pair.answer()
    assert released == [1] and pair.r.blocks_held == 0


def test_a_read_that_ended_holds_nothing(pair: Pair) -> None:
    reading = pair.read()
    assert pair.carry(reading)
    assert not pair.r.hold(reading.reads, lambda: None)


def test_a_piece_asked_of_a_process_that_restarted_since_is_not_written(pair: Pair) -> None:
    """The lender restarted in place and the reader's link reached the new process: the
    address asked for was the old one's (the new one maps its segments elsewhere). Not
    written, and a question about the old one's pieces is not answered for it."""
    pair.l.incarnation = 8
    reading = Reading("l", pair.src.ctypes.data, pair.dst.ctypes.data, SIZE,
                      ("DRAM", 0), ("DRAM", 0), push=True, inc=7)  # fmt: skip
    pair.r.extend(reading, SIZE)
    assert all(m["inc"] == 7 for m in pair.asked)
    with pytest.raises(OSError, match="another process of this node"):
        pair.carry(reading)
    assert not pair.dst.any()
    pair.l.writing("r", [1, 2], 7)
    assert not pair.l.served()


def test_a_lender_that_is_down_is_asked_about_its_pieces_once_it_is_back(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair.read()
    pair.asked.clear()
    pair.r.abandon("l", "node 'l' went down")
    monkeypatch.setattr(pushes, "ASK_AFTER", 0.0)
    up = False
    pair.r.up = lambda node: up
    pair.r.ask_about(time.monotonic())
    assert not pair.asked  # (its link is down: nothing to say on it)
    up = True
    pair.r.ask_about(time.monotonic())
    assert [m["op"] for m in pair.asked] == ["writing"] and len(pair.asked[0]["tokens"]) == 3


def test_no_piece_is_asked_of_a_lender_taken_for_down(pair: Pair) -> None:
    """A relay taken for down after its first piece was written (none under way then, so
    none given up) says it has more (its `more` may still come): no piece is asked of it,
    and the read fails (the pull reads again from the owner) instead of waiting for good."""
    up = True
    pair.r.up = lambda node: up
    reading = Reading("l", pair.src.ctypes.data, pair.dst.ctypes.data, SIZE,
                      ("DRAM", 0), ("DRAM", 0), push=True, inc=0)  # fmt: skip
    pair.r.extend(reading, CHUNK)  # (a relay that has its first piece)
    pair.deliver()
    assert _wait(lambda: pair.answer() or reading.ready() == CHUNK)
    assert not pair.r.done(reading)
    up = False
    pair.r.abandon("l", "node 'l' went down")
    pair.r.extend(reading, SIZE)
    assert not pair.asked
    with pytest.raises(OSError, match="is down"):
        pair.r.done(reading)


class Forgetful(Copying):
    """Copying, but NIXL will not start a WRITE to a peer whose agent it does not know
    (nixlNotFoundError); it drops one by itself when a transfer finds the connection gone."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.known: set[str] = set()
        self.loads = 0
        self.removed: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.known.add(metadata.decode())
        self.loads += 1
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)
        self.known.discard(name)

    def initialize_xfer(self, op: str, local: Any, remote: Any, node: str) -> Any:
        if node not in self.known:
            raise RuntimeError("nixlNotFoundError")
        return super().initialize_xfer(op, local, remote, node)


def test_a_lender_whose_nixl_dropped_the_readers_agent_loads_it_again(tmp_path: Path) -> None:
    """A WRITE NIXL would not start (it dropped the reader's agent) makes the lender load the
    reader's agent again from its next `write`, though it carries the same metadata: else
    every piece that reader asks for is refused (test_transfers has the reader's side)."""
    agent = Forgetful("l")
    pair = Pair(tmp_path, agent)
    try:
        assert pair.carry(pair.read())
        agent.known.discard("r")  # (NIXL's doing)
        with pytest.raises(OSError, match="could not start a write"):
            pair.carry(pair.read())
        pair.dst[:] = 0
        assert pair.carry(pair.read()), "the lender refused the pieces again"
        np.testing.assert_array_equal(pair.dst, pair.src)
        assert agent.loads == 2 and agent.removed == ["r"]  # (replaced: NIXL's may still be)
    finally:
        pair.close()
