"""Keys moving to their new homes as the nodes up change (Note [homes] in homes.py): Homes'
joins and leaves, in slices of MOVE_SLICE keys a turn of the loop."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

log = logging.getLogger(__name__)

MOVE_SLICE = 1000  # keys looked at a turn of the loop as the nodes up change (`changed`)
_DONE: Iterator[None] = iter(())


class Moves:
    """Homes' moves of keys (`changed`); what it uses of Homes is named here."""

    node: str
    members: tuple[str, ...]
    index: Any  # Mapping[str, Remote]
    asked: dict[str, str]
    lookers: dict[str, set[str]]
    links: Any  # Links
    objects: Any  # Objects
    own: Callable[[], list[list[Any]]]
    _moving: Iterator[None] = _DONE
    _queued: deque[tuple[tuple[str, ...], tuple[str, ...]]]  # (old, new): moves to make

    def homes(self, key: str, members: tuple[str, ...] | None = None) -> list[str]:
        raise NotImplementedError

    def home(self, key: str, members: tuple[str, ...] | None = None) -> str:
        raise NotImplementedError

    @staticmethod
    def homed_at(key: str, node: str, members: Iterable[str]) -> bool:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        raise NotImplementedError  # (Asking's)

    def changed(self, up: list[str], claim: Callable[[str, list[list[Any]]], None],
                keep: Callable[[str], bool], drop: Callable[[str], None]) -> None:  # fmt: skip
        """The nodes up are `up` now: the claims of this node's keys whose home changed go to
        the new home (`claim`), unless it just came up (its welcome lists them); the keys
        asked of are asked of their new home; the claims kept as their home that are not
        this node's to keep now, and are not kept for another reason (`keep`), `drop`. In
        slices of MOVE_SLICE keys, one a turn of the loop (`tick`), and the loop answers
        meanwhile. Only the keys homed at a node that came or went change homes, and
        `homed_at` finds them in a few hashes each: a key's homes among all nodes (N hashes)
        are found for those only. A move under way when the nodes change again goes on first
        (its slices too: as brokers join one by one, each change a move)."""
        old, new = self.members, tuple(sorted({self.node, *up}))
        if new == old:
            return
        self.members = new
        self._queued.append((old, new))
        if self._moving is _DONE:
            self._moving = self._move(claim, keep, drop)
        self.tick(time.monotonic())  # (a slice now)

    @property
    def moving(self) -> bool:
        """Whether a move of keys to their new homes is under way (`changed`)."""
        return self._moving is not _DONE

    def _move(self, claim: Callable[[str, list[list[Any]]], None], keep: Callable[[str], bool],
              drop: Callable[[str], None]) -> Iterator[None]:  # fmt: skip
        """The moves queued, in order (the nodes up changed from `old` to `new`, each)."""
        try:
            while self._queued:
                old, new = self._queued.popleft()
                try:
                    yield from self._moves(old, new, claim, keep, drop)
                except Exception:  # (a fault: logged, and the next move goes on)
                    log.exception("could not move keys to their homes")
        finally:
            self._moving = _DONE

    def _moves(self, old: tuple[str, ...], new: tuple[str, ...],
               claim: Callable[[str, list[list[Any]]], None], keep: Callable[[str], bool],
               drop: Callable[[str], None]) -> Iterator[None]:  # fmt: skip
        objects, own = self.objects.registry.objects, self.own()
        came, went, homed_at = set(new) - set(old), set(old) - set(new), self.homed_at

        def moved(key: str) -> bool:  # (whether its homes changed)
            return any(homed_at(key, n, new) for n in came) or any(
                homed_at(key, n, old) for n in went
            )

        for start in range(0, len(own), MOVE_SLICE):
            claims: dict[str, list[list[Any]]] = {}
            for key, version, size in own[start : start + MOVE_SLICE]:
                obj = objects.get(key)
                if obj is None or obj.version != version or key in self.index:
                    continue  # (not this node's now, as it was)
                if not any(homed_at(key, n, old) for n in went):
                    continue  # (a new home that came up hears of it with its welcome)
                before = self.homes(key, old)
                for home in self.homes(key, new):
                    if home not in before and home != self.node and home in old:
                        claims.setdefault(home, []).append([key, version, size, None])
            for home, entries in claims.items():
                claim(home, entries)
            yield
        asked = list(self.asked.items())
        for start in range(0, len(asked), MOVE_SLICE):
            asks: dict[str, list[str]] = {}
            for key, _ in asked[start : start + MOVE_SLICE]:
                was = self.asked.get(key)
                if was is None or (was in new and not any(homed_at(key, n, new) for n in came)):
                    continue  # (its home is still `was`)
                home = self.home(key)  # (among the nodes up now: a later move may be queued)
                if home == self.node:
                    self.asked.pop(key, None)
                elif home != was and key in self.asked:
                    asks.setdefault(home, []).append(key)
                    self.asked[key] = home
            for home, keys in asks.items():
                self.links.send(home, {"op": "where", "ask": 0, "keys": keys})
            yield
        for n, key in enumerate(list(self.index), 1):
            if key in self.index and homed_at(key, self.node, old) and moved(key):
                homes = self.homes(key)  # (among the nodes up now, as above)
                if homes[0] != self.node:
                    self.lookers.pop(key, None)  # (they ask its new home)
                if self.node not in homes and key not in self.asked and not keep(key):
                    drop(key)
            if n % MOVE_SLICE == 0:
                yield
