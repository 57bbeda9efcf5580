"""All of one iteration's communication in one plan, checked under NCCL stream semantics.

The communication plan (``comm``) proves that the P2P batches alone cannot deadlock. An
iteration communicates more: the first all-reduce on the pipeline group, DualPipe's bd sums
(the two copies of a stage summed over the bd pair, issued while the schedule runs), the
data-parallel reductions started during the schedule (``--overlap-grad-reduce``), the loss
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
waits) the way the executor issues them (``executor.runner.run_rank``,
``mcore.grad_reduction.GradReduction``, ``mcore.param_gather``, ``mcore.loss_gather``,
``mcore.finalize``), and
:func:`check` runs them to completion under those rules or raises :class:`IterationPlanError`
naming the cycle. The bd sums are issued at :attr:`IterationPlan.sum_points`, the points this
plan decides (the partners in the same order of stages) and the executor reads.

Data parallelism: every data-parallel replica runs the same plan, so each data-parallel
collective is started by all its ranks at the same point of the same plan; it completes as
soon as it is started, and only a wait for it could hold anything. The model keeps those
collectives (posted where the executor posts them, waited in the finalize), over one replica.
The parameter all-gathers of ``--overlap-param-gather`` (``param_gather``) are posted before the
first action and each waited at its chunk's first real forward (DDP's pre-hook).

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .actions import F, W, Action, units
from .comm import RankPlan, describe
from .layout import BIDIRECTIONAL, Layout

#: The ops that finish a chunk's weight gradients: with deferred weight gradients (zero
#: bubble) a B leaves them to its W.
DEFERRED_GRAD_OPS = ("BW", "W")
FULL_GRAD_OPS = ("B", "BW")
#: When GradReduction's stream waits for a bd sum: at the end of the schedule (now), or right
#: after issuing it (before issue 17's fix; kept to show the plan check finds that cycle).
WAIT_AT_FINISH, WAIT_AT_ISSUE = "finish", "issue"


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


def bd_sum_points(actions, partner_actions, is_fake: Callable, ops, lower_rank: bool) -> List[Tuple[int, int]]:
    """[(action index, chunk)] in issue order: each chunk's sum is issued right after the action
    at that index, the later of its own last gradient action and the previous sum's point.
    ``len(actions)``: at the end of the schedule (no real gradient action)."""
    last = last_grad_action_index(actions, is_fake, ops)
    points, at = [], -1
    for c in bd_sum_order(actions, partner_actions, is_fake, ops, lower_rank):
        at = max(at, last.get(c, len(actions)))
        points.append((at, c))
    return points


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

    def collective(self, r: int, comm: str, group: Tuple[int, ...], key: tuple, what: str) -> int:
        seq = self._next_coll((comm, group, r))
        return self.post(Work(r, comm, what, group=group, key=key, seq=seq))

    def _next(self, k) -> int:
        self.channel[k] = self.channel.get(k, -1) + 1
        return self.channel[k]

    def _next_coll(self, k) -> int:
        self.coll_seq[k] = self.coll_seq.get(k, -1) + 1
        return self.coll_seq[k]


def build(layout: Layout, ranks: Sequence[Sequence[Action]], plans: Sequence[RankPlan], *, is_fake: Callable,
          deferring: bool, overlap_grad_reduce: bool = False, dp: int = 1, forward_only: bool = False,
          sum_wait: str = WAIT_AT_FINISH, param_gather: bool = False) -> IterationPlan:
    """Every rank's stream items for one iteration, as the executor issues them. ``param_gather``:
    ``config.param_sync_func`` is set (``mcore.param_gather``)."""
    pp = layout.pp
    b = _Builder(pp)
    ops = grad_ops(deferring)
    bd = layout.kind == BIDIRECTIONAL and not forward_only
    all_pp = tuple(range(pp))
    points: List[List[Tuple[int, int]]] = []
    for r in range(pp):
        partner = pp - 1 - r
        pts = bd_sum_points(ranks[r], ranks[partner], is_fake, ops, lower_rank=r < partner) \
            if bd and partner != r else []
        points.append(pts)
    sum_works: List[Dict[int, int]] = [dict() for _ in range(pp)]
    dp_works: List[List[int]] = [[] for _ in range(pp)]

    def issue_sum(r: int, c: int, after: str) -> None:
        partner = pp - 1 - r
        stage = layout.stage_on(r, c)
        k = b.collective(r, "bd", tuple(sorted((r, partner))), ("bd sum", stage),
                         f"rank {r}'s bd sum of stage {stage} (issued {after})")
        sum_works[r][c] = k
        if sum_wait == WAIT_AT_ISSUE:
            b.wait(r, k, f"right after issuing the bd sum of stage {stage}")

    for r in range(pp):
        acts, rp = ranks[r], plans[r]
        k0 = b.collective(r, "pp", all_pp, ("first all-reduce",), f"rank {r}'s first all-reduce on the pipeline group")
        b.wait(r, k0, "before the first P2P batch")
        gathers = param_gathers(b, r, acts, is_fake) if param_gather and dp > 1 and not forward_only else {}
        recv_batch: Dict[tuple, int] = {}
        send_batch: Dict[tuple, int] = {}
        batch_work: List[int] = []
        bi = 0
        at_point = {}
        for i, c in points[r]:
            at_point.setdefault(i, []).append(c)

        def post_batches(upto: int, where: str) -> None:
            nonlocal bi
            while bi < len(rp.batches) and rp.batches[bi].unit <= upto:
                bt = rp.batches[bi]
                k = b.p2p(r, "pp", _BatchText(r, where, bt), [t.peer for t in bt.sends], [t.peer for t in bt.recvs])
                for t in bt.sends:
                    send_batch[t.label] = k
                for t in bt.recvs:
                    recv_batch[t.label] = k
                batch_work.append(k)
                bi += 1

        sent_output: Dict[Tuple[int, int, int], tuple] = {}
        unit_list = units(acts)
        for u, unit in enumerate(unit_list):
            where = _Where(unit[0], acts[unit[0]])
            post_batches(u, where)
            for i in unit:
                for src, label in rp.inputs[i]:
                    if src != r:
                        b.wait(r, recv_batch[label], _Text("{}: its input, the {}", where, label))
            for i in unit:
                a = acts[i]
                label = sent_output.pop((a.dir, a.mb, a.stage), None) if a.is_backward else None
                if label is not None:
                    b.wait(r, send_batch[label], _Text("{}: the send of its forward's output, released first", where))
            for i in unit:
                if acts[i].op == F and acts[i].dir in gathers:
                    b.wait(r, gathers.pop(acts[i].dir), _Text("{}: DDP's pre-hook of its chunk's first forward", where))
            b.compute(r, "")
            for i in unit:
                a = acts[i]
                if a.op == F and not is_fake(a):
                    for dst, label in rp.outputs[i]:
                        if dst != r:
                            sent_output[(a.dir, a.mb, a.stage)] = label
                for c in at_point.get(i, ()):
                    issue_sum(r, c, _Text("after action {} ({})", i, a))
        post_batches(len(unit_list), "after its last action")
        for label, k in sorted(send_batch.items()):
            b.wait(r, k, _Text("at the end of the schedule: the send of the {}", label))
        # GradReduction.finish: the sums the plan left to the end, then every sum waited.
        for i, c in points[r]:
            if c not in sum_works[r]:
                issue_sum(r, c, "at the end of the schedule")
        for c, k in sum_works[r].items():
            b.wait(r, k, "at the end of the schedule (GradReduction.finish)")
        if not forward_only and overlap_grad_reduce and dp > 1:
            for c in range(2 if layout.kind != "unidirectional" else 1):
                dp_works[r].append(b.collective(r, "dp", (r,), ("dp reduction", c),
                                                f"rank {r}'s data-parallel reduction of chunk {c}"))
    # The loss gather: each direction's final-stage owner ships its entries to rank pp-1.
    last = pp - 1
    for d in layout.directions:
        final = layout.stages(d)[-1]
        if not layout.is_last(d, final):
            continue
        owner = layout.rank_of(d, final)
        if owner == last:
            continue
        ks = b.p2p(owner, "pp", f"rank {owner}'s loss-gather send to rank {last}", [last], [])
        kr = b.p2p(last, "pp", f"rank {last}'s loss-gather receive from rank {owner}", [], [owner])
        b.wait(owner, ks, "in the loss gather (host-blocking send_object_list)")
        b.wait(last, kr, "in the loss gather")
    if not forward_only:
        for r in range(pp):
            k = b.collective(r, "pp", all_pp, ("tokens all-reduce",), f"rank {r}'s token all-reduce (finalize)")
            b.wait(r, k, "in the finalize")
            for w_k in dp_works[r]:
                b.wait(r, w_k, "in the finalize (finish_grad_sync)")
    return IterationPlan(pp, b.works, b.items, points)


def chunks_with_real_forward(acts: Sequence[Action], is_fake: Callable) -> List[int]:
    """The chunks (model indices) of a rank with a real forward, in the order of their first real
    forward: the ones whose parameter all-gathers ``mcore.param_gather`` starts, in the order it
    starts them (one NCCL communicator runs them in that order; a gather no forward waits for
    would still be in flight at the next iteration). DualPipe's second half of the ranks, and
    DualPipeV nowhere, run chunk 1 first."""
    order: List[int] = []
    for a in acts:
        if a.op == F and not is_fake(a) and a.dir not in order:
            order.append(a.dir)
    return order


def param_gathers(b: _Builder, r: int, acts: Sequence[Action], is_fake: Callable) -> Dict[int, int]:
    """The parameter all-gathers ``mcore.param_gather`` starts before the first action, in the order
    of the chunks' first forwards, on the data-parallel communicator (one replica, as the
    reductions): {chunk: work}, each waited by its chunk's first real forward."""
    return {c: b.collective(r, "dp", (r,), ("param all-gather", c), f"rank {r}'s parameter all-gathers of chunk {c}")
            for c in chunks_with_real_forward(acts, is_fake)}


def check(ip: IterationPlan) -> None:
    """Run every rank's items under NCCL stream semantics; raise :class:`IterationPlanError`
    naming the cycle (or the mismatched collective) if they cannot all complete."""
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
        queues.setdefault((w.rank, w.comm), []).append(k)
    for (comm, group, seq), by_rank in members.items():
        keys = {works[k].key for k in by_rank.values()}
        if len(keys) > 1 or set(by_rank) != set(group):
            raise IterationPlanError(f"collective {seq} on the {comm} communicator of ranks {list(group)} is not "
                                     f"the same on every rank: " + "; ".join(str(works[k].what) for k in by_rank.values()))
    for s in send_of:
        if s not in recv_of:
            raise IterationPlanError(f"{works[send_of[s]].what}: message {s[2]} from rank {s[0]} to rank {s[1]} "
                                     f"is never received")
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


def _explain(ip, stuck, pos, reached, started, completed, head, queues, send_of, recv_of, members) -> str:
    """Follow what waits for what from a stuck rank until it comes round: the cycle."""
    works, items = ip.works, ip.items

    def step(k: int) -> Tuple[int, str]:
        w = works[k]
        if not reached[k]:
            it = items[w.rank][pos[w.rank]]
            return it.work, f"rank {w.rank}'s stream has not posted it: it waits ({it.text}) for"
        if not started[k]:
            q = queues[(w.rank, w.comm)]
            return q[head[(w.rank, w.comm)]], f"it queues on rank {w.rank}'s {w.comm} communicator behind"
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
             param_gather: bool = False) -> IterationPlan:
    """Build and check the iteration plan of a registry schedule ``spec`` with ``real`` real
    micro-batches (``padded_ranks``/``plans``: its padded actions and communication plan)."""
    deferring = zero_bubble and spec.defers_weight_grads and any(a.op == W for acts in padded_ranks for a in acts)
    ip = build(spec.layout(pp), padded_ranks, plans, is_fake=lambda a: spec.is_fake(real, a.dir, a.mb),
               deferring=deferring, overlap_grad_reduce=overlap_grad_reduce, dp=dp, forward_only=forward_only,
               sum_wait=sum_wait, param_gather=param_gather)
    check(ip)
    return ip
