"""Whether every rank issues its collectives in an order that can complete under NCCL's rules.

Two rules, both about the order in which the ranks *issue* collectives (waits do not matter):

* **one communicator**: NCCL pairs the collectives of a communicator by their position. Every
  member must issue the same collectives on it in the same order; otherwise the k-th of one rank
  meets the k-th of another: a hang, or, where sizes agree, a silently wrong sum (rank r's
  reduce-scatter of stage i added to its partner's of stage pp-1-i).
* **one stream**: Megatron issues a chunk's gradient reduce-scatter and parameter all-gather on
  the current stream (or one communication stream), and NCCL runs the kernels of one stream in
  order (with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` even those of different streams). A collective
  holds its stream until every member reached it, so two collectives on *different*
  communicators over overlapping ranks, issued in opposite orders by two ranks, wait for each
  other forever. The DualPipe shared shard group has exactly that shape: stage ``i`` and stage
  ``pp-1-i`` each have a group over the same ``2 x dp`` ranks, and Megatron's per-chunk loop
  (``for chunk in model``) issues stage ``i`` first on rank ``i`` and stage ``pp-1-i`` first on
  its partner.

:func:`order_problem` checks the first rule per communicator, then runs every rank's list as
one stream (a collective fires when it heads the list of all its members) and returns the first
:class:`OrderProblem` found (the rank, the position in its list, the collective, why), or None.

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: its ranks (the communicator's, in group order) and what
    every member must issue alike (``key``, e.g. ("reduce-scatter", stage, bucket))."""

    group: Tuple[int, ...]
    key: Hashable

    def __str__(self) -> str:
        return f"{self.key} over ranks {list(self.group)}"


@dataclass(frozen=True)
class OrderProblem:
    """Where the order breaks: ``rank``'s ``index``-th collective, and why (``message``)."""

    rank: int
    index: int
    collective: Collective
    message: str

    def __str__(self) -> str:
        return self.message


def _by_group(c: Collective) -> Hashable:
    return c.group


def order_problem(issued: Mapping[int, Sequence[Collective]],
                  communicator: Callable[[Collective], Hashable] = _by_group) -> Optional[OrderProblem]:
    """The first problem of the ranks' issue orders (module docstring), or None. ``issued``: per
    global rank, its collectives in issue order; ``communicator``: which communicator a collective
    runs on (default: one per distinct group)."""
    # Every rank issues only collectives it is a member of.
    for r, cs in issued.items():
        for i, c in enumerate(cs):
            if r not in c.group:
                return OrderProblem(r, i, c, f"rank {r} issues collective {i} ({c}) but is not one of its ranks")
    # Rule 1: per communicator, every member issues the same sequence.
    seq: Dict[Tuple[Hashable, int], List[Tuple[int, Collective]]] = {}
    members: Dict[Hashable, Tuple[int, ...]] = {}
    for r, cs in issued.items():
        for i, c in enumerate(cs):
            comm = communicator(c)
            seq.setdefault((comm, r), []).append((i, c))
            members.setdefault(comm, tuple(sorted(c.group)))
    for comm, ranks in members.items():
        first = ranks[0]
        ref = seq.get((comm, first), [])
        for r in ranks[1:]:
            mine = seq.get((comm, r), [])
            for k in range(max(len(ref), len(mine))):
                a = ref[k] if k < len(ref) else None
                b = mine[k] if k < len(mine) else None
                if a is not None and b is not None and a[1].key == b[1].key and a[1].group == b[1].group:
                    continue
                if b is None:
                    i0, c0 = a
                    return OrderProblem(first, i0, c0, f"on the communicator of ranks {list(ranks)}, rank {first}'s "
                                        f"collective {i0} ({c0}) is its {k}-th there, and rank {r} issues only {k}: "
                                        f"rank {first} waits forever")
                i1, c1 = b
                theirs = f"its {k}-th is {a[1]}" if a is not None else f"it issues only {k}"
                return OrderProblem(r, i1, c1, f"on the communicator of ranks {list(ranks)}, rank {r}'s collective {i1} "
                                    f"({c1}) is its {k}-th there, but for rank {first} {theirs}: NCCL pairs them by "
                                    f"position (a hang, or a sum of unrelated tensors where the sizes agree)")
    # Rule 2: every rank's list as one stream.
    heads = {r: 0 for r in issued}
    instance: Dict[Tuple[int, int], Tuple[Hashable, int]] = {}
    for (comm, r), lst in seq.items():
        for k, (i, _) in enumerate(lst):
            instance[(r, i)] = (comm, k)
    progress = True
    while progress:
        progress = False
        for r, cs in issued.items():
            i = heads[r]
            if i >= len(cs):
                continue
            me = instance[(r, i)]
            group = cs[i].group
            if all(heads.get(m, 0) < len(issued.get(m, ())) and instance[(m, heads[m])] == me for m in group):
                for m in group:
                    heads[m] += 1
                progress = True
    stuck = [r for r, cs in issued.items() if heads[r] < len(cs)]
    if not stuck:
        return None
    r = stuck[0]
    i = heads[r]
    c = issued[r][i]
    blocker = next(m for m in c.group if heads.get(m, 0) >= len(issued.get(m, ()))
                   or instance[(m, heads[m])] != instance[(r, i)])
    if heads.get(blocker, 0) >= len(issued.get(blocker, ())):
        why = f"rank {blocker} has issued all it issues"
    else:
        j = heads[blocker]
        why = f"rank {blocker}'s stream is held by its collective {j} ({issued[blocker][j]}), issued first there"
    return OrderProblem(r, i, c, f"rank {r}'s collective {i} ({c}) never starts: it waits for rank {blocker}, and {why}; "
                        f"collectives over shared ranks issued in different orders on one stream deadlock "
                        f"(stuck ranks: {stuck})")


__all__ = ["Collective", "OrderProblem", "order_problem"]
