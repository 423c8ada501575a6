"""This node's side of the other nodes' pulls (Note [cluster] in cluster.py): its keys announced
to them (announcing.py), a small version with its offer (Note [offers] in offers.py), and
its versions lent to their pulls, pinned until each says it is through.

Fan-out: an owner lends each version to FANOUT nodes itself, and sends the pulls that come
after to those borrowers (`redirect`), which lend their replica, or, still pulling it, lend
it once they have it. A borrower that fails a pull sends it back to the owner, who then lends
it directly. So the owner's node sends a version's bytes FANOUT times, however many read it
(an offered version excepted: every node reads it from its owner).

The relays form a tree of two levels that the owner decides, and it cannot cycle: a borrower
reads from the owner only (one that asks again, having thrown its read away, is lent
directly), and only borrowers are sent pulls. Sending a borrower that asked again to another
borrower made two of them wait on each other for good (issue 50's first fault).

Note [relays]

A relay lends a version larger than CHUNK while it still reads it: its `lent` names the
block it reads into and the bytes it has (`ready`), and a `more` tells the borrower each
time more of it is there (its reads go in CHUNK pieces: transfers.Reading), so the borrower
reads each piece as soon as its relay has it, and three readers end in about one read's
time, not two. The last `more` (all of it) goes once the relay sealed its replica and pinned
it for the borrower, as a loan; the borrower's read is done only then. A relay that fails
the version or throws its read away says so (`more` with an error; forgetting the relay
does as much): the borrower's reads end, it drops what it read and asks the owner, which
lends it directly. Until that last `more`, the relay's block is not pinned: if it goes to
another put, the borrower reads that, and drops it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..store.records import StoredObject
from ..store.registry import Registry
from .announcing import Announcing
from .follows import Followers
from .offers import Lent
from .records import Links, Pull, Remote
from .transfers import CHUNK, Transfers

log = logging.getLogger(__name__)

FANOUT = 2  # the nodes a version's owner lends it to itself; later pullers go to theirs


class Lending(Announcing):
    """The announcements (Announcing), loans and offers of this node's keys. `index` and
    `pulling` are Replicas' (the keys that are other nodes', and those being pulled here): a
    replica is lent as any version, but never announced, and a key still being pulled is
    lent once it is here."""

    def __init__(
        self, node: str, registry: Registry, transfers: Transfers, links: Links,
        index: Mapping[str, Remote], pulling: Mapping[str, Pull],
        told: Callable[[str, bool], set[str]],
    ) -> None:  # fmt: skip
        self.node, self.registry, self.transfers, self.links = node, registry, transfers, links
        self.index, self.pulling = index, pulling
        self.told = told  # a key's home, or its lookers if this is its home: Homes.told
        self.loans: dict[tuple[str, int, int], StoredObject] = {}  # (node, pull, ask) -> pinned
        # (node, pull, ask) -> when its borrower asked, on its clock (Lending.open_pulls):
        self._asked_at: dict[tuple[str, int, int], float] = {}  # asked, not yet lent
        self._lent_at: dict[tuple[str, int, int], float] = {}  # lent
        self.offered = Lent(registry)
        self.followers = Followers()  # who hears of which versions (Note [follows])
        self._lent_to: dict[str, tuple[int, list[str]]] = {}  # key -> (version, borrowers)
        self.announcing: list[tuple[str, int]] = []  # sent after the loop's replies (`flush`)
        self.beaten: dict[str, str] = {}  # key -> the node whose version a put here beat
        self._announced_at = -math.inf  # when the last batch went
        self._told_at: dict[str, float] = {}  # node -> when the last announcement went to it
        self.peers = 0  # the nodes up but this one (Replicas.changed): `claim_every`
        # node -> its claims waiting for `claim_every`: (when made, entry)
        self._held: dict[str, list[tuple[float, list[Any]]]] = {}
        self.bytes_sent = 0
        self.lent_early = 0  # versions lent while still pulled here (Note [relays])
        # Lends of GPU objects whose copy has not run yet: (node, pull, key, direct, ask).
        self.unwritten: list[tuple[str, int, str, bool, int]] = []

    # -- loans -----------------------------------------------------------------------------------

    def lend(
        self, node: str, pull: int, key: str, direct: bool = False, ask: int = 0, t: Any = None
    ) -> None:
        """Answer `node`'s pull of `key`: pin its version here and say where its bytes are;
        or, the owner of a version it lent FANOUT times already, send it to one of those
        borrowers (unless `direct`: one of them failed it); or, pulling it, lend it once
        the pull is done. `ask`: which of the pull's lends this is (the answer says, and
        only the last one asked is read); `t`: when it was asked, on `node`'s clock."""
        if isinstance(t, float):
            self._asked_at[node, pull, ask] = t
        pulling = self.pulling.get(key)
        if pulling is not None and key in self.index:
            if not pulling.lendable(CHUNK):
                pulling.lends.append((node, pull, ask))  # lent once it is here
                return
            try:  # lent now, read as it comes (Note [relays])
                where = self.transfers.offer(pulling.obj)
            except OSError as exc:
                log.warning("could not lend %r: %s", key, exc)
                pulling.lends.append((node, pull, ask))
                return
            pulling.partial.append((node, pull, ask))
            self.lent_early += 1
            where["ready"] = pulling.handle.ready()
            self.links.answer(node, self._lent(node, pull, ask, pulling.version, where))
            return
        obj = self.registry.objects.get(key)
        if obj is not None and obj.events and not self.registry.devices.finished(obj.events[0]):
            # A GPU put seals with its copy only queued on its producer's stream: lent once
            # it ran (its write event), else a peer could read what the block held before.
            self.unwritten.append((node, pull, key, direct, ask))
            return
        offer = None
        try:  # (a GPU object whose chunk NIXL could not register: not lent)
            offer = None if obj is None else self.transfers.offer(obj, inline=True)
        except OSError as exc:
            log.warning("could not lend %r: %s", key, exc)
        if obj is None or offer is None:
            error = f"node {self.node!r} has no {key!r}"
            answer = {"op": "lent", "pull": pull, "ask": ask, "error": error}
            remote = self.index.get(key)
            if remote is not None:  # another node's version won here: the puller may not know yet
                answer["at"] = [remote.node, remote.version, remote.size]
            self.links.answer(node, answer)
            return
        if key not in self.index:  # this node's own: its bytes go out FANOUT times at most
            self.followers.follow(node, key)  # (and `node` hears of its next versions)
            version, borrowers = self._lent_to.get(key, (0, []))
            if version != obj.version:
                version, borrowers = obj.version, []
                self._lent_to[key] = (version, borrowers)
            others = [b for b in borrowers if b != node and self.links.up(b)]
            if len(borrowers) >= FANOUT and others and not direct and node not in borrowers:
                to = others[pull % len(others)]
                self.links.answer(node, {"op": "lent", "pull": pull, "ask": ask, "redirect": to})
                return
            if node not in borrowers:
                borrowers.append(node)
        self.links.answer(node, self.loan(node, pull, obj, ask, offer))

    def lend_written(self) -> None:
        """The lends of GPU objects whose copy has run since: answered now (`lend` again)."""
        waiting, self.unwritten = self.unwritten, []
        for node, pull, key, direct, ask in waiting:
            try:
                self.lend(node, pull, key, direct, ask)
            except Exception:  # (the others still go)
                log.exception("could not lend %r to node %r", key, node)

    def loan(
        self, node: str, pull: int, obj: StoredObject, ask: int = 0, offer: Any = None
    ) -> dict[str, Any]:
        """Pin `obj` for lend `ask` of `node`'s pull `pull` (once, if it came twice): its
        `lent` answer (with `offer`, if made already), for `node`'s incarnation as this
        broker knows it (Links.acked)."""
        if offer is None:
            offer = self.transfers.offer(obj, inline=True)
        if (node, pull, ask) not in self.loans:
            self.registry.pin(obj)
            self.loans[node, pull, ask] = obj
            self._lent_at[node, pull, ask] = self._asked_at.get((node, pull, ask), math.inf)
            self.bytes_sent += obj.nbytes
        self._asked_at.pop((node, pull, ask), None)
        return self._lent(node, pull, ask, obj.version, offer)

    def _lent(
        self, node: str, pull: int, ask: int, version: int, offer: dict[str, Any]
    ) -> dict[str, Any]:
        """The `lent` answer to lend `ask` of `node`'s pull `pull`: `version`, where its
        bytes are (`offer`), for `node`'s incarnation as this broker knows it (Links.acked)."""
        return {
            "op": "lent", "pull": pull, "ask": ask, "version": version,
            **self.links.ack(node), **offer,
        }  # fmt: skip

    def returned(self, node: str, pull: int, ask: int = 0) -> None:
        self._lent_at.pop((node, pull, ask), None)
        for pulling in self.pulling.values():  # (lent while read here: told no more)
            if (node, pull, ask) in pulling.partial:
                pulling.partial.remove((node, pull, ask))
        obj = self.loans.pop((node, pull, ask), None)
        if obj is not None:
            self.registry.unpin(obj)

    def open_pulls(self, node: str, pulls: Any, sent: Any) -> None:
        """`node`'s beat, sent at `sent` on its clock, names the pulls it has open: its loans
        here of pulls it does not name, asked for before that beat left, are over (their
        `returned` was lost with a link that broke after taking it), and unpinned."""
        if not isinstance(pulls, list) or not isinstance(sent, float):
            return
        open_ = set(pulls)
        for key in [k for k in self.loans if k[0] == node and k[1] not in open_]:
            if self._lent_at.get(key, math.inf) < sent:
                self.returned(*key)
        for key in [k for k, t in self._asked_at.items() if k[0] == node and t < sent]:
            if key[1] not in open_:  # answered with no loan, or waiting for a pull here:
                del self._asked_at[key]  # not to be lent (its borrower gave up)
                for pull in self.pulling.values():
                    if key in pull.lends:
                        pull.lends.remove(key)
                    if key in pull.partial:
                        pull.partial.remove(key)
                self.unwritten = [u for u in self.unwritten if (u[0], u[1], u[4]) != key]

    # -- offers ----------------------------------------------------------------------------------

    def offer_read(self, node: str, key: str, version: int) -> None:
        """`node` read the version of `key` offered to it (its bytes are counted as sent)."""
        self.bytes_sent += self.offered.size(node, key, version)
        self.follow(node, [[key, version]], [])  # (a replica there now; put again since?)

    def offers_back(self, node: str, offers: list[Any]) -> None:
        """`node` gave back these offers ([[key, version], ...]): unpinned once all did."""
        for key, version in offers:
            self.offered.back(node, str(key), int(version))

    def let_go(self, node: str) -> None:
        """`node` went down or restarted: what it was lent or offered is unpinned (it will not
        say)."""
        for loan in [loan for loan in self.loans if loan[0] == node]:
            self.returned(*loan)
        for asked in [k for k in self._asked_at if k[0] == node]:
            del self._asked_at[asked]
        self.unwritten = [u for u in self.unwritten if u[0] != node]
        self._held.pop(node, None)  # (its homed keys are claimed again as it comes up)
        self.offered.let_go(node)
        self.followers.let_go(node)
        for pull in self.pulling.values():  # its pulls waiting here for a replica: forgotten
            pull.lends = [lend for lend in pull.lends if lend[0] != node]
            pull.partial = [lend for lend in pull.partial if lend[0] != node]
