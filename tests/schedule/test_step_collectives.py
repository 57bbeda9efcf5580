"""schedule.step_collectives: the collectives after the schedule and around the optimizer step,
appended to every rank's program as ``coll KIND over GROUP`` ops and checked by the iteration plan.

Standard library only.

* The ops' text form parses back; every rank's program is printed for one case.
* With every option that adds collectives (each way of summing DualPipe's copies, fp16, the
  distributed optimizer with and without --overlap-param-gather, MoE with expert bias, quantile
  balancing, per-token loss, tied embeddings, drift check, advise, tp with sequence parallel,
  Megatron-LM's rerun state machine, --log-params-norm, training_log's MoE and MTP metrics) the
  plan of dualpipe, dualpipev and a one-chunk order has no cycle under NCCL's per-communicator
  streams and under one hardware queue, for one pipeline and for two replicas along data and
  tensor parallelism.
* Evaluation (forward only): Megatron-LM's loss sum and exit check after the program, no cycle;
  a replica without the loss sum is named.
* For each collective kind, a made-up misorder (one rank issues it and the next collective on the
  same communicator in the other order, or skips it where it is the only one there) is caught
  under both stream rules, and the error names the kind and the communicator.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_dualpipe.schedule import iteration_plan as IP
from megatron_dualpipe.schedule import lowering, registry
from megatron_dualpipe.schedule import step_collectives as SC
from megatron_dualpipe.schedule.copy_sum import BD_FIRST, DP_FIRST, SHARED_SHARD
from megatron_dualpipe.schedule.lowering import OpKind
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program

EVERYTHING = dict(tp_grads=True, moe=True, fp16=True, distributed_optimizer=True, expert_bias=True,
                  quantile_balancing=True, per_token_loss=True, tied_embeddings=True, drift_check=True, advise=True,
                  params_norm=True, mtp=True, exit_signal=True, exit_duration=True, async_save=True, timing_level=1,
                  timers_written=True, qk_logits=True,
                  moe_logged=("load_balancing_loss", "global_load_balancing_loss", "z_loss"))
#: Option sets that between them issue every kind (name -> (StepOptions, overlap-grad-reduce)).
OPTION_SETS = {
    "bd-first, fp16, MoE, no overlap": (SC.StepOptions(**EVERYTHING), False),
    "bd-first, overlap-param-gather, overlap-grad-reduce": (
        SC.StepOptions(**{**EVERYTHING, "overlap_param_gather": True}), True),
    "shared shard group": (SC.StepOptions(**{**EVERYTHING, "fp16": False, "copy_sum": SHARED_SHARD}), False),
    "dp-first": (SC.StepOptions(**{**EVERYTHING, "copy_sum": DP_FIRST}), False),
    "dp-first, overlap-grad-reduce": (SC.StepOptions(**{**EVERYTHING, "copy_sum": DP_FIRST}), True),
    "plain optimizer, fp16": (SC.StepOptions(**{**EVERYTHING, "distributed_optimizer": False}), False),
}
CASES = [("dualpipe", 4, 8), ("dualpipe", 2, 4), ("dualpipev", 4, 8), ("executor-1f1b", 4, 6)]


def _with_step_ops(prog, step_ops):
    """``prog`` with ``step_ops`` (a test's misorder) after the schedule instead of its own."""
    return prog if step_ops is None else dataclasses.replace(prog, step_ops=tuple(tuple(ops) for ops in step_ops))


def _build(name, pp, m, opts, ogr, one_queue, step_ops=None):
    """The plan (dp = 2, zero bubble) with the step collectives of ``opts`` (or ``step_ops``);
    DualPipe's bd sums at the end of the schedule on one hardware queue (``plan_for``'s choice)."""
    options = ProgramOptions(overlap_grad_reduce=ogr, dp=2, param_gather=opts.overlap_param_gather,
                             bd_sums=opts.copy_sum == BD_FIRST, sums_at_end=one_queue, step=opts)
    prog = build_program(name, pp, registry.get(name).padded_microbatches(pp, m), m, False, options)
    return IP.build(_with_step_ops(prog, step_ops))


def test_text_form_parses_back():
    for opts, ogr in OPTION_SETS.values():
        for r, ops in enumerate(SC.programs(registry.get("dualpipe").layout(4), opts, dp=2, overlap_grad_reduce=ogr)):
            text = lowering.to_text(ops)
            assert lowering.parse(text) == ops and all(op.kind == OpKind.COLL for op in ops)
    ip = _build("dualpipe", 4, 8, *OPTION_SETS["shared shard group"], False)
    for r in (0, 3):
        print(f"\ndualpipe pp=4, shared shard group, rank {r} after the schedule:\n" + lowering.to_text(ip.program.step_ops[r]))
    assert ip.program.step_ops[0] == tuple(lowering.parse(lowering.to_text(ip.program.step_ops[0])))


@pytest.mark.parametrize("name,pp,m", CASES)
@pytest.mark.parametrize("one_queue", [False, True])
def test_every_option_set_has_no_cycle_alone_and_replicated(name, pp, m, one_queue):
    counts = []
    for label, (opts, ogr) in OPTION_SETS.items():
        ip = _build(name, pp, m, opts, ogr, one_queue)
        IP.check(ip, one_queue=one_queue)
        for axis in ("dp", "tp"):
            IP.check(IP.replicated([ip, _build(name, pp, m, opts, ogr, one_queue)], axis=axis), one_queue=one_queue)
        counts.append(f"{label}: {max(len(x) for x in ip.program.step_ops)}")
        assert all(ip.program.step_ops)  # every rank has some
    print(f"\n{name} pp={pp} M={m} one queue={one_queue}: no cycle; step collectives per rank (most): {counts}")


def _kind_cases():
    """(kind, option set, schedule case): the first place each kind appears."""
    seen = {}
    for name, pp, m in CASES:
        for label, (opts, ogr) in OPTION_SETS.items():
            for ops in SC.programs(registry.get(name).layout(pp), opts, dp=2, overlap_grad_reduce=ogr):
                for kind in SC.kinds(ops):
                    seen.setdefault(kind, (label, (name, pp, m)))
    return sorted((k, label, case) for k, (label, case) in seen.items())


KIND_CASES = _kind_cases()


def test_every_kind_has_a_misorder_case():
    kinds = [k for k, _, _ in KIND_CASES]
    print(f"\n{len(kinds)} kinds: {kinds}")
    for expected in ("advice-costs", "probe-p2p", "probe-bd", "probe-dp", "router-stats", "grad-sync",
                     "expert-grad-sync", "reduce-scatter", "expert-reduce-scatter", "shard-sum", "tp-grads",
                     "embd-grads", "expert-bias", "qb-beta", "tokens-broadcast", "tokens", "found-inf", "grad-norm",
                     "zeros", "param-gather", "expert-param-gather", "update-ok", "grad-norm-max", "zeros-max", "loss",
                     "drift", "rerun", "params-norm-sharded", "params-norm-expert-sharded", "params-norm",
                     "params-norm-gtp", "params-norm-expert", "moe-log", "moe-log-reduce", "moe-log-dp", "mtp-log",
                     "async-save", "exit-signal", "exit-duration", "timer-barrier", "interval-barrier", "timers-write", "timers-log",
                     "qk-logits"):
        assert expected in kinds, expected


def _misordered(ops, kind):
    """``ops`` with the first ``kind`` swapped with the next collective on its communicator, or
    without it where none follows; and the communicator."""
    ops = list(ops)
    i = next(i for i, op in enumerate(ops) if op.what.split(":", 1)[0] == kind)
    group = ops[i].group
    j = next((j for j in range(i + 1, len(ops)) if ops[j].group == group), None)
    if j is None:
        del ops[i]
    else:
        ops[i], ops[j] = ops[j], ops[i]
    return ops, group


@pytest.mark.parametrize("kind,label,case", KIND_CASES, ids=[k for k, _, _ in KIND_CASES])
@pytest.mark.parametrize("one_queue", [False, True])
def test_a_misordered_collective_is_caught_and_named(kind, label, case, one_queue):
    """One rank issues ``kind`` out of order (or not at all). Where its communicator has other
    ranks in the pipeline (pp, bd, embd, mp, world, shard groups) the pipeline itself shows it; a
    per-stage group (tp, dp, ...) needs a second replica along the axis it spans, whose rank does
    the misorder."""
    name, pp, m = case
    opts, ogr = OPTION_SETS[label]
    planned = _build(name, pp, m, opts, ogr, one_queue)
    r = next(r for r, ops in enumerate(planned.program.step_ops) if kind in SC.kinds(ops))
    bad, group = _misordered(planned.program.step_ops[r], kind)
    step_ops = [bad if q == r else ops for q, ops in enumerate(planned.program.step_ops)]
    if len(SC.members(registry.get(name).layout(pp), r, group)) > 1:
        ip = _build(name, pp, m, opts, ogr, one_queue, step_ops=step_ops)
    else:
        axis = SC.SPANS[SC.comm_base(group)][0]
        ip = IP.replicated([planned, _build(name, pp, m, opts, ogr, one_queue, step_ops=step_ops)], axis=axis)
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(ip, one_queue=one_queue)
    msg = str(e.value)
    print(f"\n{kind} ({label}, {name} pp={pp}, rank {r}, one queue={one_queue}): {msg}")
    assert f"on the {group} communicator" in msg and "is not the same on every rank" in msg
    assert re.search(rf"'s {re.escape(kind)}(:\S+)? over {re.escape(group)} ", msg), msg


@pytest.mark.parametrize("one_queue", [False, True])
def test_two_communicators_in_opposite_orders_deadlock_and_the_cycle_is_named(one_queue):
    """Every communicator alike on its members, but rank 0 runs its drift check (bd pair with rank
    3) before Megatron-LM's success all-reduce (model parallel) and rank 3 after: each waits for
    the other's collective on a communicator the other has not reached (``iteration_plan.issued``'s one-stream rule,
    here with the waits of the iteration)."""
    opts, ogr = OPTION_SETS["bd-first, fp16, MoE, no overlap"]
    planned = _build("dualpipe", 4, 8, opts, ogr, one_queue)
    ops = list(planned.program.step_ops[0])
    i, j = SC.kinds(ops).index("update-ok"), SC.kinds(ops).index("drift")
    ops.insert(i, ops.pop(j))
    ip = _build("dualpipe", 4, 8, opts, ogr, one_queue, step_ops=[ops] + list(planned.program.step_ops[1:]))
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(ip, one_queue=one_queue)
    msg = str(e.value)
    print("\n" + msg)
    assert "deadlocks under NCCL stream semantics" in msg
    assert "rank 0's drift:0 over bd" in msg and "update-ok over mp" in msg and "again" in msg


def _evaluation_plan(name, pp, m, one_queue, step_ops=None):
    """The forward-only program as the executor builds it (the forwards alone, none fused)."""
    options = ProgramOptions(zero_bubble=False, dp=2, sums_at_end=one_queue, step=SC.StepOptions(exit_duration=True))
    prog = build_program(name, pp, registry.get(name).padded_microbatches(pp, m, True), m, True, options)
    return IP.build(_with_step_ops(prog, step_ops))


@pytest.mark.parametrize("name,pp,m", CASES)
@pytest.mark.parametrize("one_queue", [False, True])
def test_evaluation_has_no_cycle_and_a_replica_without_its_loss_sum_is_named(name, pp, m, one_queue):
    """Megatron-LM's evaluate after a forward-only call: the loss summed over dp-cp on the last
    pipeline rank, the exit check over every rank: no cycle, alone and as two data-parallel
    replicas; a replica whose last rank skips the loss sum (no loss there) is named."""
    planned = _evaluation_plan(name, pp, m, one_queue)
    print(f"\n{name} pp={pp} M={m} evaluation, rank {pp - 1} after the program: "
          + "; ".join(op.text() for op in planned.program.step_ops[pp - 1]))
    assert SC.kinds(planned.program.step_ops[pp - 1]) == ["eval-loss", "exit-duration"]
    IP.check(planned, one_queue=one_queue)
    IP.check(IP.replicated([planned, _evaluation_plan(name, pp, m, one_queue)], axis="dp"), one_queue=one_queue)
    step_ops = [ops if r < pp - 1 else tuple(op for op in ops if op.what != "eval-loss")
                for r, ops in enumerate(planned.program.step_ops)]
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(IP.replicated([planned, _evaluation_plan(name, pp, m, one_queue, step_ops)], axis="dp"),
                 one_queue=one_queue)
    print(e.value)
    assert "on the dp-cp communicator" in str(e.value) and f"rank {pp - 1}'s eval-loss over dp-cp" in str(e.value)


def test_every_kind_has_a_row_in_the_coverage_table():
    """docs/architecture.md's table of the collectives after the schedule names every kind (its
    first column), so a kind added here without its row (where, when, which test) fails."""
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    firsts = " ".join(line.split("|")[1] for line in doc.splitlines() if line.startswith("| "))
    kinds = sorted({k for k, _, _ in KIND_CASES} | {"eval-loss"})
    missing = [k for k in kinds if not re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", firsts)]
    print(f"\n{len(kinds)} kinds, without a row: {missing}")
    assert missing == []
