"""The ops of a rank's program: what the runner executes, the simulator times and the check proves.

Why: one list, with a text form that parses back, is what runs and what is checked. Op kinds in
their text form (``#`` starts a comment)::

    post K                  post batch K of the plan: its sends and receives, one batch_isend_irecv
    begin U                 unit U's batches are posted: finished sends are reaped, its waits start
    recv KIND:D:MB:S <- P   wait for the receive of that tensor from pipeline rank P
    release KIND:D:MB:S -> P  wait for the send of a forward's output before its backward frees it
    run U                   run execution unit U (one action, or a fused F&B pair)
    final C                 chunk C's gradient actions are done (Megatron's deferred output-layer
                            weight gradients drain: ``--defer-embedding-wgrad-compute``)
    sum C                   issue the bd sum of chunk C (DualPipe: the two copies of a stage summed
                            over the bd pair), at the point the reductions pass gives
    dp C                    start chunk C's data-parallel reduction (``--overlap-grad-reduce``) there
    finish                  wait for every send still outstanding
    coll KIND over GROUP    issue collective KIND (a token, e.g. ``grad-norm``, ``reduce-scatter:3``)
                            on communicator GROUP (e.g. ``mp``, ``shard:3``) and wait for it
    gather C                start chunk C's parameter all-gathers (``--overlap-param-gather``)
    gathered C              chunk C's all-gathers are waited (DDP's pre-hook, in the ``run`` next)
    summed C                wait for chunk C's bd sum
    settle                  after every sum is waited: the middle rank of an odd pipeline sums its two
                            copies, tied embeddings are folded (before the reductions after it)
    loss D -> P             send direction D's loss entries to pipeline rank P (``<- P``: receive)
    finalize                Megatron's finalize: it waits for the data-parallel reductions started

The runner hands the ops it does not run (:data:`DELEGATED`) to its listeners; the ops after
``finish`` (:func:`after_finish`) the Megatron glue runs in list order (``mcore.program_ops``).
Labels are the plan's. Standard library only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..actions import Action
from ..comm import Label, RankPlan


class OpKind(str, enum.Enum):
    """An op's kind; its value is the op's first word(s) in the text form."""

    POST = "post"
    BEGIN = "begin"
    RECV = "recv"
    RELEASE = "release"
    RUN = "run"
    FINAL = "final"
    SUM = "sum"
    DP = "dp"
    FINISH = "finish"
    COLL = "coll"
    GATHER = "gather"
    GATHERED = "gathered"
    SUMMED = "summed"
    SETTLE = "settle"
    LOSS_SEND = "loss ->"  # text: ``loss D -> P``
    LOSS_RECV = "loss <-"  # text: ``loss D <- P``
    FINALIZE = "finalize"

    def __str__(self) -> str:
        return self.value


#: The ops whose text is ``KIND C``.
INDEXED = frozenset((OpKind.POST, OpKind.BEGIN, OpKind.RUN, OpKind.FINAL, OpKind.SUM, OpKind.DP, OpKind.GATHER,
                     OpKind.GATHERED, OpKind.SUMMED))
#: The ops the runner hands to its listeners (``RunListener.on_op``): collectives of the code around it.
DELEGATED = frozenset((OpKind.FINAL, OpKind.SUM, OpKind.DP, OpKind.SETTLE, OpKind.GATHER, OpKind.GATHERED,
                       OpKind.SUMMED, OpKind.LOSS_SEND, OpKind.LOSS_RECV, OpKind.COLL, OpKind.FINALIZE))
_WAITS = {OpKind.RECV: "<-", OpKind.RELEASE: "->"}


class LoweringError(ValueError):
    """A plan that cannot be lowered, or a text that does not parse."""


@dataclass(frozen=True)
class Op:
    """One op. ``index``: the batch (post), the unit (begin, run; for recv and release the unit
    the wait precedes, -1 after the last), the chunk (final, sum, dp, gather, gathered, summed) or
    the direction (loss); ``label`` and ``peer`` for the waits and the loss; ``what`` and ``group``
    for a ``coll``."""

    kind: OpKind
    index: int = -1
    label: Optional[Label] = None
    peer: int = -1
    what: str = ""
    group: str = ""

    def text(self) -> str:
        kind = self.kind
        if kind is OpKind.COLL:
            return f"coll {self.what} over {self.group}"
        if kind in INDEXED:
            return f"{kind.value} {self.index}"
        if kind in (OpKind.LOSS_SEND, OpKind.LOSS_RECV):
            return f"loss {self.index} {kind.value[-2:]} {self.peer}"
        if kind in _WAITS:
            return f"{kind.value} {':'.join(str(x) for x in self.label)} {_WAITS[kind]} {self.peer}"
        return kind.value


def coll(what: str, group: str) -> Op:
    """A ``coll WHAT over GROUP`` op: a collective after the schedule or around the optimizer step."""
    return Op(OpKind.COLL, what=what, group=group)


def after_finish(ops: Sequence[Op]) -> int:
    """The position after ``finish``: ``ops[:n]`` is the schedule, ``ops[n:]`` what runs after it."""
    for n in range(len(ops) - 1, -1, -1):
        if ops[n].kind is OpKind.FINISH:
            return n + 1
    raise LoweringError("the program has no finish op")


def to_text(ops: Sequence[Op], actions: Optional[Sequence[Action]] = None,
            plan: Optional[RankPlan] = None) -> str:
    """One op per line; with ``actions`` and ``plan`` each ``run`` names its actions in a comment."""
    lines = []
    for op in ops:
        line = op.text()
        if op.kind is OpKind.RUN and actions is not None and plan is not None:
            line += "  # " + " + ".join(str(actions[i]) for i in plan.units[op.index])
        lines.append(line)
    return "\n".join(lines) + "\n"


def parse(text: str) -> Tuple[Op, ...]:
    """The ops of :func:`to_text`'s form (comments and blank lines ignored); a wait belongs to the
    unit of the ``begin`` before it."""
    ops: List[Op] = []
    unit = -1
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            op = _parse_line(line, n, unit)
            unit = op.index if op.kind is OpKind.BEGIN else unit
            ops.append(op)
    return tuple(ops)


def _parse_line(line: str, n: int, unit: int) -> Op:
    words = line.split()
    try:
        if words[0] == "loss" and len(words) == 4 and words[2] in ("->", "<-"):
            return Op(OpKind(f"loss {words[2]}"), int(words[1]), peer=int(words[3]))
        kind = OpKind(words[0])
        if kind in INDEXED and len(words) == 2:
            return Op(kind, int(words[1]))
        if kind in _WAITS and len(words) == 4 and words[2] == _WAITS[kind]:
            what, d, mb, stage = words[1].split(":")
            return Op(kind, unit, (what, int(d), int(mb), int(stage)), int(words[3]))
        if kind in (OpKind.FINISH, OpKind.SETTLE, OpKind.FINALIZE) and len(words) == 1:
            return Op(kind)
        if kind is OpKind.COLL and len(words) == 4 and words[2] == "over":
            return Op(kind, what=words[1], group=words[3])
    except ValueError:
        pass
    kinds = ", ".join(sorted({k.value.split()[0] for k in OpKind}))
    raise LoweringError(f"line {n}: {line!r} is not an op (one of: {kinds}; see schedule.lowering.ops)")
