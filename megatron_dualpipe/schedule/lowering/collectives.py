"""The gathers, loss and finalize pass: the collectives the code around the runner issues, as ops at
fixed places, so that they are what the check proves. A chunk's parameter gathers start in the order of
the first real forwards (one communicator runs them in issue order; a gather no forward waits for would
still be in flight next iteration). Standard library only.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from ..actions import F, Action
from ..layout import Layout
from .ops import Op, OpKind

#: What the finalize's token-count all-reduce is called in a ``coll`` op.
TOKEN_COUNT = "token-count"


def chunks_with_real_forward(acts: Sequence[Action], is_fake: Callable) -> List[int]:
    """The chunks (model indices) of a rank with a real forward, in the order of their first real
    forward: the ones whose parameter all-gathers are started, in that order. DualPipe's second
    half of the ranks, and DualPipeV nowhere, run chunk 1 first."""
    order: List[int] = []
    for a in acts:
        if a.op == F and not is_fake(a) and a.dir not in order:
            order.append(a.dir)
    return order


def place_gathers(ops: Sequence[Op], actions: Sequence[Action], units: Sequence[Tuple[int, ...]],
                  is_fake: Callable) -> Tuple[Op, ...]:
    """``ops`` with the parameter gathers first and each chunk's wait before its first real forward's unit
    (DDP's pre-hook waits there)."""
    gathers = chunks_with_real_forward(actions, is_fake)
    unit_of = {i: u for u, unit in enumerate(units) for i in unit}
    waits: Dict[int, List[Op]] = {}
    for c in gathers:
        first = next(i for i, a in enumerate(actions) if a.op == F and a.dir == c and not is_fake(a))
        waits.setdefault(unit_of[first], []).append(Op(OpKind.GATHERED, c))
    out: List[Op] = [Op(OpKind.GATHER, c) for c in gathers]
    run = OpKind.RUN
    for op in ops:
        if op.kind is run:
            out += waits.get(op.index, ())
        out.append(op)
    return tuple(out)


def loss_gather(layout: Layout, r: int) -> List[Op]:
    """Rank ``r``'s part of the loss gather: each direction whose last stage ends the model and
    is not on rank pp-1 ships its loss entries there, in direction order."""
    last, out = layout.pp - 1, []
    for d in layout.directions:
        final = layout.stages(d)[-1]
        owner = layout.rank_of(d, final)
        if not layout.is_last(d, final) or owner == last:
            continue
        if r == owner:
            out.append(Op(OpKind.LOSS_SEND, d, peer=last))
        elif r == last:
            out.append(Op(OpKind.LOSS_RECV, d, peer=owner))
    return out


def finalize(layout: Layout) -> List[Op]:
    """The finalize's ops: for two chunks the token-count all-reduce over the pipeline
    (``mcore.finalize``, issued with per-token loss), then Megatron's finalize."""
    tokens = [Op(OpKind.COLL, what=TOKEN_COUNT, group="pp")] if len(layout.directions) == 2 else []
    return tokens + [Op(OpKind.FINALIZE)]
