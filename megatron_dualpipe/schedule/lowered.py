"""One rank's iteration lowered to one list of ops: what the runner executes and the checks read.

Why: the runner walked the communication plan its own way (post what is due, wait for the inputs,
release the sent outputs, compute) and the iteration plan re-enacted that walk by hand, so the
check proved a model of the runner. Lowered once into a flat list of a few op kinds, each with a
text form that parses back, the same list is what runs and what is checked.

Op kinds, in their text form (a ``#`` starts a comment the parser ignores)::

    post K                  post batch K of the plan: its sends and receives, one batch_isend_irecv
    begin U                 unit U's batches are posted: finished sends are reaped, its waits start
    recv KIND:D:MB:S <- P   wait for the receive of that tensor from pipeline rank P
    release KIND:D:MB:S -> P  wait for the send of a forward's output before its backward frees it
    run U                   run execution unit U (one action, or a fused F&B pair)
    sum C                   issue the bd sum of chunk C (DualPipe: the two copies of a stage summed
                            over the bd pair), at the point the iteration plan gives
    dp C                    start chunk C's data-parallel reduction (``--overlap-grad-reduce``) there
    finish                  wait for every send still outstanding
    coll KIND over GROUP    issue collective KIND (a token, e.g. ``grad-norm``, ``reduce-scatter:3``)
                            on communicator GROUP (e.g. ``mp``, ``shard:3``) and wait for it: the
                            collectives after the schedule and around the optimizer step
                            (``schedule.step_collectives``)
    gather C                start chunk C's parameter all-gathers (``--overlap-param-gather``)
    gathered C              chunk C's all-gathers are waited (DDP's pre-hook, in the ``run`` next)
    summed C                wait for chunk C's bd sum
    loss D -> P             send direction D's loss entries to pipeline rank P (``<- P``: receive)
    finalize                Megatron's finalize: it waits for the data-parallel reductions started

The collectives around the schedule are ops too (``schedule.program``): the runner hands each
op it does not run itself (:data:`DELEGATED`) to its listeners, and the ops after ``finish``
(:func:`after_finish`) run after the schedule, in list order, by the Megatron glue
(``mcore.program_ops``). Labels are the plan's ``(kind, direction, micro-batch, consuming
stage)``. Padding (fake micro-batches) is lowered like the rest, except that a fake forward's
output is never released (nothing was saved for it). Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .actions import F, Action
from .comm import Label, RankPlan

POST, BEGIN, RECV, RELEASE, RUN, FINISH = "post", "begin", "recv", "release", "run", "finish"
SUM, DP = "sum", "dp"
COLL = "coll"
GATHER, GATHERED, SUMMED, FINALIZE = "gather", "gathered", "summed", "finalize"
LOSS_SEND, LOSS_RECV = "loss ->", "loss <-"  # text: ``loss D -> P`` / ``loss D <- P``
KINDS = (POST, BEGIN, RECV, RELEASE, RUN, SUM, DP, FINISH, COLL, GATHER, GATHERED, SUMMED, "loss", FINALIZE)
#: The ops whose text is ``KIND C``.
INDEXED = frozenset((POST, BEGIN, RUN, SUM, DP, GATHER, GATHERED, SUMMED))
#: The ops the runner hands to its listeners (``RunListener.on_op``): collectives of the code around it.
DELEGATED = frozenset((SUM, DP, GATHER, GATHERED, SUMMED, LOSS_SEND, LOSS_RECV, COLL, FINALIZE))


class LoweringError(ValueError):
    """A plan that cannot be lowered, or a text that does not parse."""


@dataclass(frozen=True)
class Op:
    """One op. ``index``: the batch (post) or the unit (begin, run) or the unit the wait precedes
    (recv, release; -1 after the last unit) or the chunk (sum, dp, gather, gathered, summed) or the
    direction (loss); ``label`` and ``peer`` for the waits, ``peer`` for the loss;
    ``what`` and ``group`` for a ``coll``."""

    kind: str
    index: int = -1
    label: Optional[Label] = None
    peer: int = -1
    what: str = ""
    group: str = ""

    def text(self) -> str:
        if self.kind == COLL:
            return f"{COLL} {self.what} over {self.group}"
        if self.kind in INDEXED:
            return f"{self.kind} {self.index}"
        if self.kind in (LOSS_SEND, LOSS_RECV):
            return f"loss {self.index} {self.kind[-2:]} {self.peer}"
        if self.kind in (RECV, RELEASE):
            arrow = "<-" if self.kind == RECV else "->"
            return f"{self.kind} {':'.join(str(x) for x in self.label)} {arrow} {self.peer}"
        return self.kind


def lower(rank: int, plan: RankPlan, actions: Sequence[Action], padding: Sequence[bool]) -> Tuple[Op, ...]:
    """Rank ``rank``'s ops: per unit, the batches due by then, ``begin``, the receives its actions
    take (in action order; a hand-over on this rank, DualPipeV's turn, is no wait), the releases of
    the forward outputs its backwards need freed, ``run``; after the last unit the remaining
    batches and ``finish``."""
    ops: List[Op] = []
    posted = 0
    sent: dict = {}  # forward (dir, mb, stage) -> (label, peer) of its output's send, once posted
    senders = _remote_forward_senders(rank, plan, actions, padding)
    for k, unit in enumerate(plan.units):
        posted = _post_due(plan, k, posted, ops, senders, sent)
        ops.append(Op(BEGIN, k))
        ops += [Op(RECV, k, label, src) for i in unit for src, label in plan.inputs[i] if src != rank]
        for i in unit:
            a = actions[i]
            if a.is_backward and (a.dir, a.mb, a.stage) in sent:
                label, peer = sent.pop((a.dir, a.mb, a.stage))
                ops.append(Op(RELEASE, k, label, peer))
        ops.append(Op(RUN, k))
    _post_due(plan, len(plan.units), posted, ops, senders, sent)
    ops.append(Op(FINISH))
    return tuple(ops)


def after_finish(ops: Sequence[Op]) -> int:
    """The position after ``finish``: ``ops[:n]`` is the schedule, ``ops[n:]`` what runs after it."""
    for n in range(len(ops) - 1, -1, -1):
        if ops[n].kind == FINISH:
            return n + 1
    raise LoweringError("the program has no finish op")


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
        ops.append(Op(POST, posted))
        posted += 1
    return posted


def to_text(ops: Sequence[Op], actions: Optional[Sequence[Action]] = None,
            plan: Optional[RankPlan] = None) -> str:
    """One op per line; with ``actions`` and ``plan`` each ``run`` names its actions in a comment."""
    lines = []
    for op in ops:
        line = op.text()
        if op.kind == RUN and actions is not None and plan is not None:
            line += "  # " + " + ".join(str(actions[i]) for i in plan.units[op.index])
        lines.append(line)
    return "\n".join(lines) + "\n"


def parse(text: str) -> Tuple[Op, ...]:
    """The ops of :func:`to_text`'s form (comments and blank lines ignored); a wait belongs to the
    unit of the ``begin`` before it."""
    ops = []
    unit = -1
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            op = _parse_line(line, n, unit)
            unit = op.index if op.kind == BEGIN else unit
            ops.append(op)
    return tuple(ops)


def _parse_line(line: str, n: int, unit: int) -> Op:
    words = line.split()
    kind = words[0]
    try:
        if kind in INDEXED and len(words) == 2:
            return Op(kind, int(words[1]))
        if kind in (RECV, RELEASE) and len(words) == 4 and words[2] == ("<-" if kind == RECV else "->"):
            what, d, mb, stage = words[1].split(":")
            return Op(kind, unit, (what, int(d), int(mb), int(stage)), int(words[3]))
        if kind in (FINISH, FINALIZE) and len(words) == 1:
            return Op(kind)
        if kind == "loss" and len(words) == 4 and words[2] in ("->", "<-"):
            return Op(f"loss {words[2]}", int(words[1]), peer=int(words[3]))
        if kind == COLL and len(words) == 4 and words[2] == "over":
            return Op(COLL, what=words[1], group=words[3])
    except ValueError:
        pass
    raise LoweringError(f"line {n}: {line!r} is not an op (one of: {', '.join(KINDS)}; see schedule.lowered)")
