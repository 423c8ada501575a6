"""This node's side of the other nodes' pulls (Note [cluster] in cluster.py): its keys announced
to them, a small version with its offer (Note [offers] in offers.py), and its versions lent
to their pulls, pinned until each says it is through.

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
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..store.records import StoredObject
from ..store.registry import Registry
from .follows import Followers
from .offers import Lent
from .records import Links, Pull, Remote
from .transfers import CHUNK, Transfers

log = logging.getLogger(__name__)

FANOUT = 2  # the nodes a version's owner lends it to itself; later pullers go to theirs
ANNOUNCE_EVERY = 0.001  # seconds: announcements made sooner after the last batch wait for it
# seconds: a claim to a node that does not follow the key (its homes, the node it beat)
# waits until this long after the last announcement to that node (Note [homes]), or longer
# in a cluster of more than CLAIMS_A_SECOND * CLAIM_EVERY nodes: peers / CLAIMS_A_SECOND,
# so that a stream of new keys sends at most CLAIMS_A_SECOND claim messages a second,
# whatever the cluster's size; never longer than CLAIM_WAIT_MAX (`claim_every`)
CLAIM_EVERY = 0.01
CLAIMS_A_SECOND = 300
CLAIM_WAIT_MAX = 0.1


class Lending:
    """The announcements, loans and offers of this node's keys. `index` and `pulling` are
    Replicas' (the keys that are other nodes', and those being pulled here): a replica is
    lent as any version, but never announced, and a key still being pulled is lent once it
    is here."""

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

    # -- announcements ---------------------------------------------------------------------------

    def announce(self, key: str, version: int) -> None:
        """`key` sealed here at `version` (0: deleted): the peers are told (its claim and
        delete, its homes; a later version, its followers: Note [follows]), once this loop's
        replies are out (a put's reply does not wait for the messages to its peers)."""
        self.announcing.append((key, version))

    def announce_in(self, now: float) -> float:
        """Seconds until the announcements waiting go out (inf: none wait)."""
        due = math.inf
        if self.announcing:
            due = self._announced_at + ANNOUNCE_EVERY
        if self._held:
            told = min(self._told_at.get(n, -math.inf) for n in self._held)
            due = min(due, told + self.claim_every)
        return max(0.0, due - now)

    def flush(self) -> None:
        """The announcements, once ANNOUNCE_EVERY passed since the last went: one message to
        each peer, [key, version, size, offer] of each key's latest version, or [key, 0, 0,
        None, the version put and deleted since the last batch, if one was] for a delete; a
        small version goes with its offer, pinned for the peers it reached (Note [offers]).
        What a node hears only as a key's home (a claim) waits for the next message to it
        or `claim_every` after the last: a stream of new keys costs each home at most one
        wake-up per `claim_every`, not one per key (Note [homes])."""
        now = time.monotonic()
        out: dict[str, list[list[Any]]] = {}  # node -> what it hears now
        offered: list[tuple[StoredObject, set[str]]] = []  # a version, its followers
        if self.announcing and now >= self._announced_at + ANNOUNCE_EVERY:
            self._announced_at = now
            self._batch(now, out, offered)
        self._held.pop(self.node, None)
        for node in [n for n in self._held if n in out or self._due(n, now)]:
            out.setdefault(node, [])  # (its held entries go first: `_announce_to`)
        out.pop(self.node, None)
        told = set()  # (sent after the loop's replies, and kept while a link reconnects:
        for node, entries in out.items():  # Links.after; the offers say which incarnation
            if self.links.up(node):  # of their receiver they are for, and how often this
                self._announce_to(node, entries)  # one forgot it: Links.acked)
                told.add(node)
            else:  # (a home down: its keys are claimed again as it comes up)
                self._held.pop(node, None)
        for obj, to in offered:
            self.offered.pin(obj, told & to)

    @property
    def claim_every(self) -> float:
        """Seconds a claim to a node that does not follow its key waits after the last
        announcement to it: CLAIM_EVERY, longer in a large cluster (CLAIMS_A_SECOND)."""
        return max(CLAIM_EVERY, min(CLAIM_WAIT_MAX, self.peers / CLAIMS_A_SECOND))

    def _due(self, node: str, now: float) -> bool:
        return now >= self._told_at.get(node, -math.inf) + self.claim_every

    def _batch(
        self, now: float, out: dict[str, list[list[Any]]],
        offered: list[tuple[StoredObject, set[str]]],
    ) -> None:  # fmt: skip
        """The announcements made since the last batch, each key's last: to `out` for its
        followers, held (`_held`) for the nodes that hear of it only as its homes."""
        announcing, self.announcing = self.announcing, []
        latest: dict[str, int] = {}  # key -> its last version, the last put first
        put: dict[str, int] = {}  # key -> its last put's version
        for key, version in reversed(announcing):
            latest.setdefault(key, version)
            if version:
                put.setdefault(key, version)
        held = self._held
        for key, version in reversed(latest.items()):
            claim = key not in self.followers.claimed
            told: set[str] = set()  # a claim or a delete goes to the key's homes too (Note
            if claim or not version:  # [homes]), and to the node whose version it beat
                told = self.told(key, not version)
            beaten = self.beaten.pop(key, None)
            if beaten is not None:
                told.add(beaten)
            if not version:  # deleted (the version it put and deleted since: it beat others')
                entry = [key, 0, 0, None, put.get(key, 0)]  # (at once, to all: a node that
                for node in told | self.followers.of(key, 0):  # asks a home right after
                    out.setdefault(node, []).append(entry)  # must not hear it lives)
                self.followers.drop(key)
                continue
            obj = self.registry.objects.get(key)
            if obj is None or obj.version != version or key in self.index:
                continue  # not this node's now: another node's version won here meanwhile
            size, to = int(obj.nbytes), self.followers.of(key, int(obj.nbytes))
            offer = None
            try:  # (to its followers only: the others ask the owner, who lends the newest)
                if to and self.offered.offerable(obj):
                    offer = self.transfers.offer(obj, agent=False)
            except Exception as exc:  # (its segment could not be registered): lent when asked
                log.warning("could not offer %r with its announcement: %s", key, exc)
            # A claim says how long ago it was put (it may go above an older version on
            # another node that it had not heard of: Note [homes]).
            age = [0, now - obj.sealed_at] if claim else []
            for node in to:
                out.setdefault(node, []).append([key, version, size, offer, *age])
            if claim:  # (Note [homes])
                self.followers.claimed[key] = version
                for node in told - to:
                    held.setdefault(node, []).append((now, [key, version, size, None, *age]))
            if offer is not None:
                offered.append((obj, to))

    def _announce_to(self, node: str, entries: list[list[Any]]) -> None:
        """An `announce` of `entries` to `node`, after the loop's replies (kept while its
        link reconnects: Links.after), for its incarnation as this broker knows it; what was
        held for it goes first (a claim's age counts the time it was held)."""
        now = time.monotonic()
        held = [entry for made, entry in self._held.pop(node, ()) if self._still(entry, now - made)]
        if held:
            entries = held + entries
        self._told_at[node] = now
        self.links.after(node, {"op": "announce", "keys": entries, **self.links.ack(node)})

    def _still(self, entry: list[Any], held: float) -> bool:
        """Whether held `entry` is still to be sent: not a claim of a key whose version on
        another node won here meanwhile (its homes hear of that one); a claim's age counts
        the `held` seconds it waited."""
        if len(entry) < 6:  # (a delete)
            return True
        if entry[0] in self.index:
            return False
        entry[5] += held
        return True

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

    def follow(self, node: str, keys: list[Any], prefixes: list[Any], prefetch: int = 0) -> None:
        """`node` follows these keys ([[key, the version it heard of], ...]), prefixes and
        versions of at most `prefetch` bytes (Note [follows]): told at once of the version of
        a key here newer than it heard of."""
        self.followers.follow_prefixes(node, [str(p) for p in prefixes], int(prefetch))
        newer, moved = [], []
        for key, heard in keys:
            obj, remote = self.registry.objects.get(key), self.index.get(key)
            if remote is not None and remote.node != node:  # another node's now: where
                moved.append([key, *remote, 0])  # (`node` may not have heard: Note [homes])
            elif obj is None and remote is None and key not in self.pulling:
                newer.append([key, 0, 0, None])  # deleted here (said while `node` was away)
            if obj is None or remote is not None or key in self.pulling:
                continue
            self.followers.follow(node, key)
            if obj.version > heard:
                newer.append([key, obj.version, int(obj.nbytes), None])
        if newer:
            self._announce_to(node, newer)
        if moved:
            self.links.after(node, {"op": "dir", "keys": moved})

    def claim_again(self, key: str, version: int, loser: str) -> None:
        """Node `loser` claimed `key` with a version that loses to this node's `version`:
        it and the key's home are told of this one (Note [homes]), so all converge on
        it."""
        self.followers.claimed.pop(key, None)
        self.announce(key, version)
        obj = self.registry.objects.get(key)
        if obj is not None and obj.version == version:
            self._announce_to(loser, [[key, version, int(obj.nbytes), None]])

    def claim_to(self, node: str, entries: list[list[Any]]) -> None:
        """Claims ([key, version, size, None], ...) of keys now homed at `node`."""
        self._announce_to(node, entries)

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
