"""The walk over a bd pair: the one place that knows which chunk holds which stage copy.

Pipeline rank ``i`` and its partner ``pp-1-i`` hold the same two stages, each as ``model[0]`` (home copy) on one
and ``model[1]`` (mirror) on the other. Whatever keeps the copies equal (`broadcast_home_to_mirror`,
`sum_copies`) walks the two stages in stage order on both ranks so that the collectives pair up, over
``tensors_of(chunk)`` (one copy's tensors, in an order both share) flattened per dtype; on the middle rank of an
odd pipeline locally.
"""
from __future__ import annotations

import os
import pickle
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import groups

__all__ = ["BDPosition", "StageCopy", "position", "stage_copies", "flat_collective", "broadcast_home_to_mirror",
           "sum_copies", "check_same_structure"]

#: Deadline of a bd sum's and of the layout check's wait on the host (seconds), as the P2P timeout.
BD_SUM_TIMEOUT_S = float(os.environ.get("MEGATRON_DUALPIPE_P2P_TIMEOUT", "600"))

TensorsOf = Callable[[torch.nn.Module], List[torch.Tensor]]


@dataclass(frozen=True)
class BDPosition:
    """Where this rank sits in its pipeline and bd pair."""

    index: int  # pipeline rank i
    pp: int
    me: int  # global rank
    partner: int  # global rank of pipeline rank pp-1-i (== me on the middle rank of an odd pipeline)
    group: Optional[object]  # the bd group (None on the middle rank)

    @property
    def is_middle(self) -> bool:
        return self.partner == self.me


#: One of the pair's two stages, as seen from this rank: ``chunk`` 0 where its home copy is here (model[0]), 1
#: where its mirror is (model[1]); ``src`` the home copy's global rank.
StageCopy = namedtuple("StageCopy", "stage chunk src")


def position() -> BDPosition:
    """This rank's `BDPosition` (needs `groups.build_bd_groups`)."""
    pp_ranks = groups.get_pp_global_ranks()
    me = dist.get_rank()
    return BDPosition(pp_ranks.index(me), len(pp_ranks), me, groups.get_bd_mirror_rank(), groups.get_bd_group())


def stage_copies(pos: Optional[BDPosition] = None) -> List[StageCopy]:
    """The pair's two stages in the order both partners walk them: stage min(i, pp-1-i) first."""
    pos = pos or position()
    i, mirror_stage = pos.index, pos.pp - 1 - pos.index
    return [StageCopy(s, 0, pos.me) if s == i else StageCopy(s, 1, pos.partner) for s in sorted({i, mirror_stage})]


def flat_collective(tensors: Sequence[torch.Tensor], op: Callable[[torch.Tensor], None]) -> None:
    """Run `op` on one flat buffer per dtype (in order of first appearance) and copy the result back."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = _flatten_dense_tensors(group)
        op(flat)
        for t, synced in zip(group, _unflatten_dense_tensors(flat, group)):
            t.copy_(synced)


def _pair_collective(issue: Callable[[torch.Tensor], object], waiting: str) -> Callable[[torch.Tensor], None]:
    """``issue(flat)`` (an async collective over the bd pair) waited for as the executor waits: a partner that
    raised stops this rank through the abort signal instead of holding it until the group's timeout."""
    from ..executor import abort
    from ..executor.streams import waits_order_stream

    def run(flat: torch.Tensor) -> None:
        abort.wait_work(issue(flat), None, waiting, on_host=not waits_order_stream(flat))

    return run


def check_same_structure(signature: list, what: str, pos: Optional[BDPosition] = None,
                         timeout_s: float = BD_SUM_TIMEOUT_S) -> None:
    """Exchange ``signature`` (any picklable list) with the partner; raise naming both ranks if they differ
    (instead of hanging or mixing tensors up in the collective that follows)."""
    pos = pos or position()
    if pos.is_middle:
        return
    theirs = _exchange_with_partner(pos, signature, what, timeout_s)
    sigs = [signature, theirs] if pos.me < pos.partner else [theirs, signature]
    if sigs[0] != sigs[1]:
        diff = [x for x in zip(*sigs) if x[0] != x[1]][:3]
        raise RuntimeError(
            f"{what}: the two copies on ranks {groups.get_bd_ranks()} differ in structure (first differences: "
            f"{diff}; lengths {len(sigs[0])}, {len(sigs[1])})")


_EXCHANGES: Dict[Tuple[int, int], int] = {}


def _exchange_with_partner(pos: BDPosition, signature: list, what: str, timeout_s: float) -> list:
    """The partner's ``signature`` through the default group's store (``all_gather_object`` without one): a
    wait with its own deadline that checks the abort signal. A counter per pair keys the exchanges, which
    both partners make in the same order."""
    from ..executor import abort

    store = abort._store()
    if store is None:
        sigs: List[Optional[list]] = [None, None]
        dist.all_gather_object(sigs, signature, group=pos.group)
        return sigs[1] if pos.me < pos.partner else sigs[0]
    pair = (min(pos.me, pos.partner), max(pos.me, pos.partner))
    n = _EXCHANGES.get(pair, 0)
    _EXCHANGES[pair] = n + 1
    key = f"megatron_dualpipe/structure/{pair[0]}-{pair[1]}/{n}/"
    store.set(key + str(pos.me), pickle.dumps(signature))
    waiting = (f"global rank {pos.me} checking the {what} against its bd partner, global rank {pos.partner}: "
               f"waiting for the partner's layout")
    start = time.monotonic()
    while not store.check([key + str(pos.partner)]):
        abort.raise_if_failed(waiting)
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{waiting}: none within {timeout_s:g} s (has the partner built its model? look at "
                               f"its log)")
        time.sleep(0.01)
    return pickle.loads(store.get(key + str(pos.partner)))


def _shapes(tensors: Sequence[torch.Tensor]) -> list:
    return [(tuple(t.shape), str(t.dtype)) for t in tensors]


def broadcast_home_to_mirror(model: Sequence[torch.nn.Module], tensors_of: TensorsOf, what: str,
                             signature_of: Optional[Callable[[torch.nn.Module], list]] = None) -> None:
    """Copy ``tensors_of(model[0])`` on every rank into ``tensors_of(model[1])`` on its partner, after checking
    each stage's structure (``signature_of(chunk)``, default: its tensors' shapes and dtypes)."""
    pos = position()
    with torch.no_grad():
        if pos.is_middle:
            src, dst = tensors_of(model[0]), tensors_of(model[1])
            if _shapes(src) != _shapes(dst):
                raise RuntimeError(f"{what}: model[0] and model[1] on the middle rank differ in structure")
            for a, b in zip(src, dst):
                b.copy_(a)
            return
        for copy in stage_copies(pos):
            chunk = model[copy.chunk]
            tensors = tensors_of(chunk)
            check_same_structure(signature_of(chunk) if signature_of else _shapes(tensors),
                                 f"{what} of stage {copy.stage}", pos)
            if tensors:
                flat_collective(tensors, _pair_collective(
                    lambda flat: dist.broadcast(flat, src=copy.src, group=pos.group, async_op=True),
                    f"global rank {pos.me} in the broadcast of the {what} of stage {copy.stage} from global rank "
                    f"{copy.src} to global rank {pos.me + pos.partner - copy.src}"))


def sum_copies(model: Sequence[torch.nn.Module], tensors_of: TensorsOf) -> None:
    """Set ``tensors_of(chunk)`` of both copies of each stage to their sum (one all-reduce per dtype and stage).
    No structure check: it runs every iteration on structures `broadcast_home_to_mirror` checked."""
    pos = position()
    with torch.no_grad():
        if pos.is_middle:
            for a, b in zip(tensors_of(model[0]), tensors_of(model[1])):
                a.add_(b)
                b.copy_(a)
            return
        for copy in stage_copies(pos):
            tensors = tensors_of(model[copy.chunk])
            if tensors:
                flat_collective(tensors, _pair_collective(
                    lambda flat: dist.all_reduce(flat, group=pos.group, async_op=True),
                    f"global rank {pos.me} summing stage {copy.stage} with its bd partner, global rank {pos.partner}"))
