"""Fused F&B units through megatron-core's combined step (``mcore.overlap``), on the CPU.

MoE GPT (4 layers, 4 experts, alltoall dispatcher) with expert parallel 2 and pp 2: 4 processes,
two data-parallel replicas of a 2-rank pipeline. Every run of DualPipe / DualPipeV is checked
against a single-process reference (the full model, ep=1, a plain loop over each replica's
micro-batches: loss_k / M, backward): losses on the last rank, and every gradient of every chunk
(non-expert: the replica's own mean; expert: the sum over both replicas, whose tokens it
received). The same worker also runs the plain F-then-B path on the same weights and data, and
the two are compared directly. Zero bubble on and off; one M with fake micro-batches.

The runner hands each fused unit (an F marked ``overlap`` and the backward after it, both real) to
the stage compute's ``forward_backward`` hook; with the combined step on, that is one
``combined_forward_backward_step`` call; with it off, the default F then B.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models, names, reference
from megatron_dualpipe.proof.compare import Gap
from megatron_dualpipe.proof.data import forward_step

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

LAYERS, EXPERTS, PP, EP = 4, 4, 2, 2
#: MoE GPT, megatron-core's alltoall dispatcher.
SPEC = models.ModelSpec(layers=LAYERS, experts=EXPERTS)
SEQ, MBS = SPEC.seq, SPEC.mbs
RTOL = 1e-5


# ---------------------------------------------------------------------------------------------
# How many fused units the runner handed to the stage compute's hook


@functools.lru_cache(maxsize=None)
def _count_fused_units():
    """counter[0]: calls of ``forward_backward`` (the runner's fused-unit hook) on any stage compute."""
    from megatron_dualpipe.mcore.overlap import OverlappedStageCompute
    from megatron_dualpipe.mcore.stage_compute import MegatronStageCompute

    counter = [0]
    for cls in (MegatronStageCompute, OverlappedStageCompute):
        hook = cls.forward_backward

        def counted(self, *args, _hook=hook, **kwargs):
            counter[0] += 1
            return _hook(self, *args, **kwargs)

        cls.forward_backward = counted
    return counter


# ---------------------------------------------------------------------------------------------
# Sub-step order inside a fused unit


@functools.lru_cache(maxsize=None)
def _install_order_log():
    """Log every schedule node's forward / backward / weight gradient as (layer, node, kind);
    the pre/post-process nodes as (first layer of their chunk, name, kind)."""
    from megatron.core.models.common import model_chunk_schedule_plan as plan_mod
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron_dualpipe.mcore.compat import layer_plan_nodes, transformer_layer_node_class

    layer_node = transformer_layer_node_class()

    log = {"on": False, "events": []}
    build = plan_mod.TransformerLayerSchedulePlan._build_callable_nodes

    def tagged_build(self, *args, **kwargs):
        build(self, *args, **kwargs)
        for name, node in layer_plan_nodes(self).items():
            if isinstance(node, pp_utils.ScheduleNode) and name != "mtp_post_process":
                node.order_tag = (self.layer.layer_number, name)

    chunk_init = plan_mod.TransformerModelChunkSchedulePlan.__init__

    def tagged_chunk_init(self, model, *args, **kwargs):
        chunk_init(self, model, *args, **kwargs)
        first = model.decoder.layers[0].layer_number
        for node in (self.pre_process, self.post_process):
            if node is not None:
                node.order_tag = (first, node.name)

    def logged(kind, fn):
        def call(self, *args, **kwargs):
            if log["on"] and hasattr(self, "order_tag"):
                log["events"].append((*self.order_tag, kind))
            return fn(self, *args, **kwargs)
        return call

    plan_mod.TransformerLayerSchedulePlan._build_callable_nodes = tagged_build
    plan_mod.TransformerModelChunkSchedulePlan.__init__ = tagged_chunk_init
    pp_utils.ScheduleNode.forward = logged("F", pp_utils.ScheduleNode.forward)
    pp_utils.ScheduleNode.backward = logged("B", pp_utils.ScheduleNode.backward)
    layer_node.backward_dw = logged("W", layer_node.backward_dw)
    return log


def expected_fused_order(f_layers, b_layers, f_last: bool, b_last: bool):
    """megatron-core's documented interleaving (``TransformerLayerSchedulePlan.run``): forward of
    the forward chunk's layer k with backward of the backward chunk's layer n-1-k; per pair
    comm: combine-B | dispatch-F, dispatch-B | combine-F, and comp: attn-F | mlp-B, mlp-W, mlp-F |
    attn-B, attn-W; the first layer's attn-W is held until after the loop."""
    out = [(f_layers[0], "pre_process", "F")]
    if b_last:
        out.append((b_layers[0], "post_process", "B"))
    n = len(f_layers)
    for k in range(n):
        f, b = f_layers[k], b_layers[n - 1 - k]
        out += [(b, "moe_combine", "B"), (f, "attn", "F"), (b, "mlp", "B"), (f, "moe_dispatch", "F"),
                (b, "mlp", "W"), (b, "moe_dispatch", "B"), (f, "mlp", "F"), (f, "moe_combine", "F"),
                (b, "attn", "B")]
        if k < n - 1:
            out.append((b, "attn", "W"))
    out.append((b_layers[0], "attn", "W"))
    if f_last:
        out.append((f_layers[0], "post_process", "F"))
    out.append((b_layers[0], "pre_process", "B"))
    return out


# ---------------------------------------------------------------------------------------------
# Workers


def _reference_worker(rank, world, port, n, seeds):
    me.init_distributed_cpu(rank, world, port)
    try:
        model = models.provider(SPEC)()
        state = reference.weights(model)
        return state, [reference.per_microbatch(model, SPEC.batches(n, seed)) for seed in seeds]
    finally:
        me.destroy_distributed()


def _global_key(name, chunk, full, ep_rank):
    key = names.full_key(name, names.layer_offset(chunk), full)
    marker = ".local_experts."
    if marker in key:
        head, tail = key.split(marker, 1)
        index, rest = tail.split(".", 1)
        key = f"{head}{marker}{int(index) + ep_rank * (EXPERTS // EP)}.{rest}"
    return key


def _load(chunk, full, ep_rank):
    with torch.no_grad():
        for name, tensor in chunk.state_dict().items():
            if "_extra_state" not in name:
                tensor.copy_(full[_global_key(name, chunk, full, ep_rank)])


def _pipeline_worker(rank, world, port, schedule, full_state, runs):
    """``runs``: (M, zero_bubble, overlap). Per run: losses (last rank), grads per chunk, and how
    many fused units went through the hook; the first fused unit's sub-step order on rank 0."""
    from megatron.core import parallel_state as ps
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model
    from megatron_dualpipe.mcore.overlap import enable_combined_step

    me.init_distributed_cpu(rank, world, port, pp=PP, ep=EP)
    try:
        build_bd_groups()
        v = schedule == "dualpipev"
        model = build_two_direction_model(models.provider(SPEC, v_layout=v), layout_kind="v" if v else "bidirectional")
        full = {k: torch.from_numpy(x) for k, x in full_state.items()}
        ep_rank, dp_rank, pp_rank = (ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank(),
                                     ps.get_pipeline_model_parallel_rank())
        for chunk in model:
            _load(chunk, full, ep_rank)  # both chunks from the full model (the mirror too)
            chunk.config.finalize_model_grads_func = lambda *a, **k: None
            enable_combined_step(chunk.config)
        fused_units = _count_fused_units()
        order_log = _install_order_log()
        deferred = _count_deferred_weight_grads()
        warnings = _capture_warnings()
        te = _stand_in_for_te()
        results = []
        for m, zero_bubble, overlap, *delay in runs:
            for chunk in model:
                chunk.zero_grad()
                chunk.config.overlap_moe_expert_parallel_comm = overlap
                chunk.config.delay_wgrad_compute = bool(delay and delay[0])
            te.update(te_backward_dw=0, inline_dw=0)
            fused_units[0] = 0
            order_log.update(on=overlap and not order_log.get("done"), events=[])
            deferred[0] = 0
            out = forward_backward_dualpipe(
                forward_step_func=forward_step, data_iterator=iter(SPEC.batches(m, seed=7 + dp_rank)), model=model,
                num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, schedule=schedule,
                zero_bubble=zero_bubble, p2p_timeout=120)
            fused = fused_units[0]
            results.append({
                "dp": dp_rank, "pp": pp_rank, "fused": fused,
                "losses": [d["lm loss"].item() for d in out] if pp_rank == PP - 1 else None,
                "grads": [{_global_key(n, c, full, ep_rank): p.grad.clone()
                           for n, p in c.named_parameters() if p.grad is not None} for c in model],
                "layers": [[layer.layer_number for layer in c.decoder.layers] for c in model],
                "ends": [bool(c.post_process) for c in model], "deferred": deferred[0], "warnings": list(warnings), "te": dict(te),
                "events": list(order_log["events"]) if order_log["on"] else None})
            order_log["done"] = order_log.get("done") or overlap
        return results
    finally:
        me.destroy_distributed()


def _count_deferred_weight_grads():
    """How many deferred weight-gradient closures W actions ran (counter[0])."""
    from megatron_dualpipe.mcore import wgrad

    counter = [0]
    run = wgrad.WeightGradStore.run

    def counting_run(self, key):
        n = run(self, key)
        counter[0] += n
        return n

    wgrad.WeightGradStore.run = counting_run
    return counter


@functools.lru_cache(maxsize=None)
def _stand_in_for_te():
    """The local spec as a stand-in for Transformer Engine with ``delay_wgrad_compute``: every
    ``backward_dw`` is a no-op (RowParallelLinear has none: added), the local linears compute their
    weight gradients in autograd as usual. Counts the calls that matter: a B handing the W action
    what TE queued (``_te_backward_dw`` with the B's key; the local linears queue nothing) and
    schedule-plan nodes that run ``backward_dw`` inline. The TE stand-in's queues are tested in
    tests/mcore/test_wgrad.py and through pretrain_gpt.py."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron_dualpipe.mcore import stage_compute
    from megatron_dualpipe.mcore.compat import transformer_layer_node_class

    counts = {"te_backward_dw": 0, "inline_dw": 0}
    RowParallelLinear.backward_dw = lambda self: None
    handed = stage_compute.MegatronStageCompute._te_backward_dw

    def counted_hand_over(self, chunk, before, key):
        counts["te_backward_dw"] += int(key is not None)
        return handed(self, chunk, before, key)

    stage_compute.MegatronStageCompute._te_backward_dw = counted_hand_over
    layer_node = transformer_layer_node_class()
    node_dw = layer_node.backward_dw

    def counted_node_dw(self):
        counts["inline_dw"] += int(bool(self.delay_wgrad_compute))
        return node_dw(self)

    layer_node.backward_dw = counted_node_dw
    return counts


def _capture_warnings():
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("megatron_dualpipe").addHandler(Keep(logging.WARNING))
    return seen


# ---------------------------------------------------------------------------------------------
# Checks


def _expected_grad(per_seed, key, dp, m):
    if ".local_experts." in key:  # the expert received the tokens of every replica: their sum
        return sum(reference.mean_grad(grads, key, m) for _, grads in per_seed)
    return reference.mean_grad(per_seed[dp][1], key, m)


def _run(schedule, runs):
    seeds = [7 + j for j in range(2)]
    [(state, per_seed)] = me.run_workers(_reference_worker, 1, args=(max(r[0] for r in runs), seeds), timeout=200)
    results = me.run_workers(_pipeline_worker, PP * EP, args=(schedule, state, runs), timeout=600)
    print(f"\n{schedule} pp={PP} ep={EP} (alltoall), dp=2, vs single process and vs F-then-B:")
    by_run = {}
    for i, (m, zb, overlap, *delay) in enumerate(runs):
        losses, grads = Gap(), Gap()
        for res in results:
            r = res[i]
            if r["losses"] is not None:
                assert len(r["losses"]) == m
                losses.add(r["losses"], per_seed[r["dp"]][0][:m], f"dp {r['dp']}")
            for c, chunk_grads in enumerate(r["grads"]):
                for key, g in chunk_grads.items():
                    grads.add(g, _expected_grad(per_seed, key, r["dp"], m),
                              f"(pp {r['pp']}, dp {r['dp']}) model[{c}] {key}")
        fused = [res[i]["fused"] for res in results]
        deferred = [res[i]["deferred"] for res in results]
        print(f"  M={m} zero_bubble={zb} overlap={overlap}: {losses.line('losses')}; {grads.line('gradients')}; "
              f"fused units through the hook per rank: {fused}; deferred weight gradients run by W per rank: "
              f"{deferred}")
        assert losses.diff <= RTOL * 5 and grads.rel <= RTOL, (m, zb, overlap, losses.line("losses"),
                                                               grads.line("gradients"))
        # Each rank's few B actions at pp=2 may all be fake micro-batches when M is padded.
        assert (all(n > 0 for n in deferred) if m == 8 else any(deferred)) if zb else not any(deferred)
        by_run[(m, zb, overlap, *delay)] = i
        if delay and delay[0]:
            _check_te_deferral(schedule, results, i, m, zb)
    # The audit watched the first iteration (combined step, zero bubble on): B kept no weight gradient.
    assert not [w for res in results for w in res[-1]["warnings"] if "zero bubble" in w]
    # The combined step against the F-then-B path on the same weights and data.
    for (m, zb, overlap, *delay), i in by_run.items():
        j = by_run.get((m, zb, False))
        if not overlap or delay or j is None:
            continue
        d = 0.0
        for res in results:
            d = max([d] + [float(np.max(np.abs(res[i]["grads"][c][k] - res[j]["grads"][c][k])))
                           for c in range(2) for k in res[j]["grads"][c]])
            if res[i]["losses"] is not None:
                d = max([d] + [abs(a - b) for a, b in zip(res[i]["losses"], res[j]["losses"])])
            assert res[i]["grads"][0].keys() == res[j]["grads"][0].keys()
        print(f"  M={m} zero_bubble={zb}: overlap vs F-then-B: max|diff| over losses and gradients {d:.2e}")
        assert d <= RTOL * 1e-1
    return results


def _check_te_deferral(schedule, results, i, m, zb):
    """With ``delay_wgrad_compute`` (the stand-in for TE) every B records one ``backward_dw()`` for
    its W and the schedule plan runs none inline for it; fused units and BW run theirs inline
    (2 per layer: MLP and attention). Counted from the rank's action list."""
    from megatron_dualpipe.schedule import B, BW, build_schedule

    for res in results:
        r = res[i]
        acts = build_schedule(schedule, PP, m).ranks[r["pp"]]
        n_b, n_bw = sum(a.op == B for a in acts), sum(a.op == BW for a in acts)
        layers = len(r["layers"][0])
        want = {"te_backward_dw": n_b, "inline_dw": 2 * layers * (n_bw + (0 if zb else n_b))}
        print(f"    rank pp={r['pp']} dp={r['dp']}: {n_b} B, {n_bw} BW, {layers} layers per chunk -> "
              f"backward_dw recorded for W {r['te']['te_backward_dw']}, run inline by the plan "
              f"{r['te']['inline_dw']} (expected {want})")
        assert r["te"] == (want if zb else {"te_backward_dw": 0, "inline_dw": want["inline_dw"]}), (r["te"], want)


def _check_order(results, runs):
    first = next(i for i, r in enumerate(runs) if r[2])
    res = next(r[first] for r in results if r[first]["dp"] == 0 and r[first]["pp"] == 0)
    events = res["events"]
    assert events, "no fused unit logged"
    # The first fused unit: from its pre_process forward to the backward chunk's pre_process backward.
    start = next(k for k, e in enumerate(events) if e[1] == "pre_process" and e[2] == "F"
                 and any(x[2] == "B" for x in events[k:k + 4]))
    end = next(k for k in range(start, len(events)) if events[k][1:] == ("pre_process", "B")) + 1
    unit = events[start:end]
    f_chunk = next(c for c in range(2) if res["layers"][c][0] == unit[0][0])
    b_chunk = 1 - f_chunk
    want = expected_fused_order(res["layers"][f_chunk], res["layers"][b_chunk], res["ends"][f_chunk],
                                res["ends"][b_chunk])
    print(f"  first fused unit on pipeline rank 0: forward of layers {res['layers'][f_chunk]} with backward of "
          f"layers {res['layers'][b_chunk]}:")
    for e in unit:
        print(f"    layer {e[0]} {e[1]} {dict(F='forward', B='backward', W='weight gradient')[e[2]]}")
    assert unit == want


#: (M, zero bubble, overlap[, delay_wgrad_compute]). The first run is the one the executor audits for undeferred weights.
RUNS = [(8, True, True), (8, True, False), (8, False, True), (8, False, False), (5, True, True),
        (8, True, True, True)]  # the last with delay_wgrad_compute (TE's deferral, local stand-in)


def test_dualpipe_overlapped_units_equal_f_then_b_and_single_process():
    results = _run("dualpipe", RUNS)
    _check_order(results, RUNS)


def test_dualpipev_overlapped_units_equal_f_then_b_and_single_process():
    results = _run("dualpipev", RUNS)
    _check_order(results, RUNS)


def test_enable_combined_step_adapter_and_dualpipev_config_keep_the_flags():
    """megatron-core refuses the flag with pp=2 and no virtual pipeline; the adapter refuses what the
    combined step cannot run, naming the flag, and sets it on a config megatron-core built;
    ``dualpipev_config`` (vpp=2) keeps it."""
    from megatron.core.transformer import TransformerConfig
    from megatron_dualpipe.mcore.model import dualpipev_config
    from megatron_dualpipe.mcore.overlap import COMBINED_STEP_FLAGS, enable_combined_step

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4, use_cpu_initialization=True,
                pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, moe_token_dispatcher_type="alltoall")
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size must be specified"):
        TransformerConfig(**base, expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True, bf16=True)
    with pytest.raises(ValueError) as refused:
        enable_combined_step(TransformerConfig(**{**base, "moe_token_dispatcher_type": "allgather"}))
    print(f"\n{refused.value}")
    assert str(refused.value).startswith("--overlap-moe-expert-parallel-comm with DualPipe: it overlaps the "
                                         "expert-parallel all-to-all: set --expert-model-parallel-size > 1")
    assert "alltoall or flex" in str(refused.value)
    # the fused units never run the checkpointed MoE layer: refused at every tag (megatron-core 0.16.1 says nothing)
    with pytest.raises(ValueError) as moe_recomputed:
        enable_combined_step(TransformerConfig(**base, expert_model_parallel_size=2, recompute_granularity="selective",
                                               recompute_modules=["core_attn", "moe"]))
    assert "--recompute-modules moe" in str(moe_recomputed.value) and "remove moe from" in str(moe_recomputed.value)
    config = enable_combined_step(TransformerConfig(**base, expert_model_parallel_size=2))
    v = dualpipev_config(config)
    assert [getattr(config, f) for f in COMBINED_STEP_FLAGS] == [True, False]
    assert [getattr(v, f) for f in COMBINED_STEP_FLAGS] == [True, False] and v.virtual_pipeline_model_parallel_size == 2


def _refusal(make):
    try:
        make()
    except ValueError as e:
        return str(e)
    return None


def test_megatron_cores_own_checks_run_on_the_flags_the_plugin_turns_on():
    """Issue 35, finding 2: the plugin sets the combined step's flags (and delay_wgrad_compute alone)
    after megatron-core validated the config without them; megatron-core's own rules for them now run
    on a probe copy (the pipeline DualPipe replaces relaxed, nothing else). The reference is what
    megatron-core itself says of the same fields on a one-stage pipeline, where it has no pp/vpp rule."""
    from megatron.core.transformer import TransformerConfig
    from megatron_dualpipe.mcore.overlap import enable_combined_step, enable_deferred_wgrads

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_moe_experts=4, use_cpu_initialization=True,
                pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=2)
    one_stage = dict(base, pipeline_model_parallel_size=1, bf16=True, overlap_moe_expert_parallel_comm=True)
    newer = "overlap_dispatch_backward_with_experts_wgrad" in TransformerConfig.__dataclass_fields__  # 0.19's rules
    cases = {"shared expert overlap": dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
             "full recomputation": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    if newer:
        cases["moe recomputed"] = dict(recompute_granularity="selective", recompute_modules=["moe"])
    for name, fields in cases.items():
        with pytest.raises(AssertionError) as megatron_says:
            TransformerConfig(**one_stage, **fields)
        got = _refusal(lambda: enable_combined_step(TransformerConfig(**base, **fields)))
        print(f"\n{name}: megatron-core: {megatron_says.value}; the plugin: {got}")
        assert got is not None and str(megatron_says.value) in got, got
    if newer:  # megatron-core asks TE >= 2.3 for this flag at construction: set afterwards, as a user's hook could
        exclusive = TransformerConfig(**base)
        exclusive.overlap_dispatch_backward_with_experts_wgrad = True
        got = _refusal(lambda: enable_deferred_wgrads(exclusive))
        print(f"delay_wgrad_compute with overlap_dispatch_backward_with_experts_wgrad: {got}")
        assert got is not None and "mutually exclusive" in got and "--overlap-dispatch-backward" in got
    accepted = enable_deferred_wgrads(TransformerConfig(**base))
    assert accepted.delay_wgrad_compute and not accepted.overlap_moe_expert_parallel_comm
    fine = enable_combined_step(TransformerConfig(**base), delay_wgrad_compute=True)
    assert fine.delay_wgrad_compute and fine.overlap_moe_expert_parallel_comm
