"""All of one iteration's communication in one plan, checked under NCCL stream semantics.

The communication plan (``comm``) proves that the P2P batches alone cannot deadlock. An
iteration communicates more: the first all-reduce on the pipeline group, DualPipe's bd sums
(the two copies of a stage summed over the bd pair, issued while the schedule runs), the
data-parallel reductions (``--overlap-grad-reduce``, during or after the schedule), the loss
gather to the last pipeline rank and the token all-reduce of the finalize. On a GPU with NCCL
these interact through the streams, not only through the host:

* each rank's compute stream runs its units in order;
* a P2P batch or a collective starts after the compute the stream ran before it was posted,
  and after the earlier work on the same communicator of that rank (one NCCL stream per
  communicator, in posting order);
* a stream wait (``Work.wait()`` on an accelerator) blocks everything after it on the stream,
  every later batch and collective included;
* a P2P batch completes when every operation in it met its peer's started batch; a collective
  when all its ranks started it.

:func:`build` turns a schedule into every rank's list of stream items (compute units, posts,
waits), one op of the rank's program at a time (``schedule.program``: the lowered schedule with
the parameter gathers, bd sums, data-parallel reductions, loss gather and finalize at the points
this module decides), the very list the runner and the Megatron glue execute, and
:func:`check` runs them to completion under those rules or raises :class:`IterationPlanError`
naming the cycle; ``one_queue=True`` adds ``CUDA_DEVICE_MAX_CONNECTIONS=1``'s rule (a post
waits for every earlier work of its rank, whatever the communicator). Two places are decided
here and read by the executor, so that what is checked is what runs: the bd sums' issue points
(:attr:`IterationPlan.sum_points`, the partners in the same order of stages) and the
data-parallel reductions' start points (:attr:`IterationPlan.dp_points`, :func:`dp_start_points`).

Data parallelism: the start points are data of the plan, computed from what every replica of
a pipeline rank has alike (schedule, pp, M, options), never from a poll of a sum's completion,
so every replica starts each reduction at the same point of the same plan: a data-parallel
collective then completes as soon as it is started, and only a wait for it could hold
anything. The model keeps those collectives (posted at their ``dp`` ops, waited at ``finalize``)
over one replica; :func:`replicated` joins replicas that differ (a test's made-up
misorder: two orders, or a start where a poll saw a sum complete, which on one hardware queue
deadlocks). A reduction is posted only after its chunk's bd sum is waited (the check names one
that is not). The parameter all-gathers of ``--overlap-param-gather`` are posted at their
``gather`` ops and waited at their ``gathered`` ops, over one replica too.

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import lowered, step_collectives
from . import program
from .actions import W, Action
from .comm import RankPlan, describe
from .layout import Layout

#: The ops that finish a chunk's weight gradients: with deferred weight gradients (zero
#: bubble) a B leaves them to its W.
DEFERRED_GRAD_OPS = ("BW", "W")
FULL_GRAD_OPS = ("B", "BW")
#: When GradReduction's stream waits for a bd sum: at the end of the schedule (now), or right
#: after issuing it (before issue 17's fix; kept to show the plan check finds that cycle).
WAIT_AT_FINISH, WAIT_AT_ISSUE = "finish", "issue"
#: The queue of every work of a rank under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (check's ``one_queue``).
ONE_QUEUE = "one hardware queue"


class IterationPlanError(RuntimeError):
    """The iteration's communication has a cycle under NCCL stream semantics."""


def grad_ops(deferring: bool) -> Tuple[str, str]:
    return DEFERRED_GRAD_OPS if deferring else FULL_GRAD_OPS


def last_grad_action_index(actions: Sequence[Action], is_fake: Callable, ops: Sequence[str]) -> Dict[int, int]:
    """{chunk: index of its last real gradient action}: where its gradients are final."""
    last = {}
    for k, a in enumerate(actions):
        if a.op in ops and not is_fake(a):
            last[a.dir] = k
    return last


def completion_order(actions: Sequence[Action], is_fake: Callable, ops: Sequence[str]) -> List[int]:
    """The chunks of a rank in the order their gradients become final (chunks without a real
    gradient action last)."""
    last = last_grad_action_index(actions, is_fake, ops)
    return sorted(last, key=last.get) + [c for c in (0, 1) if c not in last]


def bd_sum_order(actions, partner_actions, is_fake: Callable, ops, lower_rank: bool) -> List[int]:
    """This rank's chunks in the order both partners issue the sums (the partner's chunk 1-c is
    this rank's chunk c): the order in which the chunks finish when it is the same on both
    (DualPipe's symmetry), else the lower rank's, so that the pair's collectives match."""
    mine = completion_order(actions, is_fake, ops)
    theirs = [1 - c for c in completion_order(partner_actions, is_fake, ops)]
    return mine if mine == theirs or lower_rank else theirs


def bd_sum_points(actions, partner_actions, is_fake: Callable, ops, lower_rank: bool,
                  at_end: bool = False) -> List[Tuple[int, int]]:
    """[(action index, chunk)] in issue order: each chunk's sum is issued right after the action
    at that index, the later of its own last gradient action and the previous sum's point.
    ``len(actions)``: at the end of the schedule (no real gradient action; every sum with
    ``at_end``, what one hardware queue may need: :func:`plan_for`)."""
    last = {} if at_end else last_grad_action_index(actions, is_fake, ops)
    points, at = [], -1
    for c in bd_sum_order(actions, partner_actions, is_fake, ops, lower_rank):
        at = max(at, last.get(c, len(actions)))
        points.append((at, c))
    return points


def dp_start_points(layout: Layout, r: int, actions, is_fake: Callable, ops, *,
                    bd_sums: bool = True) -> List[Tuple[int, int]]:
    """[(action index, chunk)] in start order: where rank ``r`` starts each chunk's data-parallel
    reduction (``config.grad_sync_func``). Data of the plan, so the same on every data-parallel
    replica (their collectives pair up by position), never a poll. Right after the chunk's last
    real gradient action, unless its gradients still change after the schedule: then at
    ``len(actions)`` (``GradReduction.finish``, after every sum is waited and the fold): every
    chunk of a rank whose copies are summed (the bd sums, ``bd_sums``; the middle rank's local
    sum), and the end chunks of a rank holding both ends of the model (the tied-embedding fold).
    Ties in the order the chunks finish."""
    end, last = len(actions), last_grad_action_index(actions, is_fake, ops)
    chunks = range(len(layout.directions))
    stages = layout.stages_on(r)
    firsts = [c for c in chunks if layout.is_first(layout.directions[c], stages[c])]
    lasts = [c for c in chunks if layout.is_last(layout.directions[c], stages[c])]
    folded = set(firsts + lasts) if firsts and lasts else set()
    summed = layout.mirrored and (bd_sums or layout.partner(r) == r)
    at = {c: end if summed or c in folded else last.get(c, end) for c in chunks}
    return sorted(((at[c], c) for c in chunks), key=lambda p: (p[0], last.get(p[1], end), p[1]))


# ------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------

@dataclass
class Work:
    """One batch or collective of one rank on one communicator."""

    rank: int
    comm: str
    what: object  # formatted (str()) only for an error message
    sends: List[Tuple[int, int, int]] = field(default_factory=list)  # P2P: (src, dst, index on the channel)
    recvs: List[Tuple[int, int, int]] = field(default_factory=list)
    group: Tuple[int, ...] = ()     # collective: its ranks
    key: Optional[tuple] = None     # collective: what every member must call alike
    seq: int = 0                    # collective: its index on (group, comm)
    after: Optional[tuple] = None   # the key of a collective this rank must have waited before posting it


@dataclass
class Item:
    """A rank's stream item: ``compute`` (text), ``post`` or ``wait`` (a work)."""

    kind: str
    work: int = -1
    text: object = ""  # formatted (str()) only for an error message


@dataclass
class IterationPlan:
    pp: int
    works: List[Work]
    items: List[List[Item]]
    sum_points: List[List[Tuple[int, int]]]   # per rank: (action index, chunk), issue order
    #: per rank: (action index, chunk), start order of the data-parallel reductions; index
    #: len(actions): after the schedule (:func:`dp_start_points`)
    dp_points: List[List[Tuple[int, int]]] = field(default_factory=list)
    #: per rank: the program (``schedule.program.rank_program``): what the runner and the Megatron
    #: glue execute (``mcore.program_ops``) and what the items above were built from
    ops: List[Tuple[lowered.Op, ...]] = field(default_factory=list)
    #: per rank: the ``coll`` ops after the schedule and around the optimizer step
    #: (``step_collectives``), which Megatron and this package's finalize issue, not the runner
    step_ops: List[Tuple[lowered.Op, ...]] = field(default_factory=list)


class _Where:
    """'before action i (a)', formatted only for an error message."""

    def __init__(self, i: int, a: Action):
        self.i, self.a = i, a

    def __str__(self) -> str:
        return f"before action {self.i} ({self.a})"


class _Text:
    """A message formatted only when shown (the check builds thousands per plan); labels in words."""

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*(describe(x) if isinstance(x, tuple) else x for x in self.args))


class _BatchText:
    def __init__(self, r: int, where, batch):
        self.r, self.where, self.batch = r, where, batch

    def __str__(self) -> str:
        bt = self.batch
        text = "; ".join([f"send {describe(t.label)} to rank {t.peer}" for t in bt.sends]
                         + [f"receive {describe(t.label)} from rank {t.peer}" for t in bt.recvs])
        return f"rank {self.r}'s P2P batch posted {self.where} [{text}]"


class _Builder:
    def __init__(self, pp: int):
        self.pp = pp
        self.works: List[Work] = []
        self.items: List[List[Item]] = [[] for _ in range(pp)]
        self.channel: Dict[Tuple[int, int, str], int] = {}
        self.coll_seq: Dict[Tuple[str, Tuple[int, ...], int], int] = {}

    def compute(self, r: int, text: str) -> None:
        self.items[r].append(Item("compute", text=text))

    def post(self, w: Work) -> int:
        self.works.append(w)
        k = len(self.works) - 1
        self.items[w.rank].append(Item("post", k))
        return k

    def wait(self, r: int, k: int, why: str) -> None:
        self.items[r].append(Item("wait", k, why))

    def p2p(self, r: int, comm: str, what: str, sends, recvs) -> int:
        w = Work(r, comm, what)
        for dst in sends:
            w.sends.append((r, dst, self._next((r, dst, "s"))))
        for src in recvs:
            w.recvs.append((src, r, self._next((src, r, "r"))))
        return self.post(w)

    def collective(self, r: int, comm: str, group: Tuple[int, ...], key: tuple, what, after=None) -> int:
        seq = self._next_coll((comm, group, r))
        return self.post(Work(r, comm, what, group=group, key=key, seq=seq, after=after))

    def _next(self, k) -> int:
        self.channel[k] = self.channel.get(k, -1) + 1
        return self.channel[k]

    def _next_coll(self, k) -> int:
        self.coll_seq[k] = self.coll_seq.get(k, -1) + 1
        return self.coll_seq[k]


def build(layout: Layout, ranks: Sequence[Sequence[Action]], plans: Sequence[RankPlan], *, is_fake: Callable,
          deferring: bool, overlap_grad_reduce: bool = False, dp: int = 1, forward_only: bool = False,
          sum_wait: str = WAIT_AT_FINISH, param_gather: bool = False, bd_sums: bool = True,
          dp_points: Optional[Sequence[Sequence[Tuple[int, int]]]] = None, sums_at_end: bool = False,
          lowered_ops: Optional[Sequence[Sequence[lowered.Op]]] = None,
          step: Optional[step_collectives.StepOptions] = None,
          step_ops: Optional[Sequence[Sequence[lowered.Op]]] = None) -> IterationPlan:
    """Every rank's stream items for one iteration, as the executor issues them. ``param_gather``:
    ``config.param_sync_func`` is set (``mcore.param_gather``); ``bd_sums``: the copies are summed
    during the schedule (False: ``--dualpipe-shared-shard-group`` / ``--dualpipe-dp-first``);
    ``dp_points``: where each rank starts its data-parallel reductions, default
    :func:`dp_start_points` (what ``GradReduction`` reads; a test passes a misorder);
    ``lowered_ops``: each rank's ``lowered.lower`` (the executor's ``Program.ops``; default:
    lowered here); ``step``: the run's options for the collectives after the schedule
    (``step_collectives.programs``; None: none), ``step_ops`` those ops per rank instead (a test's misorder)."""
    pp = layout.pp
    b = _Builder(pp)
    ops = grad_ops(deferring)
    bd = layout.mirrored and bd_sums and not forward_only
    points = [bd_sum_points(ranks[r], ranks[layout.partner(r)], is_fake, ops, lower_rank=r < layout.partner(r),
                            at_end=sums_at_end) if bd and layout.partner(r) != r else [] for r in range(pp)]
    if dp_points is None:
        dp_points = [[] if forward_only else dp_start_points(layout, r, ranks[r], is_fake, ops, bd_sums=bd_sums)
                     for r in range(pp)]
    reduces = overlap_grad_reduce and dp > 1 and not forward_only
    rank_ops = []
    for r in range(pp):
        base = lowered_ops[r] if lowered_ops is not None else \
            lowered.lower(r, plans[r], ranks[r], [is_fake(a) for a in ranks[r]])
        ops = program.rank_program(base, layout, r, ranks[r], plans[r].units, is_fake, sum_points=points[r],
                                   dp_points=dp_points[r], param_gather=param_gather and not forward_only,
                                   forward_only=forward_only, wait_at_issue=sum_wait == WAIT_AT_ISSUE)
        _RankItems(b, layout, r, ranks[r], plans[r], sum_points=points[r], reduces=reduces).run(ops)
        rank_ops.append(ops)
    if step_ops is None:
        step_ops = step_collectives.programs(layout, step, dp=dp, overlap_grad_reduce=overlap_grad_reduce,
                                             forward_only=forward_only) if step is not None else [()] * pp
    for r, coll_ops in enumerate(step_ops):
        _step_items(b, layout, r, coll_ops)
    return IterationPlan(pp, b.works, b.items, points, [list(p) for p in dp_points], rank_ops,
                         [tuple(x) for x in step_ops])


def _step_items(b: _Builder, layout: Layout, r: int, coll_ops: Sequence[lowered.Op]) -> None:
    """Rank ``r``'s ``coll`` ops after the finalize's token all-reduce: each issued on its
    communicator and waited before the next (``step_collectives``)."""
    for n, op in enumerate(coll_ops):
        k = b.collective(r, op.group, step_collectives.members(layout, r, op.group), (op.what,),
                         _Text("rank {}'s {} over {} (op {} after the schedule)", r, op.what, op.group, n))
        b.wait(r, k, _Text("for its {} over {}", op.what, op.group))


class _RankItems:
    """One rank's items: the first all-reduce on the pipeline group, then the items of each op of
    its program (``schedule.program``), the list the runner and the Megatron glue execute."""

    def __init__(self, b: _Builder, layout: Layout, r: int, acts, rp: RankPlan, *, sum_points, reduces: bool):
        self.b, self.layout, self.r, self.acts, self.rp, self.sum_points = b, layout, r, acts, rp, sum_points
        self.reduces = reduces  # the dp ops start collectives (--overlap-grad-reduce, dp > 1)
        self.gathers: Dict[int, int] = {}
        self.sum_works: Dict[int, int] = {}
        self.sums_waited: set = set()
        self.dp_works: List[int] = []
        self.recv_batch: Dict[tuple, int] = {}
        self.send_batch: Dict[tuple, int] = {}
        self.ran = self.begun = -1  # the last unit run, begun
        self.ended = False  # past ``finish``

    def run(self, ops: Sequence[lowered.Op]) -> None:
        b, r = self.b, self.r
        k0 = b.collective(r, "pp", tuple(range(self.layout.pp)), ("first all-reduce",),
                          f"rank {r}'s first all-reduce on the pipeline group")
        b.wait(r, k0, "before the first P2P batch")
        for op in ops:
            self.item(op)

    def where(self, u: int):
        units = self.rp.units
        return _Where(units[u][0], self.acts[units[u][0]]) if 0 <= u < len(units) else "after its last action"

    def item(self, op: lowered.Op) -> None:
        """The stream items of one op of the schedule; the collectives around it in :meth:`collective`."""
        b, r, kind = self.b, self.r, op.kind
        if kind == lowered.POST:
            bt = self.rp.batches[op.index]
            k = b.p2p(r, "pp", _BatchText(r, self.where(bt.unit), bt), [t.peer for t in bt.sends],
                      [t.peer for t in bt.recvs])
            self.send_batch.update({t.label: k for t in bt.sends})
            self.recv_batch.update({t.label: k for t in bt.recvs})
        elif kind == lowered.RECV:
            b.wait(r, self.recv_batch[op.label], _Text("{}: its input, the {}", self.where(op.index), op.label))
        elif kind == lowered.RELEASE:
            b.wait(r, self.send_batch[op.label],
                   _Text("{}: the send of its forward's output, released first", self.where(op.index)))
        elif kind == lowered.RUN:
            b.compute(r, "")
            self.ran = op.index
        elif kind == lowered.BEGIN:
            self.begun = op.index
        elif kind == lowered.FINISH:
            for label, k in sorted(self.send_batch.items()):
                b.wait(r, k, _Text("at the end of the schedule: the send of the {}", label))
            self.ended = True
        else:
            self.collective(op)

    def collective(self, op: lowered.Op) -> None:
        """The stream items of a collective op: the parameter gathers, bd sums, data-parallel
        reductions, loss gather and finalize (``mcore.program_ops`` issues them)."""
        b, r, kind, c = self.b, self.r, op.kind, op.index
        if kind == lowered.GATHER:
            self.gathers[c] = b.collective(r, "dp", (r,), ("param all-gather", c),
                                           f"rank {r}'s parameter all-gathers of chunk {c}")
        elif kind == lowered.GATHERED:
            b.wait(r, self.gathers.pop(c), _Text("{}: DDP's pre-hook of its chunk's first forward",
                                                 self.where(self.begun)))
        elif kind == lowered.SUM:
            self.issue_sum(c)
        elif kind == lowered.SUMMED:
            self.wait_sum(c)
        elif kind == lowered.DP:
            self.start_dp(c)
        elif kind in (lowered.LOSS_SEND, lowered.LOSS_RECV):
            sending = kind == lowered.LOSS_SEND
            k = b.p2p(r, "pp", f"rank {r}'s loss-gather {'send to' if sending else 'receive from'} rank {op.peer}",
                      [op.peer] if sending else [], [] if sending else [op.peer])
            b.wait(r, k, "in the loss gather (host-blocking)")
        elif kind == lowered.COLL:
            k = b.collective(r, op.group, step_collectives.members(self.layout, r, op.group), (op.what,),
                             _Text("rank {}'s {} over {}", r, op.what, op.group))
            b.wait(r, k, _Text("for its {} over {}", op.what, op.group))
        elif kind == lowered.FINALIZE:
            for k in self.dp_works:
                b.wait(r, k, "in the finalize (finish_grad_sync)")
        else:
            raise IterationPlanError(f"rank {r}: the plan has no model of op {op.text()!r}")

    def at(self):
        """Where the rank is in its program, for a collective's name."""
        if self.ended:
            return "at the end of the schedule"
        i = self.rp.units[self.ran][-1]
        return _Text("after action {} ({})", i, self.acts[i])

    def issue_sum(self, c: int) -> None:
        r, stage = self.r, self.layout.stage_on(self.r, c)
        self.sum_works[c] = self.b.collective(r, "bd", tuple(sorted((r, self.layout.partner(r)))), ("bd sum", stage),
                                              _Text("rank {}'s bd sum of stage {} (issued {})", r, stage, self.at()))

    def wait_sum(self, c: int) -> None:
        stage = self.layout.stage_on(self.r, c)
        why = "after the schedule (its summed op)" if self.ended else f"right after issuing the bd sum of stage {stage}"
        self.b.wait(self.r, self.sum_works[c], why)
        self.sums_waited.add(c)

    def start_dp(self, c: int) -> None:
        """Chunk ``c``'s data-parallel reduction, over this rank's replicas (one in the plan: they
        all run it, so it completes once started); :func:`check` names one posted before the
        chunk's bd sum is waited."""
        r = self.r
        if not self.reduces:  # GradReduction marks it started: Megatron's finalize reduces
            return
        summed = ("bd sum", self.layout.stage_on(r, c)) if any(x == c for _, x in self.sum_points) else None
        self.dp_works.append(self.b.collective(
            r, "dp", (r,), ("dp reduction", c), _Text("rank {}'s data-parallel reduction of chunk {} (started {})",
                                                      r, c, self.at()), after=summed))


def check(ip: IterationPlan, one_queue: bool = False) -> None:
    """Run every rank's items under NCCL stream semantics; raise :class:`IterationPlanError`
    naming the cycle (or the mismatched collective) if they cannot all complete. ``one_queue``:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, a rank's works start in posting order whatever their
    communicator (a post waits for the rank's earlier work)."""
    works, items = ip.works, ip.items
    n = len(works)
    reached, started, completed = [False] * n, [False] * n, [False] * n
    send_of: Dict[Tuple[int, int, int], int] = {}
    recv_of: Dict[Tuple[int, int, int], int] = {}
    members: Dict[Tuple[str, Tuple[int, ...], int], Dict[int, int]] = {}
    queues: Dict[Tuple[int, str], List[int]] = {}
    for k, w in enumerate(works):
        for s in w.sends:
            send_of[s] = k
        for s in w.recvs:
            recv_of[s] = k
        if w.group:
            members.setdefault((w.comm, w.group, w.seq), {})[w.rank] = k
        queues.setdefault((w.rank, ONE_QUEUE if one_queue else w.comm), []).append(k)
    for (comm, group, seq), by_rank in members.items():
        keys = {works[k].key for k in by_rank.values()}
        if len(keys) > 1 or set(by_rank) != set(group):
            missing = [f"rank {r} issues no collective {seq} there" for r in group if r not in by_rank]
            raise IterationPlanError(f"collective {seq} on the {comm} communicator of ranks {list(group)} is not "
                                     f"the same on every rank: " + "; ".join([str(works[k].what) for k in by_rank.values()]
                                                                              + missing))
    _check_waited_first(ip)
    _check_paired(works, send_of, recv_of)
    head = {q: 0 for q in queues}
    pos = [0] * len(items)

    def peers_started(k: int) -> bool:
        w = works[k]
        if w.group:
            return all(started[j] for j in members[(w.comm, w.group, w.seq)].values())
        return all(started[recv_of[s]] for s in w.sends) and all(started[send_of[s]] for s in w.recvs)

    progress = True
    while progress:
        progress = False
        for r, its in enumerate(items):
            while pos[r] < len(its):
                it = its[pos[r]]
                if it.kind == "post":
                    reached[it.work] = True
                elif it.kind == "wait" and not completed[it.work]:
                    break
                pos[r] += 1
                progress = True
        for q, ks in queues.items():
            while head[q] < len(ks):
                k = ks[head[q]]
                if not started[k] and reached[k]:
                    started[k] = progress = True
                if started[k] and peers_started(k):
                    completed[k] = progress = True
                    head[q] += 1
                else:
                    break
    stuck = [r for r, its in enumerate(items) if pos[r] < len(its)]
    if not stuck and all(completed):
        return
    raise IterationPlanError(_explain(ip, stuck, pos, reached, started, completed, head, queues,
                                      send_of, recv_of, members))


def _check_paired(works: Sequence[Work], send_of: dict, recv_of: dict) -> None:
    """Every P2P message is both sent and received."""
    for here, there, never in ((send_of, recv_of, "received"), (recv_of, send_of, "sent")):
        for s in here:
            if s not in there:
                raise IterationPlanError(f"{works[here[s]].what}: message {s[2]} from rank {s[0]} to rank {s[1]} "
                                         f"is never {never}")


def _check_waited_first(ip: IterationPlan) -> None:
    """A work with ``after`` (a data-parallel reduction of a chunk with a bd sum) is posted after
    its rank waited for that collective: else it reduces the chunk's unsummed copy."""
    for its in ip.items:
        waited = set()
        for it in its:
            w = ip.works[it.work] if it.work >= 0 else None
            if it.kind == "wait":
                waited.add(w.key)
            elif it.kind == "post" and w.after is not None and w.after not in waited:
                raise IterationPlanError(f"{w.what} is posted before its {w.after[0]} of stage {w.after[1]} is "
                                         f"waited: it would reduce an unsummed copy")


def replicated(ips: Sequence[IterationPlan], axis: str = "dp") -> IterationPlan:
    """The plans of ``len(ips)`` replicas along ``axis`` (``dp``: data-parallel, ``tp``: tensor-
    parallel) as one (replica j's rank r is rank r + j*pp), the collectives of the communicators
    that span that axis (``step_collectives.SPANS``) over every replica's ranks: what :func:`check`
    proves of one replica holds for any number that run the same plan; a test checks replicas
    that do not (e.g. a reduction started where a poll saw a sum complete, which differs between
    them)."""
    pp, n = ips[0].pp, len(ips)
    works: List[Work] = []
    items: List[List[Item]] = []
    for j, ip in enumerate(ips):
        off, base = j * pp, len(works)
        for w in ip.works:
            spans = axis in step_collectives.SPANS[step_collectives.comm_base(w.comm)]
            group = tuple(sorted(x + i * pp for i in range(n) for x in w.group)) if spans else \
                tuple(x + off for x in w.group)
            works.append(replace(w, rank=w.rank + off, what=_Text("replica {}: {}", j, w.what), group=group,
                                 sends=[(a + off, b + off, i) for a, b, i in w.sends],
                                 recvs=[(a + off, b + off, i) for a, b, i in w.recvs]))
        items += [[replace(it, work=it.work + base if it.work >= 0 else -1) for it in its] for its in ip.items]
    return IterationPlan(pp, works, items, [p for ip in ips for p in ip.sum_points],
                         [p for ip in ips for p in ip.dp_points])


def _explain(ip, stuck, pos, reached, started, completed, head, queues, send_of, recv_of, members) -> str:
    """Follow what waits for what from a stuck rank until it comes round: the cycle."""
    works, items = ip.works, ip.items

    def step(k: int) -> Tuple[int, str]:
        w = works[k]
        if not reached[k]:
            it = items[w.rank][pos[w.rank]]
            return it.work, f"rank {w.rank}'s stream has not posted it: it waits ({it.text}) for"
        if not started[k]:
            q = (w.rank, w.comm) if (w.rank, w.comm) in queues else (w.rank, ONE_QUEUE)
            name = q[1] if q[1] == ONE_QUEUE else f"{q[1]} communicator"
            return queues[q][head[q]], f"it queues on rank {w.rank}'s {name} behind"
        if w.group:
            j = next(j for j in members[(w.comm, w.group, w.seq)].values() if not started[j])
            return j, "it needs its partner to start"
        j = next(iter([send_of[s] for s in w.recvs if not started[send_of[s]]]
                 + [recv_of[s] for s in w.sends if not started[recv_of[s]]]))
        return j, "it needs the peer's matching batch"

    r = stuck[0] if stuck else works[completed.index(False)].rank
    first = items[r][pos[r]] if stuck else None
    k = first.work if first is not None else completed.index(False)
    chain, seen = [], {}
    while k not in seen:
        seen[k] = len(chain)
        nxt, why = step(k)
        chain.append((k, why))
        k = nxt
    cycle = chain[seen[k]:]
    lines = [f"{works[a].what}: {why} ->" for a, why in cycle]
    lines.append(f"{works[cycle[0][0]].what} again")
    head_text = f"rank {r} stream waits ({first.text})" if first is not None else "a work never completes"
    return ("the iteration's communication deadlocks under NCCL stream semantics (" + head_text + "); the cycle:\n  "
            + "\n  ".join(lines))


def plan_for(spec, pp: int, real: int, padded_ranks, plans, *, zero_bubble: bool, overlap_grad_reduce: bool = False,
             dp: int = 1, forward_only: bool = False, sum_wait: str = WAIT_AT_FINISH,
             param_gather: bool = False, bd_sums: bool = True, one_queue: Optional[bool] = None,
             ops: Optional[Sequence[Sequence[lowered.Op]]] = None,
             step: Optional[step_collectives.StepOptions] = None) -> IterationPlan:
    """Build and check the iteration plan of a registry schedule ``spec`` with ``real`` real
    micro-batches (``padded_ranks``/``plans``: its padded actions and communication plan); ``step``:
    the run's options for the collectives after the schedule (:func:`build`).

    ``one_queue`` (default: :func:`one_hardware_queue`, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` on a GPU, which
    Megatron asks for with sequence parallelism and TP overlap): the check adds that rule, and where
    the bd sums issued mid-schedule would deadlock under it (a sum's kernel holding the queue while
    the partner still needs a send queued behind it: 32 of 64 DualPipe (pp <= 8, M) cases), the
    plan issues every sum at the end of the schedule instead: the same on every rank, checked again."""
    one_queue = one_hardware_queue() if one_queue is None else one_queue
    if ops is None:  # lowered once, for both plans below (the executor passes its Program.ops)
        ops = [lowered.lower(r, plans[r], padded_ranks[r], [spec.is_fake(real, a.dir, a.mb) for a in padded_ranks[r]])
               for r in range(pp)]
    deferring = zero_bubble and spec.defers_weight_grads and any(a.op == W for acts in padded_ranks for a in acts)
    layout = spec.layout(pp)

    def built(sums_at_end: bool) -> IterationPlan:
        return build(layout, padded_ranks, plans, is_fake=lambda a: spec.is_fake(real, a.dir, a.mb),
                     deferring=deferring, overlap_grad_reduce=overlap_grad_reduce, dp=dp, forward_only=forward_only,
                     sum_wait=sum_wait, param_gather=param_gather, bd_sums=bd_sums,
                     sums_at_end=sums_at_end, lowered_ops=ops,
                     step=step)

    ip = built(False)
    try:
        check(ip, one_queue=one_queue)
    except IterationPlanError:
        if not one_queue or not any(ip.sum_points):
            raise
        ip = built(True)
        check(ip, one_queue=True)
    return ip


def one_hardware_queue() -> bool:
    """Whether every stream of this process shares one hardware queue: ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    with a GPU (without one, nothing queues kernels)."""
    import os

    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
