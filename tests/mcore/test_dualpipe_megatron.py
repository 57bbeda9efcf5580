"""DualPipe and DualPipeV on real megatron-core GPTModels equal a single-process reference.

The reference (`_reference_worker`) is one process running the whole pp=1 GPTModel over every
micro-batch with a plain loop: loss_k / M, backward. It records each micro-batch's loss and its
unscaled gradient g_k, so the expected gradient for any M is (1/M) sum_{k<M} g_k.

The pipeline workers load the same weights into model[0] of every rank, broadcast them to the
mirrors, run `forward_backward_dualpipe` for several M (padding with fake micro-batches where
M < 2*pp or M is odd), and return every chunk's gradients after the bd all-reduce, keyed by the
full model's parameter names, plus the loss dicts the last rank returns. Every number is
printed; the tolerance is 1e-5 relative to the largest reference value (fp32).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models, names, reference
from megatron_dualpipe.proof.compare import Gap
from megatron_dualpipe.proof.data import forward_step, masked_loss_func

# The oldest tier (-m smoke, megatron-core 0.16.1) runs the cases marked smoke below: dualpipe (tied)
# and dualpipev at pp=2 against the single-process reference. The rest of megatron-core 0.16.1 is
# what that tier's pretrain_gpt.py runs (Megatron-LM core_v0.16.1 carries it) and Bridge's pretrain()
# run on; the newest tier runs every case.
#: Marks a case for the oldest tier.
SMOKE = pytest.mark.smoke
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")]

LAYERS = 8
RTOL = 1e-5

#: MoE with SequentialMLP experts, megatron-core's allgather dispatcher and the aux loss on.
MOE = (("num_moe_experts", 4), ("moe_router_load_balancing_type", "aux_loss"), ("moe_aux_loss_coeff", 1e-2))


def spec(tied: bool = False, moe: bool = False, users: bool = False) -> models.ModelSpec:
    """The tiny GPT of these tests (and of the tests that import this module); ``users``: with the
    architecture users train (RoPE, SwiGLU, RMSNorm, untied: ``models.users_architecture``)."""
    base = models.ModelSpec(layers=LAYERS, tied=tied, config=MOE if moe else ())
    return models.users_architecture(base) if users else base


SEQ, MBS = spec().seq, spec().mbs


def _reference_worker(rank, world, port, tied, n, seed=7, moe=False, users=False):
    """With MoE the router's aux loss backpropagates with megatron's global scale, left at 1
    here: gradient k is unscaled like the main loss, and the expected mean divides both by M."""
    me.init_distributed_cpu(rank, world, port)
    try:
        model = models.provider(spec(tied, moe, users))()
        if users:  # rotary positions replace the learned ones (else both sides would skip them alike)
            assert model.position_embedding_type == "rope" and model.rotary_pos_emb is not None, model
            assert not hasattr(model.embedding, "position_embeddings"), model.embedding
        state = reference.weights(model)
        losses, per_mb = reference.per_microbatch(model, spec().batches(n, seed))
        return state, losses, per_mb
    finally:
        me.destroy_distributed()


def _pipeline_worker(rank, world, port, schedule, tied, full_state, runs, dp=1, moe=False, overlap=False,
                     param_gather=False, users=False):
    """`runs`: list of (M, zero_bubble, forward_only[, schedule[, param_sync_func]]). Returns per run:
    losses, grads (and with ``param_gather`` what `_ParamGatherProbe` saw).

    A run may name another schedule: ``1f1b`` / ``zb-h1`` run model[0] alone through the same
    executor. With ``dp`` > 1 the chunks are wrapped in megatron-core DDP and finalized by
    megatron-core's ``finalize_model_grads``; data-parallel replica j reads batches seeded 7+j.
    ``param_gather``: the distributed optimizer's DDP with overlapped, aligned parameter gathers,
    every shard this replica does not own NaN before each run; a run's ``param_sync_func`` (default
    True) says whether the executor is handed Megatron-LM's ``config.param_sync_func``."""
    from megatron.core import parallel_state as ps
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    pp = world // dp
    me.init_distributed_cpu(rank, world, port, pp=pp)
    try:
        build_bd_groups()
        layout = "v" if schedule == "dualpipev" else "bidirectional"
        model = build_two_direction_model(models.provider(spec(tied, moe, users), layout == "v"), layout_kind=layout)
        full = {k: torch.from_numpy(v) for k, v in full_state.items()}
        if layout == "v":  # two different stages per rank: load both
            names.load_stage_from_full(model[0], full)
            names.load_stage_from_full(model[1], full)
        else:  # load one copy; the broadcast gives the mirror its partner's weights
            names.load_stage_from_full(model[0], full)
            broadcast_mirrors(model)
        if dp > 1:
            model = _wrap_ddp(model, overlap, param_gather, bucket_first=layout == "v")
        else:
            for chunk in model:
                chunk.config.finalize_model_grads_func = lambda *a, **k: None  # plain modules: no DDP
        probe = _ParamGatherProbe(model) if param_gather else None
        dp_rank = ps.get_data_parallel_rank()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        results = []
        for run in runs:
            m, zero_bubble, forward_only = run[:3]
            name = run[3] if len(run) > 3 else schedule
            chunks = model if name in ("dualpipe", "dualpipev") else model[:1]
            for chunk in model:
                chunk.zero_grad_buffer() if dp > 1 else chunk.zero_grad()
            if probe is not None:
                probe.start_run(chunks, handed=run[4] if len(run) > 4 else True)
            source = iter(spec().batches(m, seed=7 + dp_rank))
            ctx = torch.no_grad() if forward_only else torch.enable_grad()
            with ctx:
                out = forward_backward_dualpipe(
                    forward_step_func=forward_step, data_iterator=source, model=chunks, num_microbatches=m,
                    seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only, schedule=name,
                    zero_bubble=zero_bubble, p2p_timeout=60)
            losses = [d["lm loss"].item() for d in out] if pp_rank == pp - 1 else None
            leftover = sum(1 for _ in source)  # what the schedule did not read
            if probe is not None and not forward_only:
                _gather_grad_shards(chunks)
            grads = [names.by_full_name(c, full, names.grad_of) for c in chunks] if not forward_only else None
            results.append({"losses": losses, "grads": grads, "unread": leftover, "dp": dp_rank, "pp": pp_rank,
                            "gathers": probe.seen() if probe is not None else None})
        return results
    finally:
        me.destroy_distributed()


def _wrap_ddp(model, overlap=False, param_gather=False, bucket_first=False):
    """Megatron DDP per chunk, finalized by megatron-core's finalize_model_grads; with ``overlap``
    as Megatron-LM's train() sets it up for --overlap-grad-reduce (no_sync_func, grad_sync_func),
    every chunk unbucketed as its get_model does under DualPipe. ``param_gather``: the distributed
    optimizer's buffers with --overlap-param-gather (aligned); ``bucket_first``: chunk 0 in small
    buckets, several all-gathers (DualPipeV: its get_model buckets chunk 0)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    gather = dict(use_distributed_optimizer=True, overlap_param_gather=True, align_param_gather=True,
                  bucket_size=20000) if param_gather else dict(use_distributed_optimizer=False)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, **gather)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=overlap and not (
        bucket_first and c == 0)) for c, chunk in enumerate(model)]
    for chunk in wrapped:
        chunk.config.finalize_model_grads_func = finalize_model_grads
        if overlap:
            chunk.config.no_sync_func = [c.no_sync for c in wrapped]
            chunk.config.grad_sync_func = [c.start_grad_sync for c in wrapped]
    return wrapped


class _ParamGatherProbe:
    """What the parameter all-gathers did in each run: ``config.param_sync_func`` as Megatron-LM's
    train() sets it (every chunk's ``start_param_sync``), recording each call, and a forward pre-hook
    ahead of DDP's on every chunk, recording whether all its bucket groups' gathers were already
    started at the chunk's first forward. Before each run every shard this replica does not own is
    NaN, as the other replicas' updated shards are stale after a distributed optimizer step: only
    the gathers restore them."""

    def __init__(self, wrapped):
        self.wrapped, self.events = wrapped, []
        for c, chunk in enumerate(wrapped):
            chunk.module.register_forward_pre_hook(self._at_forward(c), prepend=True)
        self.funcs = [self._sync(c) for c in range(len(wrapped))]

    def _sync(self, c):
        def sync(*args, **kwargs):
            self.events.append(("sync", c))
            return self.wrapped[c].start_param_sync(*args, **kwargs)

        return sync

    def _at_forward(self, c):
        def hook(module, *unused):
            self.events.append(("forward", c, all(g.param_gather_dispatched for g in self.wrapped[c].bucket_groups)))

        return hook

    def start_run(self, chunks, handed: bool) -> None:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self.events = []
        chunks[0].config.param_sync_func = self.funcs[:len(chunks)] if handed else None
        for chunk in self.wrapped:
            for group in chunk.bucket_groups:
                for bucket in group.buckets:
                    shards = shard_buffer(bucket.param_data, group.intra_distributed_optimizer_instance_size)
                    for i, shard in enumerate(shards):
                        if i != group.intra_distributed_optimizer_instance_rank:
                            shard.fill_(float("nan"))

    def seen(self):
        """({chunk: (calls of its sync function before its first forward, in the run, whether its
        gathers were started at that forward)} for every chunk that ran a forward, the chunks in the
        order their sync functions were called, the chunks in the order of their first forwards)."""
        out = {}
        for k, e in enumerate(self.events):
            if e[0] == "forward" and e[1] not in out:
                before = sum(1 for x in self.events[:k] if x == ("sync", e[1]))
                out[e[1]] = (before, self.events.count(("sync", e[1])), e[2])
        return out, [e[1] for e in self.events if e[0] == "sync"], list(out)


def _gather_grad_shards(chunks):
    """The distributed optimizer's reduce-scatter leaves each replica its own shard of the summed
    gradients: gather the shards so that every replica holds the whole sum."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in chunks:
        for group in chunk.bucket_groups:
            size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[rank].clone()
                dist.all_gather_into_tensor(bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group)


def _check(label, results, refs, runs, world, dp=1):
    """``refs``: per data-parallel replica, (losses, per-micro-batch grads)."""
    worst = {}
    pp = world // dp
    by_pos = {(r[0]["dp"], r[0]["pp"]): r for r in results}
    for i, run in enumerate(runs):
        m, zb, fo = run[:3]
        tag = f"{label} {run[3] if len(run) > 3 else ''} M={m} zero_bubble={zb} forward_only={fo}"
        dl = 0.0
        for j in range(dp):
            ref_losses = refs[j][0]
            losses = by_pos[(j, pp - 1)][i]["losses"]
            assert losses is not None and len(losses) == m, f"{tag}: last rank returned {losses}"
            assert np.all(np.isfinite(losses)), f"{tag}: losses {losses}"  # max() below ignores NaN
            dl = max(dl, max(abs(a - b) for a, b in zip(losses, ref_losses[:m])))
            assert dl <= RTOL * max(abs(x) for x in ref_losses[:m]), f"{tag}: losses {losses} vs {ref_losses[:m]}"
            # Ranks that read data (first and last stages) read exactly M micro-batches; others none.
            # DualPipeV: both ends of the model are on rank 0; rank pp-1 reads nothing.
            for r in range(pp):
                reads_data = r == 0 if label.startswith("dualpipev") else r in (0, pp - 1)
                unread = by_pos[(j, r)][i]["unread"]
                assert unread == (0 if reads_data else m), f"{tag}: rank {r} left {unread} of {m} unread"
        if fo:
            print(f"  {tag}: max|loss diff| {dl:.2e}")
            continue
        pooled = [g for j in range(dp) for g in refs[j][1][:m]]  # every replica's micro-batches
        grads = Gap()
        for res in results:
            for c, chunk_grads in enumerate(res[i]["grads"]):
                for key, g in chunk_grads.items():
                    assert np.all(np.isfinite(g)), f"{tag}: rank {res[i]['pp']} {key}: not finite"
                    grads.add(g, reference.mean_grad(pooled, key), f"rank {res[i]['pp']} model[{c}] {key}")
        print(f"  {tag}: max|loss diff| {dl:.2e}  " + grads.line("gradients"))
        assert grads.rel <= RTOL, f"{tag}: " + grads.line("gradients")
        worst[tag] = grads.rel
    return worst


def _runs(pp, zero_bubble_off_at=4):
    """M in {pp, pp+1, 2pp, 2pp+3, 3pp}; one of them without zero bubble; one forward-only."""
    ms = [pp, pp + 1, 2 * pp, 2 * pp + 3, 3 * pp]
    return [(m, i != zero_bubble_off_at, False) for i, m in enumerate(ms)] + [(pp + 2, True, True)]


def _references(tied, n, dp=1, moe=False, users=False):
    refs = []
    for j in range(dp):
        [(state, losses, per_mb)] = me.run_workers(_reference_worker, 1, args=(tied, n, 7 + j, moe, users), timeout=120)
        refs.append((losses, per_mb))
    return state, refs


def _run_and_check(schedule, pp, tied, runs, dp=1, moe=False, overlap=False, param_gather=False, users=False):
    n = max(r[0] for r in runs)
    state, refs = _references(tied, n, dp, moe, users)
    results = me.run_workers(_pipeline_worker, pp * dp,
                             args=(schedule, tied, state, runs, dp, moe, overlap, param_gather, users), timeout=400)
    label = (f"{schedule} pp={pp} dp={dp} tied={tied}{' moe' if moe else ''}{' overlap_grad_reduce' if overlap else ''}"
             f"{' overlap_param_gather' if param_gather else ''}{' ' + spec(users=users).label() if users else ''}")
    print(f"\n{label}:")
    _check(label, results, refs, runs, pp * dp, dp)
    return results


@pytest.mark.parametrize("tied,pp", [pytest.param(True, 2, marks=SMOKE), (True, 4), (False, 2), (False, 4)])
def test_dualpipe_equals_single_process(pp, tied):
    runs = _runs(pp)
    if not tied:  # the same executor running 1F1B and ZB-H1 orders on model[0] alone
        runs += [(pp + 1, True, False, "executor-1f1b"), (2 * pp, True, False, "zb-h1")]
    _run_and_check("dualpipe", pp, tied, runs)


def test_dualpipe_pp8_equals_single_process():
    _run_and_check("dualpipe", 8, True, _runs(8))


def test_dualpipe_pp4_dp2_ddp_equals_single_process():
    _run_and_check("dualpipe", 4, True, [(4, True, False), (11, True, False), (8, False, False)], dp=2)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_overlap_grad_reduce_pp2_dp2_ddp_equals_single_process(schedule):
    """--overlap-grad-reduce as Megatron-LM sets it up: each chunk's bd sum starts after its last W
    and its data-parallel reduction (grad_sync_func) after that sum; tied embeddings folded first.
    M=3 pads unevenly, so the two partners finish their chunks in different orders (DualPipe: the
    bd sums are issued in the lower rank's order)."""
    _run_and_check(schedule, 2, True, [(3, True, False), (4, True, False), (5, False, False)], dp=2, overlap=True)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_moe_with_aux_loss_equals_single_process(schedule):
    """MoE (SequentialMLP experts, allgather dispatcher, aux loss on): fake micro-batches add no
    aux loss, and the aux loss is scaled by the real number of micro-batches."""
    _run_and_check(schedule, 2, False, [(3, True, False), (4, True, False), (5, False, False)], moe=True)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_users_architecture_equals_single_process(schedule):
    """The architecture users train (RoPE with Llama 3.1's scaling on half of each head, SwiGLU,
    RMSNorm, untied): megatron-core's rotary embedding runs in the CPU mode, every position of a
    micro-batch rotated as in the pp=1 reference; with dp=2 and DDP's overlapped reduction."""
    _run_and_check(schedule, 2, False, [(3, True, False), (4, False, False), (5, True, False)], dp=2, overlap=True,
                   users=True)


@pytest.mark.parametrize("pp", [pytest.param(2, marks=SMOKE), 4])
def test_dualpipev_equals_single_process(pp):
    _run_and_check("dualpipev", pp, True, _runs(pp))


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_overlap_param_gather_pp2_dp2_starts_every_gather_before_its_chunks_first_forward(schedule):
    """--overlap-param-gather (aligned) with the distributed optimizer's buffers: the executor calls
    config.param_sync_func for each chunk before the first action, in the order of the chunks' first
    forwards, so at each chunk's first forward all its all-gathers are already started (DDP's pre-hook
    only waits); the shards a replica does not own are NaN before each run, so losses and gradients
    equal to the reference show that every gather completed before its parameters were read. Control: a run without param_sync_func, where
    the pre-hooks start the gathers themselves (correct, not started before the forward)."""
    runs = [(3, True, False), (4, True, False), (5, False, False), (4, True, False, schedule, False), (4, True, True)]
    results = _run_and_check(schedule, 2, True, runs, dp=2, overlap=True, param_gather=True)
    for i, run in enumerate(runs):
        handed, forward_only = (run[4] if len(run) > 4 else True), run[2]
        seen = {(res[i]["dp"], res[i]["pp"]): res[i]["gathers"] for res in results}
        print(f"  run {run}: per (dp, pp) rank, (chunk -> (sync calls before its first forward, in the run, "
              f"gathers started at that forward), chunks synced in order, chunks' first forwards in order): {seen}")
        for where, (chunks, synced, first) in seen.items():
            assert sorted(chunks) == [0, 1], f"run {run}, rank {where}: forwards of chunks {sorted(chunks)}"
            want = (1, 1, True) if handed and not forward_only else (0, 0, False)
            assert all(v == want for v in chunks.values()), f"run {run}, rank {where}: {chunks}, expected {want}"
            assert synced == (first if want[0] else []), f"run {run}, rank {where}: synced {synced}, first {first}"


# ---------------------------------------------------------------------------------------------
# Several optimizer steps: the copies stay bit-identical and track the reference model.

STEPS, LR, STEP_M = 3, 0.5, 6


def _reference_training_worker(rank, world, port, tied):
    me.init_distributed_cpu(rank, world, port)
    try:
        model = models.provider(spec(tied))()
        state = reference.weights(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            for b in spec().batches(STEP_M, seed=100 + step):
                out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
                loss, _ = masked_loss_func(b["loss_mask"], out)
                (loss / STEP_M).backward()
                losses.append(loss.item())
            opt.step()
        return state, losses, {k: p.detach().clone() for k, p in model.named_parameters()}
    finally:
        me.destroy_distributed()


def _training_worker(rank, world, port, tied, full_state):
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        model = build_two_direction_model(models.provider(spec(tied)))
        full = {k: torch.from_numpy(v) for k, v in full_state.items()}
        names.load_stage_from_full(model[0], full)
        broadcast_mirrors(model)
        for chunk in model:
            chunk.config.finalize_model_grads_func = lambda *a, **k: None
        opt = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=LR)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            out = forward_backward_dualpipe(
                forward_step_func=forward_step, data_iterator=iter(spec().batches(STEP_M, seed=100 + step)),
                model=model, num_microbatches=STEP_M, seq_length=SEQ, micro_batch_size=MBS, p2p_timeout=60)
            losses += [d["lm loss"].item() for d in out]
            opt.step()
        return losses, [names.by_full_name(c, full, lambda p: p.detach().clone()) for c in model]
    finally:
        me.destroy_distributed()


@pytest.mark.parametrize("tied", [True, False])
def test_training_steps_keep_copies_identical_and_match_reference(tied):
    pp = 4
    [(state, ref_losses, ref_params)] = me.run_workers(_reference_training_worker, 1, args=(tied,), timeout=120)
    results = me.run_workers(_training_worker, pp, args=(tied, state), timeout=300)
    losses = results[pp - 1][0]
    assert len(losses) == len(ref_losses), (losses, ref_losses)
    loss_gap = Gap()
    loss_gap.add(losses, ref_losses)
    print(f"\ndualpipe pp={pp} tied={tied}, {STEPS} SGD steps of {STEP_M} micro-batches: "
          + loss_gap.line(f"{len(losses)} micro-batch losses"))
    assert loss_gap.rel <= RTOL
    # Copy on rank r (model[1]) and its partner's model[0] on rank pp-1-r: bit for bit.
    for r in range(pp):
        mirror, original = results[r][1][1], results[pp - 1 - r][1][0]
        assert mirror.keys() == original.keys()
        for k in mirror:
            assert np.array_equal(mirror[k], original[k]), f"rank {r} model[1] {k} differs from its partner's"
    # Tied: the embedding's copies (embedding on one stage, output layer on the other) agree exactly.
    params = Gap()
    for r in range(pp):
        for c, chunk in enumerate(results[r][1]):
            for k, v in chunk.items():
                params.add(v, ref_params[k], f"rank {r} model[{c}] {k}")
    print("  " + params.line(f"parameters after {STEPS} steps vs reference") + "; mirrors bit-identical to their partners")
    assert params.rel <= RTOL


def _one_queue_worker(rank, world, port, *args):
    """``_pipeline_worker`` on a process that says it has one hardware queue
    (``CUDA_DEVICE_MAX_CONNECTIONS=1`` on a GPU): the iteration plan then issues the bd sums where
    they cannot hold a P2P the partner needs. Returns its results and rank 0's bd-sum points."""
    from megatron_dualpipe.mcore.forward_backward import _checked_iteration
    from megatron_dualpipe.schedule import iteration_plan, registry
    from megatron_dualpipe.schedule.lowering.program import ProgramOptions

    from megatron_dualpipe.executor import pair_sums

    iteration_plan.one_hardware_queue = lambda: True
    issued, issue = [], pair_sums.issue_sum
    pair_sums.issue_sum = lambda c, *a, **k: (c >= 0 and issued.append(c)) or issue(c, *a, **k)
    results = _pipeline_worker(rank, world, port, *args)
    name, _, _, runs, dp, _, overlap = args
    (m, zero_bubble, _), pp = runs[0], world // dp
    padded = registry.get(name).padded_microbatches(pp, m)
    options = ProgramOptions(zero_bubble=zero_bubble, overlap_grad_reduce=overlap, dp=dp)
    prog = _checked_iteration(name, pp, padded, m, False, options).program  # what the run used
    pp_rank = results[0]["pp"]
    return results, prog.sum_points[pp_rank], len(prog.actions[pp_rank]), issued


def test_one_hardware_queue_moves_the_bd_sums_and_equals_single_process():
    """pp=2 x dp=2, --overlap-grad-reduce, M=3: a case whose mid-schedule bd sums would deadlock on
    one hardware queue (tests/schedule/test_iteration_plan.py::test_one_hardware_queue); planned
    for one queue, every sum is issued at the end of the schedule (GradReduction.finish) and the
    losses and gradients still equal the pp=1 reference."""
    runs = [(3, True, False)]
    state, refs = _references(True, 3, 2)
    out = me.run_workers(_one_queue_worker, 4, args=("dualpipe", True, state, runs, 2, False, True), timeout=400)
    results = [r[0] for r in out]
    for rank, (_, points, n_actions, issued) in enumerate(out):
        print(f"\ndualpipe pp=2 dp=2 M=3 on one hardware queue: global rank {rank} issues its bd sums after "
              f"action {[i for i, _ in points]} of {n_actions} (the end of the schedule), chunks in the plan's "
              f"order {[c for _, c in points]}, issued {issued}")
        assert points and all(i == n_actions for i, _ in points), points
        assert issued == [c for _, c in points], (issued, points)  # GradReduction.finish: the plan's order
    _check("dualpipe pp=2 dp=2 one hardware queue", results, refs, runs, 4, 2)
