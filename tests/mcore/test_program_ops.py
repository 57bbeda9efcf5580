"""mcore.program_ops: the Megatron glue issues each collective op of a rank's program, in list order.

The runner hands every op it does not run itself to ``ProgramOps.on_op`` (tests/executor/
test_runner_toy.py: its calls equal the program); here the other half: what ``ProgramOps`` calls
for each of them (``config.param_sync_func``, the gradient reduction, the loss gather, the
token-count all-reduce, Megatron's finalize), recorded with stand-ins, equals the program's
collective ops in order, for every rank of DualPipe and DualPipeV; nothing is issued that the
list does not hold.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dualpipe.mcore import program_ops
from megatron_dualpipe.schedule import iteration_plan, lowering, registry
from megatron_dualpipe.schedule.lowering import OpKind
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program


class _Reduction:
    def __init__(self, calls):
        self.calls = calls

    def after_action(self, a):
        pass

    def on_reduction(self, kind, c):
        self.calls.append(f"{kind} {c}" if c >= 0 else str(kind))  # settle has no chunk

    def complete(self):
        self.calls.append("complete")


def _stand_ins(monkeypatch, calls):
    monkeypatch.setattr(program_ops.loss_gather, "send_losses",
                        lambda entries, rank, peer, *a: calls.append(f"loss {entries[0]} -> {peer}"))
    monkeypatch.setattr(program_ops.loss_gather, "receive_losses",
                        lambda rank, peer, *a: calls.append(f"loss <- {peer}") or ["received"])
    monkeypatch.setattr(program_ops, "all_reduce_token_count", lambda tokens: calls.append("coll token-count over pp"))
    monkeypatch.setattr(program_ops, "finalize_after_token_count", lambda *a, **k: calls.append("finalize"))


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 8), ("dualpipev", 4, 9)])
def test_program_ops_issue_the_programs_collectives_in_its_order(name, pp, m, monkeypatch):
    options = ProgramOptions(overlap_grad_reduce=True, dp=2, param_gather=True)
    prog = build_program(name, pp, registry.get(name).padded_microbatches(pp, m), m, False, options)
    prog = iteration_plan.plan_for(prog, one_queue=False).program
    for r in range(pp):
        calls: list = []
        _stand_ins(monkeypatch, calls)
        model = [SimpleNamespace(parameters=lambda c=c: f"chunk {c}") for c in range(2)]
        config = SimpleNamespace(param_sync_func=[lambda params: calls.append(f"gather {params[-1]}")] * 2,
                                 finalize_model_grads_func=lambda *a, **k: None, calculate_per_token_loss=False,
                                 mtp_num_layers=None)
        it = SimpleNamespace(rank=r, program=prog, global_ranks=list(range(pp)), group=None,
                             tensor_spec=SimpleNamespace(device="cpu"))
        compute = SimpleNamespace(loss_store={0: ["dir 0"], 1: ["dir 1"]}, total_num_tokens=None)
        ops = program_ops.ProgramOps(prog.ops[r], it=it, model=model, config=config, compute=compute,
                                     reduction=_Reduction(calls), forward_only=False, force_all_reduce=False,
                                     timeout_s=5.0)
        end = lowering.after_finish(prog.ops[r])
        for op in prog.ops[r][:end]:
            if op.kind in lowering.DELEGATED:  # what the runner hands on (tests/executor/test_runner_toy.py)
                ops.on_op(op)
        losses = ops.after_schedule(prog.ops[r][end:])
        want = []
        for op in prog.ops[r]:
            if op.kind == OpKind.LOSS_SEND:
                want.append(f"loss dir {op.index} -> {op.peer}")
            elif op.kind == OpKind.LOSS_RECV:
                want.append(f"loss <- {op.peer}")
            elif op.kind in lowering.DELEGATED and op.kind != OpKind.GATHERED:  # a gathered waits in the run
                want.append(op.text())
        want.append("complete")
        print(f"{name} pp={pp} M={m} rank {r}: {calls}")
        assert calls == want, (r, calls, want)
        assert losses == ([] if r != pp - 1 else ["dir 0", "received"] if name == "dualpipe" else ["received"])


def test_an_op_no_code_issues_is_refused():
    ops = program_ops.ProgramOps((), it=SimpleNamespace(rank=0), model=[], config=SimpleNamespace(), compute=None,
                                 reduction=None, forward_only=True, force_all_reduce=False, timeout_s=1.0)
    with pytest.raises(lowering.LoweringError, match="no code issues op 'coll grad-norm over mp'"):
        ops.on_op(lowering.Op(OpKind.COLL, what="grad-norm", group="mp"))
    with pytest.raises(RuntimeError, match="in a program without gradient reduction"):
        ops.on_op(lowering.Op(OpKind.DP, 0))
