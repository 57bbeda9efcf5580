"""The p2p and lower passes: a rank's actions become its P2P batches (``comm.plan``) and one list
of ops (post, begin, recv, release, run, finish), the one the runner, the simulator and the check
walk. A fake forward's output is never released (nothing was saved for it). Standard library only.
"""
from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

from ..actions import F, Action
from ..comm import RankPlan, plan
from ..layout import Layout
from .ops import Op, OpKind


@functools.lru_cache(maxsize=16)
def lower_ranks(layout: Layout, ranks: Tuple[Tuple[Action, ...], ...], padding: Tuple[Tuple[bool, ...], ...]
                ) -> Tuple[Tuple[RankPlan, ...], Tuple[Tuple[Op, ...], ...]]:
    """Every rank's communication plan (the p2p pass) and lowered ops (the lower pass); cached, as
    the simulator times one schedule under many costs."""
    plans = tuple(plan(layout, ranks))
    return plans, tuple(lower(r, plans[r], ranks[r], padding[r]) for r in range(len(ranks)))


def lower(rank: int, plan: RankPlan, actions: Sequence[Action], padding: Sequence[bool]) -> Tuple[Op, ...]:
    """Rank ``rank``'s ops: per unit the batches due, ``begin``, the receives its actions take (a
    hand-over on this rank, DualPipeV's turn, is no wait), the releases of the forward outputs its
    backwards free, ``run``; then the remaining batches and ``finish``."""
    ops: List[Op] = []
    posted = 0
    sent: dict = {}  # forward (dir, mb, stage) -> (label, peer) of its output's send, once posted
    senders = _remote_forward_senders(rank, plan, actions, padding)
    for k, unit in enumerate(plan.units):
        posted = _post_due(plan, k, posted, ops, senders, sent)
        ops.append(Op(OpKind.BEGIN, k))
        ops += [Op(OpKind.RECV, k, label, src) for i in unit for src, label in plan.inputs[i] if src != rank]
        for i in unit:
            a = actions[i]
            if a.is_backward and (a.dir, a.mb, a.stage) in sent:
                label, peer = sent.pop((a.dir, a.mb, a.stage))
                ops.append(Op(OpKind.RELEASE, k, label, peer))
        ops.append(Op(OpKind.RUN, k))
    _post_due(plan, len(plan.units), posted, ops, senders, sent)
    ops.append(Op(OpKind.FINISH))
    return tuple(ops)


def _remote_forward_senders(rank: int, plan: RankPlan, actions: Sequence[Action], padding: Sequence[bool]) -> dict:
    """(peer, label) -> forward (dir, mb, stage) for each real forward's output sent to another rank."""
    out = {}
    for i, a in enumerate(actions):
        if a.op == F and not padding[i]:
            for dst, label in plan.outputs[i]:
                if dst != rank:
                    out[(dst, label)] = (a.dir, a.mb, a.stage)
    return out


def _post_due(plan: RankPlan, upto: int, posted: int, ops: List[Op], senders: dict, sent: dict) -> int:
    """Append the posts of the batches due before unit ``upto``; return how many are posted."""
    while posted < len(plan.batches) and plan.batches[posted].unit <= upto:
        for t in plan.batches[posted].sends:
            key = senders.get((t.peer, t.label))
            if key is not None:
                sent[key] = (t.label, t.peer)
        ops.append(Op(OpKind.POST, posted))
        posted += 1
    return posted
