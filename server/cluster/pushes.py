"""Reads pushed by their lender (Transfers' half that speaks with the peers).

Note [pushes]

UCX's TCP transport has no zero-copy get: a NIXL READ comes back as messages, which the
lender copies into UCX's send segments and the reader out of its receive segments. A WRITE
(UCX's TCP put) goes from the lender's memory to its socket, and from the reader's socket
into the reader's memory: two copies fewer. On this 2-core VM, two readers each taking 512
MiB from one lender in 16 MiB pieces, 4 under way (interleaved, medians of 7): READ 272 ms
and 466 ms of CPU, WRITE 232 ms and 390 ms. With NIXL's notifications telling the reader of
each piece, and readers polling for them, WRITE kept only half of that (258 ms, 418 ms).
A 512 MiB weight sync to 3 readers over loopback (versions 2-9, alternated runs) took 434
and 437 ms a version pushed, against 461 and 484 read.

So a read of a version lent in host memory (Lending.lend) of at least PUSH_MIN bytes (a
smaller one is read: it is not faster pushed, reads.py) is pushed.
The reader keeps its window (transfers.Reading) and asks its lender for each piece (`write`:
from where, to where, with this agent's metadata of now, as the lender must know the block's
segment); the lender's mover WRITEs it, and its loop answers `wrote` once NIXL says the
WRITE is over (NIXL flushes UCX's endpoint first: the bytes are in the reader's memory).
Each `write` names the lender's incarnation that lent the version: another process of that
node (restarted in place, its segments mapped elsewhere) writes nothing for it. An offer
(read at once from an announcement, Note [offers] in offers.py) and device memory are still
read: the lender of an offer does not hear of its reads.

A request or its answer can be lost (a connection broken and back, a peer that forgot the
other's route meanwhile). So a piece not answered within ASK_AFTER is asked about again
(`writing`, every ASK_AFTER): a lender that is not writing it says so (`wrote`, with an
error) and never writes it after (`refused`); the pull then reads again from the owner
(READ_AGAIN times at most, pulls.py). A piece whose request could not go (its link not
up) is asked for again as the pull is looked at.

A lender taken for down may still be alive, and writing. So the pieces of a lender that went
down are given up at once (`abandon`: the pull reads again, or fails, as for a read that
failed), but the block they were asked into is not reused (`hold`) until the lender says
each is over after all (a late `wrote`, or its answer to `writing`), says it never took it
(`unwritten`: its `hello_first`), stopped, or restarted (its writes went with its process:
a broker's NIXL writes end before its links close, and it answers them then and says to
the nodes up that it stopped, Cluster.close; not so a process taken for down that a new
one, at another address, replaced while it still wrote: its held blocks are let go at the
new one's hello). One whose lender never comes back and did not stop (killed, its machine
gone) stays held: the whole block of each pull it was writing (stats: `blocks_held`). A lender
that forgot this node (it is up) still answers each piece it took, on its own link if it
has no route of this node's left, and says it never took the others; the pull, suspect,
reads again once they ended. A piece its lender says it is still writing is waited for,
however long (as a READ that UCX has not failed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from .mover import Mover, Read

log = logging.getLogger(__name__)

ASK_AFTER = 2.0  # seconds before a piece not answered is asked about (`writing`), and between
REFUSED = 4096  # tokens of each node kept as refused (asked about, not being written)


class Pushes:
    """The pieces this broker asked its lenders to push (`_pushed`, by token) and the blocks
    held for those given up (`_held`); the pieces peers asked of it (`_serving`)."""

    agent: Any
    mover: Mover
    node: str
    incarnation: int

    def agent_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def add_peer(self, node: str, metadata: bytes, version: Any = None) -> None:
        raise NotImplementedError

    def unknown(self, node: str) -> None:
        raise NotImplementedError

    def __init__(self) -> None:
        # Sends a request to a peer (Links.send: False if its link is not up); None: no
        # pushes (a read is read).
        self.send: Callable[[str, dict[str, Any]], bool] | None = None
        self.up: Callable[[str], bool] = lambda node: True  # (Links.up: asked about if so)
        self._pushed: dict[int, Read] = {}  # token -> the piece asked for, until it ended
        self._tokens = time.time_ns()  # (a restarted broker's are new to its lenders)
        self._held: list[tuple[list[Read], Callable[[], None]]] = []  # (pieces, release)
        self._serving: list[tuple[str, int, Read]] = []  # (node, its token, the WRITE)
        # node -> the tokens it asked about that were not being written: never written now
        self._refused: dict[str, dict[int, None]] = {}
        self.bytes_pushed = 0  # written to peers that asked (their pieces)

    @property
    def blocks_held(self) -> int:
        """Blocks out of use while a lender may still write into them (`hold`)."""
        return len(self._held)

    # -- the reader's side ---------------------------------------------------------------------

    def push(
        self, node: str, remote: int, local: int, size: int, inc: int | None = None
    ) -> Read | None:
        """Ask `node` (its broker of incarnation `inc`, which lent it: no other writes it) to
        write `size` bytes at `remote` in its memory into `local` in this broker's; None if
        the request could not go (its link not connected: asked again later). OSError if
        `node` is taken for down."""
        if not self.up(node):  # (taken for down: its pieces given up, and no more asked)
            raise OSError(f"node {node!r} is down")
        self._tokens += 1
        read = Read(node, local, remote, size, op="WRITE", token=self._tokens, inc=inc)
        message = {"op": "write", "token": read.token, "from": remote, "to": local, "size": size,
                   "inc": inc, **self.agent_fields()}  # fmt: skip
        if self.send is None or not self.send(node, message):
            return None
        read.queried_at = time.monotonic()
        self._pushed[read.token] = read
        return read

    def wrote(self, node: str, m: dict[str, Any]) -> None:
        """`node` says the piece `token` is over: in (no `error`), or not."""
        read = self._pushed.get(int(m["token"]))
        if read is not None and read.node == node:
            error = m.get("error")
            self._ended(read, None if error is None else f"could not write it here: {error}")

    def unwritten(self, node: str, tokens: Iterable[Any]) -> None:
        """`node` never took these pieces (it had forgotten this broker): none is coming."""
        for token in tokens:
            read = self._pushed.get(int(token))
            if read is not None and read.node == node:
                self._ended(read, "did not take the write")

    def restarted(self, node: str) -> None:
        """`node` is a new process: what its old one was asked to write is not coming (and
        what it asked about, it no longer asks)."""
        self._refused.pop(node, None)
        for read in [r for r in self._pushed.values() if r.node == node]:
            self._ended(read, "restarted before it wrote")

    def stopped(self, node: str, inc: Any) -> None:
        """`node`'s broker of incarnation `inc` stopped: its writes ended before it said so
        (Cluster.close), and none comes after; what it was asked to write is over."""
        for read in [r for r in self._pushed.values() if r.node == node]:
            if read.inc is None or inc is None or read.inc == inc:
                self._ended(read, "stopped before it wrote")

    def _ended(self, read: Read, error: str | None) -> None:
        """Its lender says the piece `read` is over (in, if no `error`): a piece given up
        releases what was held for it (`_over`); another ends."""
        del self._pushed[read.token]
        if read.late:
            self._over(read)
        elif error is None:
            read.finished = True
        else:
            read.error = f"node {read.node!r} {error} ({read.size} bytes)"

    def abandon(self, node: str, why: str) -> None:
        """Give up the pieces asked of `node` that are still under way: they fail, and the
        blocks they were asked into are held (`hold`) until `node` says they are over."""
        for read in self._pushed.values():
            if read.node == node and not read.late:
                read.error, read.late = why, True

    def ask_about(self, now: float) -> None:
        """Ask the lenders about their pieces not answered within ASK_AFTER (`writing`): those
        up (one that is down is asked once it is back)."""
        due: dict[tuple[str, int | None], list[int]] = {}
        for read in self._pushed.values():
            if now - read.queried_at > ASK_AFTER and self.up(read.node):
                due.setdefault((read.node, read.inc), []).append(read.token)
        for (node, inc), tokens in due.items():
            asked = {"op": "writing", "node": self.node, "tokens": tokens, "inc": inc}
            if self.send is not None and self.send(node, asked):
                for token in tokens:
                    self._pushed[token].queried_at = now

    def hold(self, reads: list[Read], release: Callable[[], None]) -> bool:
        """Whether a lender may still write into the block `reads` went into (pieces given
        up): `release` (which frees it) is then called once none may, else not at all."""
        if not any(r.late for r in reads):
            return False
        late = sum(r.size for r in reads if r.late)
        log.info("cluster: a block is held until %d bytes given up are over", late)
        self._held.append((reads, release))
        return True

    def _over(self, read: Read) -> None:
        """A piece given up is over: the blocks held for it alone are released."""
        read.late = False
        held, self._held = self._held, []
        for reads, release in held:
            if any(r.late for r in reads):
                self._held.append((reads, release))
                continue
            try:
                release()
            except Exception:  # (the others are released still)
                log.exception("cluster: a block held for a late write could not be released")

    # -- the lender's side ---------------------------------------------------------------------

    def serve(self, node: str, m: dict[str, Any]) -> None:
        """Write a piece `node` asked for (`write`: pushes.py) on the mover's thread; `served`
        says when it is over."""
        token, size = int(m["token"]), int(m["size"])
        if token in self._refused.get(node, ()):  # (asked about before it came: not written)
            return self._not_written(node, token, "asked about before it came")
        if m.get("inc") != self.incarnation:  # (its address is another process's)
            return self._not_written(node, token, "asked of another process of this node")
        if size <= 0:
            return self._not_written(node, token, f"a write of {size} bytes")
        if "agent" in m:  # (the block may lie in a segment new to this broker)
            self.add_peer(node, bytes(m["agent"]), m.get("agent_v"))
        try:
            mine = self.agent.get_xfer_descs([(int(m["from"]), size, 0)], "DRAM")
            theirs = self.agent.get_xfer_descs([(int(m["to"]), size, 0)], "DRAM")
        except Exception as exc:  # (NIXL's own errors, a bad request)
            return self._not_written(node, token, f"{exc!r}")
        self._serving.append((node, token, self.mover.start(node, mine, theirs, size, op="WRITE")))

    def _not_written(self, node: str, token: int, why: str) -> None:
        """Answer `node`'s piece `token` (at the next `served`): not written, for `why`."""
        self._serving.append((node, token, Read(node, None, None, 0, op="WRITE", error=why)))

    def writing(self, node: str, tokens: Iterable[Any], inc: Any = None) -> None:
        """`node` asks about these pieces: those not being written here are answered (over,
        not written) and never written after (`refused`). Not if asked of another process
        of this node (`inc`): that one's are said over once this one's hello is heard."""
        if inc != self.incarnation:
            return
        serving = {token for n, token, _ in self._serving if n == node}
        refused = self._refused.setdefault(node, {})
        for token in map(int, tokens):
            if token in serving:
                continue  # (its `wrote` comes once it is over)
            refused[token] = None
            if len(refused) > REFUSED:
                del refused[next(iter(refused))]
            self._not_written(node, token, "not being written there")

    def served(self) -> list[tuple[str, dict[str, Any]]]:
        """The answers to the pieces written since (`wrote`), for the loop to send."""
        if not self._serving:
            return []
        answers, serving = [], []
        for node, token, write in self._serving:
            if not (write.finished or write.error is not None):
                serving.append((node, token, write))
                continue
            answer: dict[str, Any] = {"op": "wrote", "token": token, "node": self.node}
            if write.error is not None:
                answer["error"] = write.error
                if write.nixl_error:  # (its next `write` carries its agent: loaded again)
                    self.unknown(node)
            else:
                self.bytes_pushed += write.size
            answers.append((node, answer))
        self._serving = serving
        return answers
