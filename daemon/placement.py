"""Which memory a sequence's copies may live in: memory clients map, or daemon-private memory.

Every ``trusted_local`` tenant maps the whole host arena (by its path) and the whole
device pool (by its IPC handle). So the bytes of a tenant that is not trusted_local are
kept out of both: its copies live in the ``private`` tier (``kvpark.tiers.private``),
which no client maps, and only there, whatever tier a park, a restore, a prefetch or a
demotion asks for. Everyone else's copies never go to the private tier. The choice is
made per sequence, from its id's namespace (``<tenant>`` + ``NS_SEP``): shared blocks
are namespaced too, so one tenant's block is never another's copy.

Primitives:
- ``PRIVATE``: the private tier's name; ``CLIENT_TIERS``: the memory tiers a client may
  name (``device``, ``host``: never ``private``).
- ``Placement(untrusted)``: the names of the tenants that are not trusted_local.
- ``private(seq_id) -> bool``: its copies belong in the private tier.
- ``tier(seq_id, wanted) -> str``: the memory tier a copy of ``seq_id`` bound for
  ``wanted`` goes to (``PRIVATE`` for a private sequence, else ``wanted``).
- ``allowed(seq_id, tier) -> bool``: whether a copy of ``seq_id`` may be in ``tier``.
- ``quota_tier(tier) -> str``: the quota a copy in ``tier`` is charged to (the private
  tier is host memory: the ``host`` quota).

An id outside every namespace (an open daemon's, or one parked before tenants were
configured) is not private; neither is one of a tenant no longer configured, since no
call can name it (the index holds it on disk only, memory being empty at start).
"""

from __future__ import annotations

from typing import Iterable

from .model import NS_SEP

PRIVATE = "private"
CLIENT_TIERS = ("device", "host")


def quota_tier(tier: str) -> str:
    return "host" if tier == PRIVATE else tier


class Placement:
    def __init__(self, untrusted: Iterable[str] = ()) -> None:
        self._prefixes = frozenset(name + NS_SEP for name in untrusted)

    @property
    def any(self) -> bool:
        """Whether any sequence can be private (the daemon has the private tier)."""
        return bool(self._prefixes)

    def private(self, seq_id: str) -> bool:
        if not self._prefixes:
            return False
        cut = seq_id.find(NS_SEP)
        return cut >= 0 and seq_id[:cut + 1] in self._prefixes

    def tier(self, seq_id: str, wanted: str) -> str:
        return PRIVATE if self.private(seq_id) else wanted

    def allowed(self, seq_id: str, tier: str) -> bool:
        return (tier == PRIVATE) == self.private(seq_id)


__all__ = ["CLIENT_TIERS", "PRIVATE", "Placement", "quota_tier"]
