"""Routing policies: which healthy engine replica serves a new request.

A policy sees only the replicas in rotation (ready, heard from recently), each with a
``load``: the larger of its reported waiting+running and this api's requests in flight
on it (the report is up to a heartbeat old; the local count is current). Choose with
``POLICIES[name](block_size)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from shared.choices import ROUTER_POLICY_NAMES, keyed_by


class Candidate(Protocol):
    name: str

    @property
    def load(self) -> int: ...


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Candidate], prompt_ids: list[int]) -> Candidate:
        """One of ``candidates`` (never empty) for a request with this prompt."""
        ...


class RoundRobin:
    def __init__(self, block_size: int) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[Candidate], prompt_ids: list[int]) -> Candidate:
        self.turn += 1
        return candidates[self.turn % len(candidates)]


class LeastLoad:
    """The least loaded replica; ties rotate, so equal replicas share a burst."""

    def __init__(self, block_size: int) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[Candidate], prompt_ids: list[int]) -> Candidate:
        self.turn += 1
        n = len(candidates)
        return min(enumerate(candidates), key=lambda ic: (ic[1].load, (ic[0] - self.turn) % n))[1]


class PrefixAffinity:
    """Requests sharing a long prompt prefix go to the replica that served that prefix last.

    The prompt's leading full blocks are hashed as a chain (block i's hash covers blocks
    0..i, as the scheduler's prefix cache keys them). A replica is preferred when it
    served at least half of this prompt's full blocks, unless it is more than
    ``BALANCE_SLACK`` requests busier than the least loaded replica; otherwise the least
    loaded replica gets the request (and the prefix).
    """

    MAX_BLOCKS = 64  # prefixes longer than this many blocks route by their first MAX_BLOCKS
    MAX_ENTRIES = 1 << 16  # block hashes remembered (least recently routed dropped first)
    BALANCE_SLACK = 8

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.fallback = LeastLoad(block_size)
        self.owner: OrderedDict[int, str] = OrderedDict()  # chained block hash -> replica name

    def block_hashes(self, prompt_ids: list[int]) -> list[int]:
        hashes, parent = [], 0
        for i in range(min(len(prompt_ids) // self.block_size, self.MAX_BLOCKS)):
            parent = hash((parent, tuple(prompt_ids[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(parent)
        return hashes

    def choose(self, candidates: Sequence[Candidate], prompt_ids: list[int]) -> Candidate:
        hashes = self.block_hashes(prompt_ids)
        chosen = self._cached(candidates, hashes) or self.fallback.choose(candidates, prompt_ids)
        for h in hashes:
            self.owner[h] = chosen.name
            self.owner.move_to_end(h)
        while len(self.owner) > self.MAX_ENTRIES:
            self.owner.popitem(last=False)
        return chosen

    def _cached(self, candidates: Sequence[Candidate], hashes: list[int]) -> Candidate | None:
        by_name = {c.name: c for c in candidates}
        least = min(c.load for c in candidates)
        for matched in range(len(hashes), 0, -1):
            replica = by_name.get(self.owner.get(hashes[matched - 1], ""))
            if replica is not None:
                if 2 * matched >= len(hashes) and replica.load <= least + self.BALANCE_SLACK:
                    return replica
                return None
        return None


POLICIES: dict[str, type[RoundRobin] | type[LeastLoad] | type[PrefixAffinity]] = keyed_by(
    ROUTER_POLICY_NAMES, {"load": LeastLoad, "prefix": PrefixAffinity, "round_robin": RoundRobin}
)


def make_policy(name: str, block_size: int) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"--router-policy: unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name](block_size)
