"""The program: one rank's iteration as one list of ops (``schedule.lowering``).

Its text form parses back to the same ops, for every schedule the executor runs, padded or not;
and the list keeps the rules the runner relies on, checked here op by op against the plan: every
batch posted once and in order, each remote input received once, after the post that holds its
receive and before the run of its unit; each real forward's sent output released once, after its
send was posted and before its backward runs; ``finish`` last.
"""
import dataclasses

import pytest

from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program
from megatron_dualpipe.schedule import lowering, registry
from megatron_dualpipe.schedule.lowering import OpKind

pytestmark = pytest.mark.schedule

CASES = [("dualpipe", 4, 8, None), ("dualpipe", 4, 5, 5), ("dualpipev", 3, 6, None), ("dualpipev", 4, 4, 4),
         ("1f1b", 3, 5, None), ("zb-h1", 4, 6, None), ("dualpipe", 8, 20, None), ("dualpipev", 2, 7, 7)]


def _program(name, pp, m, real):
    padded_m = registry.get(name).padded_microbatches(pp, real) if real is not None else m
    return build_program(name, pp, padded_m, real)


@pytest.mark.parametrize("name,pp,m,real", CASES)
def test_text_form_parses_back(name, pp, m, real):
    prog = _program(name, pp, m, real)
    for r in range(pp):
        text = lowering.to_text(prog.ops[r], prog.actions[r], prog.plans[r])
        assert lowering.parse(text) == prog.ops[r], (r, text[:400])
    print(f"\n{name} pp={pp} M={m}: rank 0's first ops:\n" + "".join(text.splitlines(True)[:8]))


def _check_rank(prog, r):
    """Raise AssertionError naming the first op that breaks a rule the runner relies on."""
    plan, acts, ops = prog.plans[r], prog.actions[r], prog.ops[r][:lowering.after_finish(prog.ops[r])]
    posted, receivable, releasable, received, released, ran = [], set(), {}, set(), set(), 0
    for n, op in enumerate(ops):
        where = f"rank {r} op {n} ({op.text()})"
        if op.kind == OpKind.POST:
            assert op.index == len(posted), where
            posted.append(op.index)
            batch = plan.batches[op.index]
            receivable |= {(t.peer, t.label) for t in batch.recvs}
            releasable.update({t.label: t.peer for t in batch.sends})
        elif op.kind == OpKind.RECV:
            assert (op.peer, op.label) in receivable and (op.peer, op.label) not in received, where
            received.add((op.peer, op.label))
        elif op.kind == OpKind.RELEASE:
            assert releasable.get(op.label) == op.peer and op.label not in released, where
            released.add(op.label)
            # the unit runs the backward of the forward that sent it (the label names the next stage)
            kind, d, mb, stage = op.label
            assert kind == "act" and any(acts[i].is_backward and (acts[i].dir, acts[i].mb, acts[i].stage) ==
                                         (d, mb, stage - 1) for i in plan.units[op.index]), where
        elif op.kind == OpKind.RUN:
            assert op.index == ran, where
            for i in plan.units[op.index]:
                for src, label in plan.inputs[i]:
                    assert src == r or (src, label) in received, f"{where}: {label} from {src} not received"
            ran += 1
    assert ops[-1].kind == OpKind.FINISH and ran == len(plan.units), ops[-3:]
    assert posted == list(range(len(plan.batches))), posted
    remote = {(src, label) for ins in plan.inputs for src, label in ins if src != r}
    assert received == remote, remote ^ received
    real_sent = {label for i, a in enumerate(acts) if a.op == "F" and not prog.padding[r][i]
                 for dst, label in plan.outputs[i] if dst != r}
    assert released == real_sent, real_sent ^ released
    return len(ops), len(received), len(released)


@pytest.mark.parametrize("name,pp,m,real", CASES)
def test_the_ops_keep_the_runners_rules(name, pp, m, real):
    prog = _program(name, pp, m, real)
    counts = [_check_rank(prog, r) for r in range(pp)]
    print(f"\n{name} pp={pp} M={m}: per rank (ops, receives, releases): {counts}")


def test_a_receive_before_its_post_is_caught():
    """The check above can fail: a receive moved before the post that holds it is named."""
    prog = _program("dualpipe", 4, 8, None)
    ops = list(prog.ops[1])
    k = next(n for n, op in enumerate(ops) if op.kind == OpKind.RECV)
    post = max(n for n in range(k) if ops[n].kind == OpKind.POST)
    ops.insert(post, ops.pop(k))
    broken = dataclasses.replace(prog, ops=tuple(tuple(ops) if r == 1 else prog.ops[r] for r in range(4)))
    with pytest.raises(AssertionError, match="rank 1 op"):
        _check_rank(broken, 1)


@pytest.mark.parametrize("text", ["post", "recv act:0:1 <- 2", "release act:0:1:2 <- 1", "run x", "finish 3", "jump 1"])
def test_a_line_that_is_not_an_op_is_refused(text):
    with pytest.raises(lowering.LoweringError, match="line 1"):
        lowering.parse(text)


def _plan(name, pp, m, **kw):
    from megatron_dualpipe.schedule import iteration_plan as IP

    padded = registry.get(name).padded_microbatches(pp, m)  # where the schedule needs more micro-batches
    ip = IP.plan_for(build_program(name, pp, padded, m, options=ProgramOptions(overlap_grad_reduce=True, dp=2, **kw)),
                     one_queue=False)
    return ip.program


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 8), ("dualpipev", 4, 9), ("zb-h1", 4, 8)])
def test_the_plans_sums_and_reductions_are_ops_of_the_same_list(name, pp, m):
    """The iteration plan's bd sums and data-parallel reductions (--overlap-grad-reduce, dp=2) are
    ``sum`` / ``dp`` ops right after the ``run`` of the unit holding their point's action, in the
    plan's order, or after ``finish`` for the points at the end of the schedule. The list with
    them parses back, and the plan's stream items were built from it."""
    prog = _plan(name, pp, m)
    counts = []
    for r in range(pp):
        ops = prog.ops[r]
        assert lowering.parse(lowering.to_text(ops)) == ops
        units, n = prog.plans[r].units, len(prog.actions[r])
        found, ran = [], -1
        for op in ops:
            if op.kind == OpKind.RUN:
                ran = op.index
            elif op.kind == OpKind.FINISH:
                ran = len(units)
            elif op.kind in (OpKind.SUM, OpKind.DP):
                found.append((op.kind, op.index, ran))
        want = [(kind, c, len(units) if i >= n else next(k for k, u in enumerate(units) if i in u))
                for kind, points in ((OpKind.SUM, prog.sum_points[r]), (OpKind.DP, prog.dp_points[r]))
                for i, c in points]
        assert sorted(found) == sorted(want), (r, found, want)
        for kind, points in ((OpKind.SUM, prog.sum_points[r]), (OpKind.DP, prog.dp_points[r])):
            assert [c for k, c, _ in found if k == kind] == [c for _, c in points], (r, kind, found)  # plan's order
        counts.append(sum(1 for _, _, u in found if u < len(units)))
    print(f"\n{name} pp={pp} M={m}: sum/dp ops inside the schedule per rank {counts}, the rest after finish")


def _check_collectives(prog, r, name, m):
    """Raise AssertionError naming the first collective op out of the place the plan gives."""
    spec, ops, acts, units = registry.get(name), prog.ops[r], prog.actions[r], prog.plans[r].units
    first = {}
    for u, unit in enumerate(units):
        for i in unit:
            if acts[i].op == "F" and not spec.is_fake(m, acts[i].dir, acts[i].mb):
                first.setdefault(acts[i].dir, u)
    gathered, issued, waited, started, finished = [], [], [], [], False
    for n, op in enumerate(ops):
        where = f"rank {r} op {n} ({op.text()})"
        if op.kind == OpKind.GATHER:
            assert all(x.kind == OpKind.GATHER for x in ops[:n]), where  # before anything else
        elif op.kind == OpKind.GATHERED:
            assert ops[n + 1] == lowering.Op(OpKind.RUN, first[op.index]) and op.index not in gathered, where
            gathered.append(op.index)
        elif op.kind == OpKind.SUM:
            issued.append(op.index)
        elif op.kind == OpKind.SUMMED:
            assert op.index in issued and op.index not in waited, where
            waited.append(op.index)
        elif op.kind == OpKind.DP:
            summed = any(c == op.index for _, c in prog.sum_points[r])
            assert not summed or op.index in waited, where  # a reduction of the summed copy
            started.append(op.index)
        elif op.kind == OpKind.FINISH:
            finished = True
        elif op.kind in (OpKind.LOSS_SEND, OpKind.LOSS_RECV, OpKind.COLL, OpKind.FINALIZE):
            assert finished, where
    assert [op.index for op in ops if op.kind == OpKind.GATHER] == sorted(first, key=first.get), ops[:3]
    assert sorted(gathered) == sorted(first) and sorted(waited) == sorted(issued) and ops[-1].kind == OpKind.FINALIZE
    assert sorted(started) == list(range(len(prog.schedule.layout.directions)))
    return [op.text() for op in ops if op.kind not in (OpKind.POST, OpKind.BEGIN, OpKind.RECV, OpKind.RELEASE,
                                                      OpKind.RUN)]


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 8), ("dualpipe", 2, 5), ("dualpipev", 4, 9), ("zb-h1", 4, 8),
                                       ("executor-1f1b", 3, 5)])
def test_the_collectives_around_the_schedule_are_ops_at_their_places(name, pp, m):
    """--overlap-param-gather, --overlap-grad-reduce, dp=2: each chunk's ``gather`` before anything
    else, in the order of the chunks' first real forwards, its ``gathered`` right before that
    forward's ``run``; every ``sum`` waited once (``summed``) after it is issued, before its chunk's
    ``dp``; every chunk's ``dp`` once; the loss gather and the finalize after ``finish``,
    ``finalize`` last. The whole program parses back."""
    prog = _plan(name, pp, m, param_gather=True)
    for r in range(pp):
        assert lowering.parse(lowering.to_text(prog.ops[r])) == prog.ops[r]
        shown = _check_collectives(prog, r, name, m)
        print(f"{name} pp={pp} M={m} rank {r}: {', '.join(shown)}")


def test_a_sum_waited_before_it_is_issued_is_caught():
    """The check above can fail: a ``summed`` moved before its ``sum`` is named."""
    prog = _plan("dualpipe", 4, 8, param_gather=True)
    ops = list(prog.ops[1])
    k = next(n for n, op in enumerate(ops) if op.kind == OpKind.SUMMED)
    s = next(n for n, op in enumerate(ops) if op == lowering.Op(OpKind.SUM, ops[k].index))
    ops.insert(s, ops.pop(k))
    broken = dataclasses.replace(prog, ops=prog.ops[:1] + (tuple(ops),) + prog.ops[2:])
    with pytest.raises(AssertionError, match="rank 1 op"):
        _check_collectives(broken, 1, "dualpipe", 8)
