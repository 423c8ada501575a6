"""Which of two nodes' puts of one key wins (Note [homes] in homes.py): a claim put SETTLED
after the owner's version goes above it (`renumber`); puts closer together are ordered by
version, then node name, and the one that lost is counted and logged. Replicas'."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..store.objects import Objects
from ..store.records import StoredObject
from ..store.registry import Registry
from .lending import Lending
from .records import Links, Pull, Remote

log = logging.getLogger(__name__)

# Seconds after which a version sealed here surely came before a put elsewhere that had not
# heard of it, when this node hears of that put (Note [homes]).
SETTLED = 1.0


class Ordering:
    """Replicas' side of the order of puts across nodes; what it uses of Replicas is named
    here."""

    links: Links
    lending: Lending
    registry: Registry
    objects: Objects
    index: Mapping[str, Remote]
    _pulling: Mapping[str, Pull]
    puts_lost: int

    def _beats(self, node: str, key: str, version: int, here: StoredObject, age: Any) -> None:
        """`node`'s claim of `key` loses to this node's version, `here`. A claim put (`age`
        seconds ago) SETTLED after this one was sealed came later: it goes above this one
        (`renumber`, Note [homes]), whatever versions its node had heard of. Else its node
        and the key's homes are told of this one."""
        put = time.monotonic() - float(age) if isinstance(age, (int, float)) else None
        if put is not None and here.sealed_at < put - SETTLED:
            self.links.after(node, {"op": "renumber", "key": key, "above": here.version})
        else:
            self.lending.claim_again(key, here.version, node)

    def renumber(self, node: str, key: str, above: int) -> None:
        """`node` holds a version of `key` (`above`) sealed before this node's put of it,
        made without having heard of any: this one goes on above it (the same object, its
        readers keep what they read), and is claimed again (to its homes, and `node`)."""
        obj = self.registry.objects.get(key)
        if obj is None or key in self.index or key in self._pulling:
            return  # (not this node's now)
        if obj.version <= above:
            obj.version = above + 1
            self.registry.relist(obj)
            if obj.device == "cpu":
                self.registry.journal.sealed(obj)
            self.lending.beaten[key] = node
            self.objects.arrived(key, obj.version)
        self.lending.followers.claimed.pop(key, None)
        self.lending.announce(key, obj.version)

    def _lost(self, key: str, here: StoredObject, node: str, version: int) -> None:
        """This node's version of `key`, `here`, lost to `node`'s `version`. A claim that lost
        within SETTLED of its put (to one at the same time, or a version its node had not
        heard of) is counted and logged: its client was answered ok."""
        claimed = self.lending.followers.claimed.get(key, here.version) == here.version
        if claimed and time.monotonic() - here.sealed_at < SETTLED:
            self.puts_lost += 1
            log.warning(
                "the put of %r here (version %d) lost to node %r's version %d: puts of a "
                "key on two nodes are ordered by version, then by node name (a node that "
                "has not read a key puts above the versions it heard of)", key,
                here.version, node, version,
            )  # fmt: skip
