"""schedule.iteration_plan: a made-up misorder of each collective that is an op of the rank's own
program (``schedule.lowering``) is caught and named, under NCCL's per-communicator streams and under
one hardware queue. ``test_step_collectives`` does the same for the ``coll`` ops after the program.

Standard library only. Each test builds the real plan (dp = 2, ``--overlap-grad-reduce``,
``--overlap-param-gather``, the distributed optimizer, per-token loss) and changes one rank's
program, the list the runner and the Megatron glue execute (``Program.ops``), or
for the first all-reduce, which is no op of the program, that rank's stream items:

* the parameter all-gathers (``gather C``, over data parallel): a replica that starts them in
  another order (chunk order, the rule before the first-forward order) or skips one;
* the loss gather (``loss D -> P`` / ``<- P``, P2P to the last pipeline rank after ``finish``):
  the last rank receiving after its token count, or not at all; the sender not sending;
* the token count (``coll token-count over pp``): one rank skipping it, or issuing it after
  Megatron's broadcast of the token count (``tokens-broadcast over pp``);
* the first all-reduce on the pipeline group: one rank skipping it (the code issues it once per
  group, so a rank that took its group for already seen).
"""
from __future__ import annotations

import dataclasses

import pytest

from megatron_dualpipe.schedule import iteration_plan as IP
from megatron_dualpipe.schedule import lowering, registry
from megatron_dualpipe.schedule import step_collectives as SC
from megatron_dualpipe.schedule.lowering import OpKind
from megatron_dualpipe.schedule.lowering.collectives import TOKEN_COUNT
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program

CASES = [("dualpipe", 4, 8), ("dualpipev", 4, 8), ("executor-1f1b", 4, 6)]
TWO_CHUNKS = CASES[:2]
STEP = SC.StepOptions(distributed_optimizer=True, overlap_param_gather=True, per_token_loss=True)


def _build(case, one_queue, change=None, step_ops=None):
    """The plan of ``case`` with ``change(r, ops)`` applied to each rank's program and ``step_ops``
    instead of the program's; DualPipe's bd sums at the end of the schedule on one hardware queue
    (``plan_for``'s choice there)."""
    name, pp, m = case
    options = ProgramOptions(overlap_grad_reduce=True, dp=2, param_gather=True, sums_at_end=one_queue, step=STEP)
    prog = build_program(name, pp, registry.get(name).padded_microbatches(pp, m), m, False, options)
    if change is not None:
        prog = dataclasses.replace(prog, ops=tuple(tuple(change(r, list(ops))) for r, ops in enumerate(prog.ops)))
    if step_ops is not None:
        prog = dataclasses.replace(prog, step_ops=tuple(tuple(ops) for ops in step_ops))
    return IP.build(prog)


def _on(rank, edit):
    """A change of rank ``rank``'s program alone."""
    return lambda r, ops: edit(ops) if r == rank else ops


def _index(ops, test):
    return next(i for i, op in enumerate(ops) if test(op))


def _swapped(first, second):
    def edit(ops):
        i, j = _index(ops, first), _index(ops, second)
        ops[i], ops[j] = ops[j], ops[i]
        return ops
    return edit


def _without(test):
    def edit(ops):
        del ops[_index(ops, test)]
        return ops
    return edit


def _gathers(ops):
    return [op for op in ops if op.kind == OpKind.GATHER]


def _is_loss(op):
    return op.kind in (OpKind.LOSS_SEND, OpKind.LOSS_RECV)


def _is_token_count(op):
    return op.kind == OpKind.COLL and op.what == TOKEN_COUNT


def _caught(ip, one_queue, label):
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(ip, one_queue=one_queue)
    print(f"\n{label}, one queue={one_queue}:\n{e.value}")
    return str(e.value)


def _mismatch(msg, comm):
    assert f"on the {comm} communicator" in msg and "is not the same on every rank" in msg, msg


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("one_queue", [False, True])
def test_the_plan_unchanged_has_no_cycle(case, one_queue):
    """What the misorders below change: the plan as built, alone and as two data-parallel replicas."""
    ip = _build(case, one_queue)
    IP.check(ip, one_queue=one_queue)
    IP.check(IP.replicated([ip, _build(case, one_queue)], axis="dp"), one_queue=one_queue)
    r = case[1] - 1
    print(f"\n{case[0]} rank {r}: " + "; ".join(op.text() for op in ip.program.ops[r] if op.kind in lowering.DELEGATED))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("one_queue", [False, True])
def test_a_replica_gathering_the_parameters_in_another_order_is_named(case, one_queue):
    """The last rank of replica 1 swaps its first two chunks' all-gathers (the one-chunk schedule:
    skips its only one, and its wait); replica 0 runs the plan. The all-gathers are over data parallel, so the
    pipeline alone cannot show it: two replicas along dp do."""
    r = case[1] - 1
    planned = _build(case, one_queue)
    gathers = _gathers(planned.program.ops[r])
    if len(gathers) > 1:
        edit = _swapped(lambda op: op == gathers[0], lambda op: op == gathers[1])
    else:  # nor waits for it (DDP's pre-hook sees no handle)
        c = gathers[0].index
        edit = lambda ops: [op for op in ops if op.kind not in (OpKind.GATHER, OpKind.GATHERED) or op.index != c]
    bad = _build(case, one_queue, _on(r, edit))
    assert _gathers(bad.program.ops[r]) != gathers
    msg = _caught(IP.replicated([planned, bad], axis="dp"), one_queue, f"{case[0]}: replica 1's rank {r} gathers "
                  + ", ".join(op.text() for op in _gathers(bad.program.ops[r])) + " where the plan has "
                  + ", ".join(op.text() for op in gathers))
    _mismatch(msg, "dp")
    assert f"rank {r}'s parameter all-gathers of chunk {gathers[0].index}" in msg


@pytest.mark.parametrize("case", TWO_CHUNKS, ids=[c[0] for c in TWO_CHUNKS])
@pytest.mark.parametrize("one_queue", [False, True])
def test_the_loss_received_after_the_token_count_deadlocks_and_is_named(case, one_queue):
    """The last rank takes its loss entries after its token-count all-reduce, the sender before
    its own: each waits for the other."""
    last = case[1] - 1
    ip = _build(case, one_queue, _on(last, _swapped(_is_loss, _is_token_count)))
    msg = _caught(ip, one_queue, f"{case[0]}: rank {last} receives the loss after its token count")
    assert "deadlocks under NCCL stream semantics" in msg
    assert f"loss-gather receive from rank 0" in msg and f"rank 0's loss-gather send to rank {last}" in msg
    assert "token-count over pp" in msg and "again" in msg


@pytest.mark.parametrize("case", TWO_CHUNKS, ids=[c[0] for c in TWO_CHUNKS])
@pytest.mark.parametrize("one_queue", [False, True])
def test_a_loss_never_received_is_named(case, one_queue):
    last = case[1] - 1
    ip = _build(case, one_queue, _on(last, _without(_is_loss)))
    msg = _caught(ip, one_queue, f"{case[0]}: rank {last} does not receive the loss")
    assert f"rank 0's loss-gather send to rank {last}" in msg and "is never received" in msg


@pytest.mark.parametrize("one_queue", [False, True])
def test_a_loss_never_sent_is_named(one_queue):
    case = TWO_CHUNKS[0]
    ip = _build(case, one_queue, _on(0, _without(_is_loss)))
    msg = _caught(ip, one_queue, f"{case[0]}: rank 0 does not send the loss")
    assert f"loss-gather receive from rank 0" in msg


@pytest.mark.parametrize("case", TWO_CHUNKS, ids=[c[0] for c in TWO_CHUNKS])
@pytest.mark.parametrize("one_queue", [False, True])
def test_a_rank_without_the_token_count_is_named(case, one_queue):
    ip = _build(case, one_queue, _on(1, _without(_is_token_count)))
    msg = _caught(ip, one_queue, f"{case[0]}: rank 1 skips the token count")
    _mismatch(msg, "pp")
    # rank 1's next collective there (Megatron's broadcast, with per-token loss) takes its place
    assert "collective 1 on the pp communicator" in msg and "rank 0's token-count over pp" in msg
    assert "rank 1's tokens-broadcast over pp" in msg


@pytest.mark.parametrize("case", TWO_CHUNKS, ids=[c[0] for c in TWO_CHUNKS])
@pytest.mark.parametrize("one_queue", [False, True])
def test_the_token_count_after_megatrons_broadcast_is_named(case, one_queue):
    """Rank 1 issues the program's token count after Megatron's broadcast of it (both over the
    pipeline group), the others before."""
    planned = _build(case, one_queue)
    step_ops = [list(ops) for ops in planned.program.step_ops]
    k = SC.kinds(step_ops[1]).index("tokens-broadcast")
    step_ops[1].insert(k + 1, lowering.Op(OpKind.COLL, what=TOKEN_COUNT, group="pp"))
    ip = _build(case, one_queue, _on(1, _without(_is_token_count)), step_ops=step_ops)
    msg = _caught(ip, one_queue, f"{case[0]}: rank 1's token count after the broadcast")
    _mismatch(msg, "pp")
    assert "rank 0's token-count over pp" in msg and "rank 1's tokens-broadcast over pp" in msg


def _without_first_pp_collective(ip, r):
    """``ip`` with rank ``r``'s first collective on the pipeline group (its post and wait) left out;
    the positions of its later collectives renumbered as the plan numbers them (per rank and
    communicator, in posting order)."""
    k0 = next(it.work for it in ip.items[r] if it.kind == "post" and ip.works[it.work].comm == "pp"
              and ip.works[it.work].group)
    works = [dataclasses.replace(w) for k, w in enumerate(ip.works) if k != k0]
    items = [[dataclasses.replace(it, work=it.work - (it.work > k0) if it.work >= 0 else -1)
              for it in its if it.work != k0] for its in ip.items]
    seq = {}
    for its in items:
        for it in its:
            w = works[it.work] if it.kind == "post" else None
            if w is not None and w.group:
                w.seq = seq[(w.comm, w.group, w.rank)] = seq.get((w.comm, w.group, w.rank), -1) + 1
    return dataclasses.replace(ip, works=works, items=items)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("one_queue", [False, True])
def test_a_rank_without_the_first_all_reduce_is_named(case, one_queue):
    planned = _build(case, one_queue)
    ip = _without_first_pp_collective(planned, 1)
    assert len(ip.works) == len(planned.works) - 1
    msg = _caught(ip, one_queue, f"{case[0]}: rank 1 skips the first all-reduce")
    _mismatch(msg, "pp")
    assert "collective 0 on the pp communicator" in msg and "rank 0's first all-reduce on the pipeline group" in msg
