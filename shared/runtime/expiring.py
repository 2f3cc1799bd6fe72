"""A bounded cache of entries trusted for a while: the gateway's verified keys and tenant models, and
the quotas' tenants known to have none. Bounded, so memory does not grow with every tenant that ever
called."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K, V = TypeVar("K"), TypeVar("V")


class ExpiringCache(Generic[K, V]):
    """Entries trusted for `ttl_s`, at most `max_entries` of them (the least recently stored go first):
    memory stays bounded however many tenants call."""

    def __init__(self, ttl_s: float, clock: Callable[[], float], max_entries: int = 100_000) -> None:
        self.ttl_s, self.clock, self.max_entries = ttl_s, clock, max_entries
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K) -> V | None:
        hit = self._entries.get(key)
        return hit[1] if hit and hit[0] > self.clock() else None

    def stale(self, key: K, stale_s: float) -> V | None:
        """The entry even past its trust, for at most `stale_s` after: what to go on while the source is
        unreachable."""
        hit = self._entries.get(key)
        return hit[1] if hit and hit[0] + stale_s > self.clock() else None

    def clear(self) -> None:
        self._entries.clear()

    def put(self, key: K, value: V) -> None:
        self._entries[key] = (self.clock() + self.ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
