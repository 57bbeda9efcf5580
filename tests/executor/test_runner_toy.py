"""The runner and the communication plan on plain torch modules (no megatron-core), gloo.

Each stage is a small tanh MLP; every rank holds the stages its layout gives it. The whole
pipeline is compared with a single process that runs every micro-batch through all stages
and accumulates gradients: losses and per-stage gradients must match.
"""
import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.executor.p2p import P2P, channel_groups, channels_of
from megatron_dualpipe.executor.runner import StageComputeBase, TensorSpec, run_rank
from megatron_dualpipe.executor.trace import TraceRecorder
from megatron_dualpipe.schedule import lowering
from megatron_dualpipe.schedule.actions import units
from megatron_dualpipe.schedule.lowering import OpKind
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program

from harness.workers import run_workers

H, MBS = 8, 3


def stage_module(stage):
    torch.manual_seed(100 + stage)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh())


def data(m):
    g = torch.Generator().manual_seed(7)
    return torch.randn(m, MBS, H, generator=g), torch.randn(m, MBS, H, generator=g)


def route_stages(name, pp):
    return 2 * pp if name == "dualpipev" else pp


def engine_backward(out, grad, inputs=(), keep_graph=False):
    """Backward through an output whose storage was freed after sending (as Megatron does)."""
    if grad is None:
        grad = torch.ones_like(out)
    torch.autograd.Variable._execution_engine.run_backward(
        (out,), (grad,), keep_graph, False, inputs, True, True)


class ToyCompute(StageComputeBase):
    """``padded``: which micro-batches are real (their global index); padding never reaches a compute."""

    def __init__(self, padded, rank, layout):
        self.padded, self.m, self.layout = padded, padded.real, layout
        self.mods = {}
        for d in layout.directions:
            s = layout.stage_on(rank, d)
            self.mods[(d, s)] = stage_module(s)
        self.x, self.y = data(self.m)
        self.saved, self.deferred, self.losses = {}, {}, {}
        self.unreleased, self.peak_unreleased, self.released = set(), 0, 0

    def forward(self, a, inp):
        g = self.padded.global_index(a)
        assert g is not None, f"{a}: a padding action reached the stage compute"
        mod = self.mods[(a.dir, a.stage)]
        if inp is None:
            inp = self.x[g]
        out = mod(inp)
        if self.layout.is_last(a.dir, a.stage):
            out = ((out - self.y[g]) ** 2).mean() / self.m
            self.losses[g] = out.item()
        self.saved[(a.dir, a.mb, a.stage)] = (inp, out)
        if not self.layout.is_last(a.dir, a.stage):
            self.unreleased.add(id(out))
            self.peak_unreleased = max(self.peak_unreleased, len(self.unreleased))
        return out

    def backward(self, a, grad):
        assert not self.padded.is_fake(a), f"{a}: a padding action reached the stage compute"
        inp, out = self.saved.pop((a.dir, a.mb, a.stage))
        # Megatron's custom_backward asserts the same: a sent output is released before its backward.
        assert id(out) not in self.unreleased, f"{a}: the output of its forward was not released yet"
        params = list(self.mods[(a.dir, a.stage)].parameters())
        if a.op == "BW":
            engine_backward(out, grad)
        else:  # input gradient now, weight gradient at W
            if inp.requires_grad:
                engine_backward(out, grad, inputs=(inp,), keep_graph=True)
            self.deferred[(a.dir, a.mb, a.stage)] = (out, grad, params)
        return inp.grad if inp.requires_grad else None

    def weight(self, a):
        out, grad, params = self.deferred.pop((a.dir, a.mb, a.stage))
        engine_backward(out, grad, inputs=tuple(params))

    def release(self, a, out):
        self.unreleased.discard(id(out))
        self.released += 1
        out.data = torch.empty((1,), dtype=out.dtype)


class FusedRecordingCompute(ToyCompute):
    """Records the fused units the runner hands to ``forward_backward`` (then runs the default)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.fused = []

    def forward_backward(self, f_action, b_action, input_tensor, output_grad):
        self.fused.append((f_action.to_json(), b_action.to_json()))
        return super().forward_backward(f_action, b_action, input_tensor, output_grad)


def worker(rank, world, port, name, m, forward_only, trace_dir=None, per_channel=False, real=None):
    """Run ``m`` micro-batches of ``name``, of which ``real`` (default all) are real, the rest padding."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        prog = build_program(name, world, m, real, forward_only)
        comp = FusedRecordingCompute(prog.padded, rank, prog.schedule.layout)
        groups = channel_groups(list(range(world)), channels_of(prog.plans)) if per_channel else None
        p2p = P2P(None, list(range(world)), rank, timeout_s=30, channel_groups=groups)
        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with ctx:
            stats = run_rank(prog, rank, comp, p2p, TensorSpec((MBS, H), torch.float32, torch.device("cpu")),
                             trace=TraceRecorder(trace_dir) if trace_dir else None)
        assert not comp.deferred and not comp.saved or forward_only
        grads = {f"{d}/{s}/{n}": p.grad.clone() for (d, s), mod in comp.mods.items()
                 for n, p in mod.named_parameters() if p.grad is not None}
        return {"losses": comp.losses, "grads": grads, "fused": comp.fused, "released": comp.released,
                "unreleased": len(comp.unreleased), "peak_unreleased": comp.peak_unreleased,
                "peak_in_flight": stats.peak_in_flight}
    finally:
        dist.destroy_process_group()


def reference(name, pp, m):
    stages = [stage_module(s) for s in range(route_stages(name, pp))]
    x, y = data(m)
    losses = {}
    for g in range(m):
        h = x[g]
        for mod in stages:
            h = mod(h)
        loss = ((h - y[g]) ** 2).mean() / m
        loss.backward()
        losses[g] = loss.item()
    return losses, {s: {n: p.grad for n, p in mod.named_parameters()} for s, mod in enumerate(stages)}


@pytest.mark.parametrize("name,pp,m,per_channel", [("dualpipe", 2, 4, False), ("dualpipe", 4, 10, False),
                                                   ("dualpipev", 2, 5, False), ("dualpipev", 3, 6, False),
                                                   ("1f1b", 3, 5, False), ("zb-h1", 4, 6, False),
                                                   ("dualpipe", 4, 8, True), ("dualpipev", 3, 6, True)])
def test_runner_matches_single_process(name, pp, m, per_channel):
    """per_channel: every channel on its own two-rank group (P2P(channel_groups=...))."""
    results = run_workers(worker, pp, args=(name, m, False, None, per_channel), timeout=90)
    ref_losses, ref_grads = reference(name, pp, m)
    losses = {g: v for r in results for g, v in r["losses"].items()}
    assert sorted(losses) == list(range(m))
    worst_loss = max(abs(losses[g] - ref_losses[g]) for g in range(m))
    summed = {}
    for r in results:
        for key, g in r["grads"].items():
            d, s, n = key.split("/")
            summed[(int(s), n)] = summed.get((int(s), n), 0) + torch.as_tensor(g)
    worst_grad = 0.0
    for s, named in ref_grads.items():
        for n, g in named.items():
            worst_grad = max(worst_grad, (summed[(s, n)] - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    print(f"\n{name} pp={pp} M={m}{' per channel' if per_channel else ''}: max |loss diff| {worst_loss:.2e}, "
          f"max relative grad diff {worst_grad:.2e}")
    assert worst_loss < 1e-6 and worst_grad < 1e-5


@pytest.mark.parametrize("name,pp,real", [("dualpipe", 4, 5), ("dualpipev", 3, 4)])
def test_padding_runs_as_nothing(name, pp, real):
    """A short batch padded with fake micro-batches (as training does for pp <= M < 2pp): the
    program marks the padding actions, they never reach the stage compute (it asserts so), and
    the real micro-batches' losses and gradients are those of ``real`` micro-batches alone."""
    from megatron_dualpipe.schedule import registry

    m = registry.get(name).padded_microbatches(pp, real)
    prog = build_program(name, pp, m, real)
    fakes = sum(map(sum, prog.padding))
    assert m > real and fakes > 0
    results = run_workers(worker, pp, args=(name, m, False, None, False, real), timeout=90)
    ref_losses, ref_grads = reference(name, pp, real)
    losses = {g: v for r in results for g, v in r["losses"].items()}
    assert sorted(losses) == list(range(real))
    worst_loss = max(abs(losses[g] - ref_losses[g]) for g in range(real))
    summed = {}
    for r in results:
        for key, g in r["grads"].items():
            d, s, n = key.split("/")
            summed[(int(s), n)] = summed.get((int(s), n), 0) + torch.as_tensor(g)
    worst_grad = max((summed[(s, n)] - g).abs().max().item() / (g.abs().max().item() + 1e-12)
                     for s, named in ref_grads.items() for n, g in named.items())
    print(f"\n{name} pp={pp}: {real} real micro-batches run as {m} ({fakes} padding actions): "
          f"max |loss diff| {worst_loss:.2e}, max relative grad diff {worst_grad:.2e}")
    assert worst_loss < 1e-6 and worst_grad < 1e-5


def test_forward_only_runs_every_forward():
    results = run_workers(worker, 4, args=("dualpipe", 8, True), timeout=90)
    ref_losses, _ = reference("dualpipe", 4, 8)
    losses = {g: v for r in results for g, v in r["losses"].items()}
    assert sorted(losses) == list(range(8))
    assert max(abs(losses[g] - ref_losses[g]) for g in range(8)) < 1e-6


def test_fused_units_go_through_forward_backward():
    """A compute that overrides forward_backward is called for exactly the fused F&B units
    (an overlapped F and the backward after it), in order, and for nothing else."""
    name, pp, m = "dualpipe", 4, 8
    results = run_workers(worker, pp, args=(name, m, False), timeout=90)
    acts = build_program(name, pp, m).actions
    for r, res in enumerate(results):
        want = [(acts[r][u[0]].to_json(), acts[r][u[1]].to_json()) for u in units(acts[r]) if len(u) == 2]
        print(f"\nrank {r}: {len(res['fused'])} forward_backward calls, {len(want)} fused units in the schedule")
        assert [tuple(x) for x in res["fused"]] == want
        assert want, "dualpipe pp=4 M=8 has fused units on every rank"
    ref_losses, _ = reference(name, pp, m)
    losses = {g: v for res in results for g, v in res["losses"].items()}
    assert max(abs(losses[g] - ref_losses[g]) for g in range(m)) < 1e-6


def test_sent_activations_are_released_while_the_schedule_runs():
    """Sends are not waited on the compute path, yet each sent activation's storage is released
    once its send has completed, not at the end: with 1F1B, pp=2 and M=16, rank 0 would hold
    16 sent activations if nothing were released before the end of the iteration."""
    pp, m = 2, 16
    results = run_workers(worker, pp, args=("1f1b", m, False), timeout=90)
    r0 = results[0]
    print(f"\nrank 0: {r0['released']} activations released, at most {r0['peak_unreleased']} held at once "
          f"(of {m}); at most {r0['peak_in_flight']} P2P buffers in flight")
    assert r0["released"] == m and r0["unreleased"] == 0
    assert r0["peak_unreleased"] <= m // 2


def env_trace_worker(rank, world, port, name, m, trace_dir):
    from megatron_dualpipe.executor.trace import ENV_DIR
    os.environ[ENV_DIR] = trace_dir
    return worker(rank, world, port, name, m, False)


def test_trace_recorded_from_the_environment(tmp_path):
    """MEGATRON_DUALPIPE_TRACE=DIR alone records every run_rank call: one line per rank with
    every unit's wait, start and end, in order; the run itself is unchanged."""
    import json

    name, pp, m = "dualpipev", 2, 4
    results = run_workers(env_trace_worker, pp, args=(name, m, str(tmp_path)), timeout=90)
    ref_losses, _ = reference(name, pp, m)
    losses = {g: v for res in results for g, v in res["losses"].items()}
    assert max(abs(losses[g] - ref_losses[g]) for g in range(m)) < 1e-6
    acts = build_program(name, pp, m).actions
    for r in range(pp):
        [line] = (tmp_path / f"rank{r:05d}.jsonl").read_text().splitlines()
        rec = json.loads(line)
        assert (rec["schedule"], rec["pp"], rec["microbatches"], rec["rank"]) == (name, pp, m, r)
        assert [tuple(u[0]) for u in rec["units"]] == units(acts[r])
        times = [t for u in rec["units"] for t in u[1:]]
        print(f"\nrank {r}: {len(rec['units'])} units over {times[-1] * 1e3:.1f} ms")
        assert times == sorted(times)  # waited <= started <= ended <= next unit's wait


def _megatron_modules(rank=0, world=1, port=0):
    return sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))


def test_toy_tests_never_import_megatron_core():
    """This file and its workers need torch only: megatron-core is imported nowhere (fresh process)."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # harness
    script = ("import json, test_runner_toy as t\n"
              "from harness.workers import run_workers\n"
              "print('MODULES' + json.dumps({'parent': t._megatron_modules(), "
              "'workers': run_workers(t._megatron_modules, 2)}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests, here]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MODULES")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads(lines[-1][len("MODULES"):])
    print(f"\nmegatron modules imported: test process {len(found['parent'])}, "
          f"workers {[len(w) for w in found['workers']]}")
    assert found == {"parent": [], "workers": [[], []]}


class _RecordingP2P(P2P):
    """Records what the runner asks of the P2P layer, in order, as lowered ops' text."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def post(self, sends, recvs, where):
        self.calls.append(("post", tuple(label for _, _, label, _ in sends), tuple(label for _, _, label in recvs)))
        return super().post(sends, recvs, where)

    def receive(self, label, where):
        self.calls.append(("recv", label))
        return super().receive(label, where)

    def complete_send(self, label, where):
        self.calls.append(("release", label))
        return super().complete_send(label, where)

    def finish(self, where):
        self.calls.append(("finish",))
        return super().finish(where)


class _UnitRecorder:
    def __init__(self, calls):
        self.calls = calls

    def on_unit_waiting(self, unit):
        self.calls.append(("begin", unit))

    def on_unit_start(self, unit):
        self.calls.append(("run", unit))

    def on_action_end(self, action):
        pass

    def on_unit_end(self, unit):
        pass

    def on_op(self, op):
        self.calls.append(("op", op.text()))

    def on_run_end(self):
        pass


def _whole_program(name, pp, m):
    """The program with the collectives around the schedule (--overlap-param-gather,
    --overlap-grad-reduce, dp=2): what ``mcore.forward_backward`` runs, as its plan checked it."""
    from megatron_dualpipe.schedule import iteration_plan

    options = ProgramOptions(overlap_grad_reduce=True, dp=2, param_gather=True)
    return iteration_plan.plan_for(build_program(name, pp, m, options=options), one_queue=False).program


def _recording_worker(rank, world, port, name, m):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        prog = _whole_program(name, world, m)
        comp = ToyCompute(prog.padded, rank, prog.schedule.layout)
        p2p = _RecordingP2P(None, list(range(world)), rank, timeout_s=30)
        run_rank(prog, rank, comp, p2p, TensorSpec((MBS, H), torch.float32, torch.device("cpu")),
                 listeners=(_UnitRecorder(p2p.calls),))
        return p2p.calls
    finally:
        dist.destroy_process_group()


def _expected_calls(prog, rank, ops):
    """What the rank's program says the runner does, in the recorders' terms."""

    plan, out = prog.plans[rank], []
    for op in ops:
        if op.kind == OpKind.POST:
            b = plan.batches[op.index]
            out.append(("post", tuple(t.label for t in b.sends), tuple(t.label for t in b.recvs)))
        elif op.kind in (OpKind.BEGIN, OpKind.RUN):
            out.append((op.kind.value, tuple(plan.units[op.index])))
        elif op.kind in (OpKind.RECV, OpKind.RELEASE):
            out.append((op.kind.value, op.label))
        elif op.kind in lowering.DELEGATED:
            out.append(("op", op.text()))
        else:
            out.append((op.kind.value,))
    return out


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 10), ("dualpipev", 3, 6), ("zb-h1", 3, 6)])
def test_the_runner_executes_exactly_the_lowered_ops(name, pp, m):
    """Every call the runner makes to the P2P layer and its listeners, in order, is the rank's
    program up to ``finish`` (``Program.ops``: the lowered schedule with the parameter gathers, bd
    sums and data-parallel reductions; the loss gather and finalize after it run outside the
    runner), the list the checks read; nothing in between. The collectives reach the listeners
    (``on_op``) where the list has them."""

    results = run_workers(_recording_worker, pp, args=(name, m), timeout=90)
    prog = _whole_program(name, pp, m)
    programs = prog.ops
    for rank, calls in enumerate(results):
        want = _expected_calls(prog, rank, programs[rank][:lowering.after_finish(programs[rank])])
        calls = [tuple(tuple(x) if isinstance(x, list) else x for x in c) for c in calls]
        first = next((k for k, (a, b) in enumerate(zip(calls, want)) if a != b), None)
        assert first is None and len(calls) == len(want), (rank, first, calls[first or 0], want[first or 0])
        kinds = sorted({op.kind for op in programs[rank] if op.kind in lowering.DELEGATED})
        print(f"\n{name} pp={pp} M={m} rank {rank}: {len(calls)} calls, all as the program says "
              f"(handed on: {', '.join(kinds)})")
    handed = {op.kind for ops in programs for op in ops if op.kind in lowering.DELEGATED}
    assert handed >= ({OpKind.GATHER, OpKind.GATHERED, OpKind.DP, OpKind.FINALIZE} | (
        {OpKind.SUM, OpKind.SUMMED, OpKind.LOSS_SEND, OpKind.LOSS_RECV, OpKind.COLL} if name == "dualpipe"
        else set())), handed
