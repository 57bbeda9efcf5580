"""All of one iteration's communication in one plan, checked under NCCL stream semantics.

``comm`` proves the P2P batches alone cannot deadlock; an iteration also issues the first
all-reduce on the pipeline group, the bd sums, the data-parallel reductions, the parameter
gathers, the loss gather, the finalize and the step's collectives, which on a GPU interact
through the streams:

* each rank's compute stream runs its units in order;
* a P2P batch or a collective starts after the compute posted before it and after the earlier
  work on the same communicator of that rank (one NCCL stream per communicator);
* a stream wait (``Work.wait()`` on an accelerator) blocks everything after it on the stream;
* a P2P batch completes when every operation in it met its peer's started batch; a collective
  when all its ranks started it.

Data-parallel start points are data of the program, alike on every replica, so the model keeps
one replica (:func:`replicated` joins replicas that differ: a test's misorder). Standard library only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from . import step_collectives
from .comm import RankPlan, describe
from .layout import Layout
from .lowering.ops import Op, OpKind
from .lowering.program import Program, build_program

# The schedule's kinds as module names: an enum member looked up on its class costs several
# globals (Python 3.11), and the check reads some ten thousand ops per rank.
_POST, _BEGIN, _RECV, _RELEASE, _RUN, _FINISH = (OpKind.POST, OpKind.BEGIN, OpKind.RECV, OpKind.RELEASE, OpKind.RUN,
                                                 OpKind.FINISH)
#: The queue of every work of a rank under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (check's ``one_queue``).
ONE_QUEUE = "one hardware queue"


class IterationPlanError(RuntimeError):
    """The iteration's communication has a cycle under NCCL stream semantics."""


# -- The model --------------------------------------------------------------------------------

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
    """Every rank's stream items, built from ``program`` (None for :func:`replicated`'s join)."""

    pp: int
    works: List[Work]
    items: List[List[Item]]
    program: Optional[Program] = None


class _Text:
    """A message formatted only when shown (a plan builds thousands); labels in words."""

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*(describe(x) if isinstance(x, tuple) else x() if callable(x) else x for x in self.args))


def _batch_text(bt) -> str:
    return "; ".join([f"send {describe(t.label)} to rank {t.peer}" for t in bt.sends]
                     + [f"receive {describe(t.label)} from rank {t.peer}" for t in bt.recvs])


class _Builder:
    def __init__(self, pp: int):
        self.pp = pp
        self.works: List[Work] = []
        self.items: List[List[Item]] = [[] for _ in range(pp)]
        self.seq: Dict[tuple, int] = {}  # per P2P channel end and per (communicator, group, rank)

    def post(self, w: Work) -> int:
        self.works.append(w)
        k = len(self.works) - 1
        self.items[w.rank].append(Item("post", k))
        return k

    def wait(self, r: int, k: int, why: str) -> None:
        self.items[r].append(Item("wait", k, why))

    def p2p(self, r: int, comm: str, what: str, sends, recvs) -> int:
        return self.post(Work(r, comm, what, [(r, dst, self._next((r, dst, "s"))) for dst in sends],
                              [(src, r, self._next((src, r, "r"))) for src in recvs]))

    def collective(self, r: int, comm: str, group: Tuple[int, ...], key: tuple, what, after=None) -> int:
        return self.post(Work(r, comm, what, group=group, key=key, seq=self._next((comm, group, r)), after=after))

    def _next(self, k) -> int:
        self.seq[k] = self.seq.get(k, -1) + 1
        return self.seq[k]


def build(program: Program) -> IterationPlan:
    """Every rank's stream items: the first all-reduce on the pipeline group, then each op of its
    program, then its ``step_ops`` (a test builds a program with a made-up misorder)."""
    layout, opts = program.layout, program.options
    b = _Builder(layout.pp)
    reduces = opts.overlap_grad_reduce and opts.dp > 1 and not program.forward_only
    for r in range(layout.pp):
        ops = program.ops[r] + (program.step_ops[r] if program.step_ops else ())
        _RankItems(b, layout, r, program.actions[r], program.plans[r], reduces=reduces).run(ops)
    return IterationPlan(layout.pp, b.works, b.items, program)


class _RankItems:
    """One rank's items, op by op."""

    def __init__(self, b: _Builder, layout: Layout, r: int, acts, rp: RankPlan, *, reduces: bool):
        self.b, self.layout, self.r, self.acts, self.rp = b, layout, r, acts, rp
        self.reduces = reduces  # the dp ops start collectives (--overlap-grad-reduce, dp > 1)
        self.gathers: Dict[int, int] = {}
        self.sum_works: Dict[int, int] = {}
        self.summed_chunks: set = set()  # the chunks with a bd sum in the program
        self.dp_works: List[int] = []
        self.recv_batch: Dict[tuple, int] = {}
        self.send_batch: Dict[tuple, int] = {}
        self.ran = self.begun = -1  # the last unit run, begun
        self.ended = False  # past ``finish``

    def run(self, ops: Sequence[Op]) -> None:
        b, r = self.b, self.r
        k0 = b.collective(r, "pp", tuple(range(self.layout.pp)), ("first all-reduce",),
                          f"rank {r}'s first all-reduce on the pipeline group")
        b.wait(r, k0, "before the first P2P batch")
        self.summed_chunks = {op.index for op in ops if op.kind is OpKind.SUM}
        for op in ops:
            self.item(op)

    def where(self, u: int):
        units = self.rp.units
        return _Text("before action {} ({})", units[u][0], self.acts[units[u][0]]) if 0 <= u < len(units) \
            else "after its last action"

    def item(self, op: Op) -> None:
        """The stream items of one op of the schedule; the collectives around it in :meth:`collective`."""
        b, r, kind = self.b, self.r, op.kind
        if kind is _POST:
            bt = self.rp.batches[op.index]
            what = _Text("rank {}'s P2P batch posted {} [{}]", r, self.where(bt.unit), lambda: _batch_text(bt))
            k = b.p2p(r, "pp", what, [t.peer for t in bt.sends], [t.peer for t in bt.recvs])
            self.send_batch.update({t.label: k for t in bt.sends})
            self.recv_batch.update({t.label: k for t in bt.recvs})
        elif kind is _RECV:
            b.wait(r, self.recv_batch[op.label], _Text("{}: its input, the {}", self.where(op.index), op.label))
        elif kind is _RELEASE:
            b.wait(r, self.send_batch[op.label],
                   _Text("{}: the send of its forward's output, released first", self.where(op.index)))
        elif kind is _RUN:
            b.items[r].append(Item("compute"))
            self.ran = op.index
        elif kind is _BEGIN:
            self.begun = op.index
        elif kind is _FINISH:
            for label, k in sorted(self.send_batch.items()):
                b.wait(r, k, _Text("at the end of the schedule: the send of the {}", label))
            self.ended = True
        else:
            self.collective(op)

    def collective(self, op: Op) -> None:
        """The stream items of a collective op (``mcore.program_ops`` issues them)."""
        b, r, kind, c = self.b, self.r, op.kind, op.index
        # final, settle: compute on the rank's stream (the drain's TP gathers: its tp group); dp without
        # reduces (no --overlap-grad-reduce or dp 1): GradReduction marks it started, Megatron's finalize reduces
        if kind in (OpKind.FINAL, OpKind.SETTLE) or (kind == OpKind.DP and not self.reduces):
            return
        if kind == OpKind.GATHER:
            self.gathers[c] = b.collective(r, "dp", (r,), ("param all-gather", c),
                                           f"rank {r}'s parameter all-gathers of chunk {c}")
        elif kind == OpKind.GATHERED:
            b.wait(r, self.gathers.pop(c), _Text("{}: DDP's pre-hook of its chunk's first forward",
                                                 self.where(self.begun)))
        elif kind == OpKind.SUM:
            stage = self.layout.stage_on(r, c)
            self.sum_works[c] = b.collective(r, "bd", tuple(sorted((r, self.layout.partner(r)))), ("bd sum", stage),
                                             _Text("rank {}'s bd sum of stage {} (issued {})", r, stage, self.at()))
        elif kind == OpKind.SUMMED:
            why = "after the schedule (its summed op)" if self.ended else \
                f"right after issuing the bd sum of stage {self.layout.stage_on(r, c)}"
            b.wait(r, self.sum_works[c], why)
        elif kind == OpKind.DP:  # one replica: it completes once started, after its chunk's bd sum
            summed = ("bd sum", self.layout.stage_on(r, c)) if c in self.summed_chunks else None
            self.dp_works.append(b.collective(r, "dp", (r,), ("dp reduction", c), _Text(
                "rank {}'s data-parallel reduction of chunk {} (started {})", r, c, self.at()), after=summed))
        elif kind in (OpKind.LOSS_SEND, OpKind.LOSS_RECV):
            sending = kind == OpKind.LOSS_SEND
            k = b.p2p(r, "pp", f"rank {r}'s loss-gather {'send to' if sending else 'receive from'} rank {op.peer}",
                      [op.peer] if sending else [], [] if sending else [op.peer])
            b.wait(r, k, "in the loss gather (host-blocking)")
        elif kind == OpKind.COLL:
            k = b.collective(r, op.group, step_collectives.members(self.layout, r, op.group), (op.what,),
                             _Text("rank {}'s {} over {} ({})", r, op.what, op.group, self.at()))
            b.wait(r, k, _Text("for its {} over {}", op.what, op.group))
        elif kind == OpKind.FINALIZE:
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


@dataclass(frozen=True)
class Collective:
    """A collective issued outside a program: its ranks and what every member issues alike (``key``)."""

    group: Tuple[int, ...]
    key: Hashable

    def __str__(self) -> str:
        return f"{self.key} over ranks {list(self.group)}"


def issued(collectives: Mapping[int, Sequence[Collective]],
           communicator: Callable[[Collective], Hashable] = lambda c: c.group) -> IterationPlan:
    """The plan of what each global rank issued, in order, none waited: :func:`check` with
    ``one_queue`` proves every member issues the same sequence on each communicator (default: one
    per group) and each rank's list runs as one stream (two communicators over the same ranks
    issued in opposite orders deadlock)."""
    b = _Builder(max(collectives, default=-1) + 1)
    for r, cs in sorted(collectives.items()):
        for c in cs:
            b.collective(r, f"ranks {communicator(c)}", tuple(sorted(c.group)), (c.key,), _Text("rank {}'s {}", r, c))
    return IterationPlan(b.pp, b.works, b.items)


def check(ip: IterationPlan, one_queue: bool = False) -> None:
    """Run every rank's items under NCCL stream semantics, or raise :class:`IterationPlanError`
    naming the cycle or the mismatched collective. ``one_queue``: a rank's works start in posting
    order whatever their communicator."""
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
            missing = [f"rank {r} issues no collective {seq} there" for r in group if r not in by_rank] + \
                [f"rank {r} is not one of its ranks" for r in by_rank if r not in group]
            raise IterationPlanError(f"collective {seq} on the {comm} communicator of ranks {list(group)} is not the "
                                     f"same on every rank: " + "; ".join([str(works[k].what) for k in by_rank.values()]
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
    """A data-parallel reduction of a summed chunk is posted after its sum is waited, else it
    reduces an unsummed copy."""
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
    """The plans of replicas along ``axis`` (``dp`` or ``tp``) as one (replica j's rank r is rank
    r + j*pp), the communicators spanning that axis (``step_collectives.SPANS``) over every
    replica's ranks: for tests of replicas whose plans differ."""
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
    return IterationPlan(pp, works, items)


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


def plan_for(program: Program, one_queue: Optional[bool] = None) -> IterationPlan:
    """Build and check ``program``'s iteration plan; its ``program`` is what runs. Under
    ``one_queue`` (default :func:`one_hardware_queue`) bd sums issued mid-schedule can deadlock (a
    sum's kernel holds the queue while the partner needs a send queued behind it: 32 of 64
    DualPipe (pp <= 8, M) cases); there every sum moves to the end (``sums_at_end``), checked again."""
    one_queue = one_hardware_queue() if one_queue is None else one_queue
    ip = build(program)
    try:
        check(ip, one_queue=one_queue)
    except IterationPlanError:
        if not one_queue or not any(program.sum_points):
            raise
        s, options = program.schedule, replace(program.options, sums_at_end=True)
        ip = build(build_program(s.name, s.pp, s.microbatches, program.padded.real, program.forward_only, options))
        check(ip, one_queue=True)
    return ip


def one_hardware_queue() -> bool:
    """Whether every stream of this process shares one hardware queue: ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    with a GPU (without one, nothing queues kernels)."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
