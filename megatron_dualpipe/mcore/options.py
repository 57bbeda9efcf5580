"""The one table of Megatron options: for each, the schedules it is refused for and why, or the proof that it is
handled. Both checks read the same rules: Megatron-LM's, from ``args`` after ``validate_args`` (``side=ARGS``),
and megatron-core's call-time check (``mcore.validation``), from the model's ``TransformerConfig``
(``side=CONFIG``); a rule names the attribute it reads on each side (None: not checked there).
``docs/megatron-options.md`` is generated from :data:`REFUSED` and :data:`HANDLED` (``tools/gen_docs.py``).
Standard library only.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from ..schedule import registry
from ..schedule.copy_sum import DP_FIRST as _DP_FIRST_WAY, SHARED_SHARD as _SHARED_SHARD_WAY

#: The config flags that send an iteration through megatron-core's combined 1F1B step (mcore/overlap.py's
#: fused F&B units); here, below the model build and Megatron-LM's hooks, which read them too.
COMBINED_STEP_FLAGS = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute")

__all__ = ["ARGS", "CONFIG", "Refused", "Handled", "REFUSED", "HANDLED", "COMBINED_STEP", "problems",
           "combined_step_problems", "args_rules"]

ARGS, CONFIG = "args", "config"
#: A third side for the rules ``read`` can answer from a chunk's ``DistributedDataParallelConfig``
#: (what a megatron-core API caller sets without Megatron-LM's args): checked at call time.
DDP = "ddp"

#: Schedule groups the rules name.
EXECUTOR = registry.names(runs_on=registry.EXECUTOR)
TWO_CHUNKS = registry.names(chunks_per_rank=2)
ONE_CHUNK_EXECUTOR = registry.names(runs_on=registry.EXECUTOR, chunks_per_rank=1)
MIRRORED = registry.names(mirrored=True)

#: The flags whose requirements the ``needs`` rules state.
COMBINED_STEP = "--overlap-moe-expert-parallel-comm"
SHARED_SHARDS, DP_FIRST = _SHARED_SHARD_WAY.flag, _DP_FIRST_WAY.flag


@dataclass(frozen=True)
class Refused:
    """An option a schedule cannot honour: ``flag`` what the user typed, ``arg`` / ``config`` the
    attributes of ``args`` / a ``TransformerConfig`` that hold it (None: not checked there), or ``read``
    (source, side) -> value; ``is_set(value)``: refused; ``why`` and ``fix`` for the message;
    ``needs``: a requirement of that flag, checked only while it is on; ``test``: where it is tested."""

    flag: str
    why: str
    arg: Optional[str] = None
    config: Optional[str] = None
    schedules: Tuple[str, ...] = TWO_CHUNKS
    is_set: Callable[[Any], bool] = bool
    fix: Optional[str] = None
    read: Optional[Callable[[Any, str], Any]] = None
    needs: Optional[str] = None
    test: str = "A"
    sides: Optional[Tuple[str, ...]] = None  # with ``read``: the sides it reads (default both)

    def value(self, source, side: str):
        if self.read is not None:
            return self.read(source, side)
        return getattr(source, self.arg if side == ARGS else self.config, None)

    def applies(self, side: str) -> bool:
        if self.read is None:
            return side != DDP and (self.arg if side == ARGS else self.config) is not None
        return side in (self.sides or (ARGS, CONFIG))  # DDP only for the rules that say they read it

    def message(self) -> str:
        if self.needs:
            return f"{self.why}: {self.fix}"
        return f"does not support {self.flag} ({self.why}); {self.fix or 'remove ' + self.flag}"


#: An option that runs under the executor's schedules, with its status and the test that proves it.
Handled = namedtuple("Handled", "option status test")


def _v_last_rank_without_moe_before_019(args, side=ARGS) -> bool:
    """dualpipev on megatron-core < 0.19 whose last pipeline rank (V-stages pp-1 and pp) holds no MoE layer:
    0.16.1 averages the printed load_balancing_loss over data parallel only on ranks whose MoE layers recorded
    their groups, and that rank prints it (1.004467 for 1f1b's 1.002724; lm loss and gradients equal)."""
    from ..versions import installed_core_version, parse

    version, layers = installed_core_version(), getattr(args, "num_layers", None)
    pp, freq = getattr(args, "pipeline_model_parallel_size", 1) or 1, getattr(args, "moe_layer_freq", 1)
    if not getattr(args, "num_experts", None) or not version or parse(version) >= (0, 19) or not layers:
        return False
    pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else list(freq)
    sizes = _v_stage_sizes(args, layers, pp)
    start = sum(sizes[:pp - 1])
    return not any(pattern[start:start + sizes[pp - 1] + sizes[pp]])


def _v_stage_sizes(args, layers: int, pp: int) -> List[int]:
    """Layers of each of DualPipeV's 2pp V-stages: the layout's, or Megatron's split (the embedding and
    the loss counted as layers of V-stages 0 and 2pp-1 where asked)."""
    from ..schedule import stage_layout

    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return list(stage_layout.decoder_counts(stage_layout.parse(str(layout))))
    counted = [bool(getattr(args, f"account_for_{what}_in_pipeline_split", False)) for what in ("embedding", "loss")]
    sizes = [(layers + sum(counted)) // (2 * pp)] * (2 * pp)
    sizes[0] -= counted[0]
    sizes[-1] -= counted[1]
    return sizes


def _virtual_pipeline(source, side):
    if side == ARGS:
        return (getattr(source, "num_layers_per_virtual_pipeline_stage", None) is not None
                or getattr(source, "num_virtual_stages_per_pipeline_rank", None) is not None)
    # A TransformerConfig of DualPipeV's chunks says virtual_pipeline_model_parallel_size=2 by
    # design (mcore.model.dualpipev_config): the process-wide setting is the one to ask.
    from megatron.core import parallel_state

    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return vp is not None and vp > 1


def _either(*names):
    return lambda source, side: any(getattr(source, n, None) not in (None, False) for n in names)


_VP_FLAGS = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"
#: Uneven stages: proven for dualpipe and dualpipev (megatron-core's own offsets per chunk); their stage
#: counts and dualpipev's first / last stage flags are checked by megatron_lm.arguments.
_UNEVEN_TWO_CHUNKS = "uneven stages are proven equal to 1F1B under dualpipe and dualpipev only so far"
_UNEVEN_FIX = "use --pipeline-schedule dualpipe or dualpipev, or an even split"


def _needs_of_a_dualpipe_flag(needs: str, test: str, rows) -> Tuple[Refused, ...]:
    """The requirements of one of DualPipe's own Megatron-LM flags (args only): ``rows`` of
    (flag, why, is refused(args), fix)."""
    return tuple(Refused(flag, f"{flag}: {why}", read=lambda source, side, r=refused: r(source), sides=(ARGS,),
                         schedules=MIRRORED, needs=needs, fix=fix, test=test)
                 for flag, why, refused, fix in rows)


#: Checked on ``args`` by the table and at megatron-core call time by ``mcore.validation`` (which knows
#: whether the call runs zero bubble; a config does not say).
TE_BIASES_IN_W = Refused(
    "--add-bias-linear", "Transformer Engine's backward_dw loses a linear bias's gradient when two backwards of one "
    "module wait for their W (zero bubble's B, B, W, W with --delay-wgrad-compute: TE raises at the second W)",
    read=lambda source, side: bool(getattr(source, "delay_wgrad_compute", False)
                                   and getattr(source, "add_bias_linear", False)
                                   and getattr(source, "dualpipe_zero_bubble", True)),
    sides=(ARGS,), schedules=EXECUTOR,
    fix="add --disable-bias-linear, remove --delay-wgrad-compute, or add --no-dualpipe-zero-bubble",
    test="A `refused --add-bias-linear`; E `te_biases_deferred`")

#: Every refused option, in the order the checks report them.
REFUSED: Tuple[Refused, ...] = (
    # The pipeline's structure.
    Refused(_VP_FLAGS, "the schedule places its own chunks on every rank; a virtual pipeline would add more",
            schedules=EXECUTOR, read=_virtual_pipeline,
            fix=f"remove {_VP_FLAGS} or use --pipeline-schedule "
            f"{registry.DEFAULT}", test="A `dualpipe_virtual_pipeline`; E `virtual_pipeline`"),
    Refused("--pipeline-model-parallel-layout", _UNEVEN_TWO_CHUNKS, arg="pipeline_model_parallel_layout",
            is_set=lambda v: v is not None, schedules=ONE_CHUNK_EXECUTOR, fix=_UNEVEN_FIX),
    Refused("--pipeline-model-parallel-layout with --ckpt-format torch_dist",
            "megatron-core's layout finds a checkpointed layer's local index from parallel_state's pipeline rank, "
            "not from the V-stage the chunk holds", sides=(ARGS,),
            read=lambda source, side: (getattr(source, "pipeline_model_parallel_layout", None) is not None
                                       and getattr(source, "ckpt_format", None) == "torch_dist"
                                       and bool(getattr(source, "save", None) or getattr(source, "load", None))),
            schedules=(registry.DUALPIPEV,), fix="use --ckpt-format torch (its V-stages are mapped to 1F1B's stages)",
            test="A `dualpipev_layout_torch_dist`"),
    Refused("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers", _UNEVEN_TWO_CHUNKS,
            read=_either("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), sides=(ARGS,),
            schedules=ONE_CHUNK_EXECUTOR, fix=_UNEVEN_FIX),
    Refused("--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split", _UNEVEN_TWO_CHUNKS,
            read=_either("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"),
            schedules=ONE_CHUNK_EXECUTOR, fix=_UNEVEN_FIX),
    Refused("--init-model-with-meta-device", "the mirrored copies are broadcast right after construction",
            arg="init_model_with_meta_device", config="init_model_with_meta_device"),
    Refused("--overlap-p2p-communication", "the executor batches its own P2P", config="overlap_p2p_comm",
            schedules=EXECUTOR, fix="turn off --overlap-p2p-communication (overlap_p2p_comm=False; Megatron-LM "
            "turns it off itself without a virtual pipeline, which is refused)", test="E `overlap_p2p_comm`"),
    Refused("variable_seq_lengths", "micro-batches of different shapes; every micro-batch must be seq_length x "
            "micro_batch_size", config="variable_seq_lengths", schedules=EXECUTOR,
            fix="turn off variable_seq_lengths (Megatron-LM's validate_args always does)",
            test="E `variable_seq_lengths`"),
    Refused("num_microbatches_with_partial_activation_checkpoints",
            "Megatron's 1F1B picks, per micro-batch, which ones recompute, from its own window of outstanding "
            "backwards", config="num_microbatches_with_partial_activation_checkpoints", schedules=EXECUTOR,
            is_set=lambda v: v is not None, fix="set it to None and recompute every micro-batch alike "
            "(recompute_granularity / recompute_num_layers); no Megatron-LM flag sets it",
            test="E `partial_recompute_per_microbatch`"),
    # Single options.
    Refused("--use-torch-fsdp2", "FSDP shards the chunks' parameters itself", arg="use_torch_fsdp2"),
    Refused("--use-megatron-fsdp", "FSDP shards the chunks' parameters itself", arg="use_megatron_fsdp"),
    Refused("--mtp-num-layers with --context-parallel-size > 1", "multi-token prediction rolls its labels across "
            "the context-parallel group, not proven equal to 1F1B under these schedules yet",
            read=lambda source, side: bool(getattr(source, "mtp_num_layers", None))
            and (getattr(source, "context_parallel_size", 1) or 1) > 1,
            fix="set --context-parallel-size 1, or use --pipeline-schedule 1f1b"),
    Refused("--mtp-num-layers with --pipeline-model-parallel-layout", "multi-token prediction is proven where "
            "Megatron puts it without a layout: on both copies of stage pp-1 (dualpipe) or on V-stage 2pp-1 beside the "
            "embedding (dualpipev), which a layout cannot name (Megatron's layout check keeps MTP off pipeline rank 0)",
            read=lambda source, side: bool(getattr(source, "mtp_num_layers", None))
            and getattr(source, "pipeline_model_parallel_layout", None) is not None,
            fix="remove --pipeline-model-parallel-layout (MTP then runs on the last stage)"),
    Refused("--cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph",
            "a captured graph replays one fixed order of forwards and backwards, and Megatron's own schedules "
            "capture the local graphs at their end (create_cudagraphs; 'full_iteration' wraps Megatron's function "
            "in FullCudaGraphWrapper at megatron-core 0.19)", arg="cuda_graph_impl", config="cuda_graph_impl",
            schedules=EXECUTOR, is_set=lambda v: v not in (None, "none"), fix="use --cuda-graph-impl none"),
    # megatron-core 0.19 (the attributes do not exist before: read as off).
    Refused("--moe-paged-stash", "Megatron's own schedules reset the paged stash before the first micro-batch "
            "(paged_stash_reset, megatron-core 0.19)", arg="moe_paged_stash", config="moe_paged_stash",
            schedules=EXECUTOR),
    Refused("--moe-expert-rank-capacity-factor", "Megatron-LM wraps the schedule in PagedStashRunner, which "
            "replays an iteration whose expert ranks overflowed (megatron-core 0.19)",
            arg="moe_expert_rank_capacity_factor", config="moe_expert_rank_capacity_factor", schedules=EXECUTOR,
            is_set=lambda v: v is not None),
    Refused(COMBINED_STEP, "a one-chunk order has no fused F&B units to overlap; --delay-wgrad-compute needs it too",
            arg="overlap_moe_expert_parallel_comm", config="overlap_moe_expert_parallel_comm",
            schedules=ONE_CHUNK_EXECUTOR, fix="remove it, or use --pipeline-schedule " + " or ".join(TWO_CHUNKS)),
    Refused("--iterations-to-skip", "the skip path assumes one data iterator", arg="iterations_to_skip"),
    Refused("--adlr-autoresume", "its termination save imports save_checkpoint itself, around the plugin's "
            "checkpoint layout (the mirrors' entries, the V-stages' keys)", arg="adlr_autoresume",
            fix="remove --adlr-autoresume (--exit-signal-handler or --exit-duration-in-mins save through the plugin)"),
    Refused("--sft", "packed variable-length sequences need variable P2P shapes", arg="sft"),
    Refused("--perform-rl-step", "RL builds a separate inference model through get_model and drives its own train loop",
            arg="perform_rl_step", fix="remove --perform-rl-step or use --pipeline-schedule 1f1b"),
    Refused("--hybrid-context-parallel", "micro-batches of different lengths need variable P2P shapes",
            arg="hybrid_context_parallel", config="hybrid_context_parallel"),
    Refused("--moe-router-load-balancing-type global_aux_loss",
            "its loss for micro-batch k averages the token counts of micro-batches 1..k in 1F1B order, and "
            "DualPipe's two copies of a stage each see only one direction's micro-batches",
            arg="moe_router_load_balancing_type", config="moe_router_load_balancing_type", schedules=MIRRORED,
            is_set=lambda v: "global_aux_loss" in (v if isinstance(v, (list, tuple)) else [v]),
            fix="use aux_loss or seq_aux_loss, or --pipeline-schedule dualpipev"),
    Refused("--qk-clip", "each copy of a stage would clip its weights by the largest attention logit of its own "
            "direction's micro-batches, so the copies would drift apart", arg="qk_clip", config="qk_clip",
            schedules=MIRRORED),
    Refused("--fp8-recipe delayed", "its scales come from an amax history of the forwards and backwards in the order "
            "they ran: under dualpipe each copy of a stage would keep its own direction's and the two would drift "
            "apart; under dualpipev the order is not 1F1B's, and no CPU run can show the scales equal (the CPU "
            "mode's FP8 does not quantise)",
            read=lambda source, side: bool(getattr(source, "fp8", None)) and getattr(
                getattr(source, "fp8_recipe", None), "value", getattr(source, "fp8_recipe", None)) == "delayed",
            fix="use --fp8-recipe tensorwise, blockwise or mxfp8",
            test="A `refused --fp8-recipe delayed`; E `fp8_delayed_recipe`"),
    # Accepted once but never run (issue 35, finding 8): no CPU path, no stand-in, no selftest stage yet.
    Refused("--tp-comm-overlap", "Transformer Engine's Userbuffers overlap of the tensor-parallel communication is "
            "not proven with the executor's schedules (the CPU mode's Transformer Engine refuses Userbuffers, and "
            "no selftest stage runs it)", arg="tp_comm_overlap", config="tp_comm_overlap", schedules=EXECUTOR),
    Refused("--context-parallel-size", "context parallelism is not proven equal to 1F1B under the executor's "
            "schedules: no CPU path runs it (Megatron's local attention has none; the CPU mode's Transformer Engine "
            "attention runs one context rank)", arg="context_parallel_size", config="context_parallel_size",
            is_set=lambda v: (v or 1) > 1, schedules=EXECUTOR, fix="set --context-parallel-size 1"),
    Refused("--experimental-attention-variant", "neither variant is proven equal to 1F1B under the executor's "
            "schedules: gated_delta_net's kernels (flash-linear-attention) have no CPU path, and no CPU run or selftest "
            "stage builds dsa (so neither is --recompute-modules gdn_norm_out, megatron-core 0.19)",
            arg="experimental_attention_variant", config="experimental_attention_variant",
            is_set=lambda v: v is not None, schedules=EXECUTOR),
    Refused("--fp8-param-gather", "FP8 parameters (Transformer Engine's quantised weights of both chunks) are not "
            "stood in for on the CPU, so their gathers are not proven", arg="fp8_param_gather", config="fp8_param"),
    Refused("--log-max-attention-logit", "each chunk would record the largest attention logit of its own "
            "micro-batches (under dualpipe, the copies of a stage each their direction's), and no CPU run logs it",
            arg="log_max_attention_logit"),
    Refused("--use-precision-aware-optimizer", "it needs Transformer Engine's FusedAdam, which the CPU mode does not "
            "stand in for: not proven with two chunks per rank", arg="use_precision_aware_optimizer"),
    Refused("--optimizer-cpu-offload", "its hybrid CPU/GPU optimizer is not proven with two chunks per rank (no CPU "
            "path runs it)", arg="optimizer_cpu_offload"),
    Refused("--overlap-param-gather-with-optimizer-step", "its parameter all-gathers run inside the optimizer step, "
            "which the plan check does not model for DualPipeV's two chunks", arg="overlap_param_gather_with_optimizer_step",
            schedules=(registry.DUALPIPEV,)),
    Refused("--defer-embedding-wgrad-compute", "with --mtp-num-layers the output layer's buffers pair its inputs and "
            "output gradients by order, and with the MTP head reusing that layer the pairs differ from 1F1B's (grad "
            "norm 2.337 against 2.353 at the first iteration of the tiny GPT)",
            read=lambda source, side: bool(getattr(source, "defer_embedding_wgrad_compute", False)
                                           and getattr(source, "mtp_num_layers", None)),
            fix="remove --defer-embedding-wgrad-compute, or --mtp-num-layers",
            test="A `refused --defer-embedding-wgrad-compute`"),
    Refused("--moe-enable-routing-replay", "its process-wide list of routers would hold both copies of every MoE layer",
            arg="moe_enable_routing_replay", config="moe_enable_routing_replay", schedules=MIRRORED),
    Refused("--save-dgrads-interval",
            "it records the input gradients of 'the last micro-batch', which depends on the schedule's order",
            arg="save_dgrads_interval", is_set=lambda v: v is not None),
    Refused("--use-ring-exchange-p2p", "the executor posts its own batched point-to-point operations",
            arg="use_ring_exchange_p2p", config="use_ring_exchange_p2p", schedules=EXECUTOR),
    Refused("--fine-grained-activation-offloading", "its offload handlers are advanced and reset by Megatron's own "
            "schedules", arg="fine_grained_activation_offloading", config="fine_grained_activation_offloading",
            schedules=EXECUTOR),
    Refused("--num-distributed-optimizer-instances",
            "above 1 with --overlap-grad-reduce: megatron-core's partial distributed optimizer reduces without "
            "leaving a handle, and the gradient sync at the end of the schedule reduced every bucket a second time "
            "(wrong gradients, no error: shard means 6.0 and 6.5 where the data-parallel mean is 10.0)",
            read=lambda source, side: (getattr(source, "use_distributed_optimizer", False)
                                       and getattr(source, "overlap_grad_reduce", False)
                                       and (getattr(source, "num_distributed_optimizer_instances", 1) or 1) > 1),
            sides=(ARGS, DDP), schedules=EXECUTOR,
            fix="set --num-distributed-optimizer-instances 1 (DistributedDataParallelConfig."
                "num_distributed_optimizer_instances), or remove --overlap-grad-reduce",
            test="A `refused --num-distributed-optimizer-instances`; E `partial_distributed_optimizer_with_overlap`"),
    TE_BIASES_IN_W,
    Refused("--moe-layer-freq", "megatron-core 0.16.1 prints the MoE load_balancing_loss of a last pipeline rank "
            "without MoE layers unaveraged over data parallel, and dualpipev's last rank holds V-stages pp-1 and pp",
            read=_v_last_rank_without_moe_before_019, sides=(ARGS,),
            schedules=(registry.DUALPIPEV,),
            fix="give V-stages pp-1 and pp a MoE layer, use megatron-core 0.19.x, or use --pipeline-schedule dualpipe"),
    Refused("--inprocess-restart", "a restart inside the process would rebuild the process groups but not DualPipe's "
            "bd groups", arg="inprocess_restart"),
    Refused("--moe-use-upcycling", "upcycling loads a dense one-chunk model and converts it in place",
            arg="moe_use_upcycling"),
    # What megatron-core's combined step needs besides a virtual pipeline (its TransformerConfig
    # checks, minus pp/vpp and bf16/fp16: mcore.overlap; CUDA graphs are refused above).
    Refused("--expert-model-parallel-size", "it overlaps the expert-parallel all-to-all",
            read=lambda source, side: (getattr(source, "expert_model_parallel_size", 1) or 1) <= 1,
            fix="set --expert-model-parallel-size > 1", needs=COMBINED_STEP,
            test="A `dualpipe_overlap_moe_needs_ep`"),
    Refused("--num-experts", "it needs an MoE model", fix="set --num-experts", needs=COMBINED_STEP,
            read=lambda src, side: getattr(src, "num_experts" if side == ARGS else "num_moe_experts", None) is None,
            test="tests/mcore/test_overlap.py"),
    Refused("--moe-token-dispatcher-type", "it needs --moe-token-dispatcher-type alltoall or flex",
            read=lambda source, side: getattr(source, "moe_token_dispatcher_type", None) not in ("alltoall", "flex"),
            fix="set --moe-token-dispatcher-type alltoall", needs=COMBINED_STEP,
            test="A `dualpipev_overlap_moe_allgather`; tests/mcore/test_overlap.py"),
    Refused("--recompute-granularity full", "it cannot recompute full layers",
            read=lambda source, side: (getattr(source, "recompute_granularity", None) == "full"
                                       or bool(getattr(source, "recompute_method", None))
                                       or bool(getattr(source, "recompute_num_layers", None))),
            fix="remove --recompute-granularity full / --recompute-method / --recompute-num-layers",
            needs=COMBINED_STEP, test="—"),
    Refused("--recompute-modules moe", "it cannot recompute whole MoE layers (--recompute-modules moe): its fused "
            "F&B units run a layer's parts one by one (router, dispatch, experts, combine), never the checkpointed "
            "layer, so nothing would be recomputed (megatron-core 0.19 refuses the pair in its own check)",
            read=lambda source, side: getattr(source, "recompute_granularity", None) == "selective" and (
                "moe" in (getattr(source, "recompute_modules", None) or ())
                or bool(getattr(source, "moe_layer_recompute", False))),  # megatron-core's way to add moe
            fix="remove moe from --recompute-modules (and --moe-layer-recompute)", needs=COMBINED_STEP,
            test="A `dualpipe_overlap_moe_recompute_moe`"),
    Refused("--mtp-num-layers", "it runs at most one MTP layer (megatron-core's own limit)",
            read=lambda source, side: (getattr(source, "mtp_num_layers", None) or 0) > 1, fix="set --mtp-num-layers 1",
            needs=COMBINED_STEP, test="A `dualpipe_overlap_moe_two_mtp_layers`"),
    Refused("--mtp-num-layers", "in half precision its MTP layer in the combined step is not equal to 1F1B (the tiny "
            "MoE's lm loss 1e-4 apart at iteration 3, local and TE layers alike; Megatron's own interleaved 1F1B with "
            "the flag gives NaN at iteration 2 there); fp32 is equal",
            read=lambda source, side: bool(getattr(source, "mtp_num_layers", None))
            and bool(getattr(source, "bf16", False) or getattr(source, "fp16", False)),
            fix="remove --mtp-num-layers, or --overlap-moe-expert-parallel-comm", needs=COMBINED_STEP,
            test="A `dualpipe_overlap_moe_mtp_half_precision`"),
    Refused("--moe-shared-expert-overlap", "it cannot be combined with --moe-shared-expert-overlap",
            arg="moe_shared_expert_overlap", config="moe_shared_expert_overlap", fix="remove it",
            needs=COMBINED_STEP, test="—"),
) + _needs_of_a_dualpipe_flag(
    # What --dualpipe-shared-shard-group (a Megatron-LM flag: args only) runs with so far.
    SHARED_SHARDS, "A `shared shard group refuses ...`", (
        ("--use-distributed-optimizer", "the shard group is the distributed optimizer's, which is off",
         lambda a: not getattr(a, "use_distributed_optimizer", False), "set --use-distributed-optimizer"),
        ("--overlap-grad-reduce", "DDP's hooks would start each chunk's reduce-scatter when its gradients are "
         "ready, stage i first on rank i and stage pp-1-i first on its partner, over communicators that span the "
         "same ranks (a deadlock on NCCL)", lambda a: getattr(a, "overlap_grad_reduce", False),
         "remove --overlap-grad-reduce"),
        ("--overlap-param-gather", "the forward pre-hooks would start the all-gathers in each rank's chunk order, "
         "which differs between the partners", lambda a: getattr(a, "overlap_param_gather", False),
         "remove --overlap-param-gather"),
        ("--num-distributed-optimizer-instances", "above 1; the shard group is one optimizer instance",
         lambda a: (getattr(a, "num_distributed_optimizer_instances", 1) or 1) > 1,
         "set --num-distributed-optimizer-instances 1"),
        ("--ddp-average-in-collective", "an average over both copies' ranks would halve the sum of the copies",
         lambda a: getattr(a, "ddp_average_in_collective", False), "remove --ddp-average-in-collective"),
        ("--ckpt-format", "the shared layout's optimizer state is written and read in --ckpt-format torch, and "
         "torch_dist keyed by parameter (--dist-ckpt-optim-fully-reshardable; Megatron's default keys it by grad "
         "buffer, whose layout is per shard group)",
         lambda a: (getattr(a, "save", None) is not None or getattr(a, "load", None) is not None)
         and getattr(a, "ckpt_format", "torch_dist") != "torch" and not (
             getattr(a, "ckpt_format", "torch_dist") == "torch_dist"
             and getattr(a, "dist_ckpt_optim_fully_reshardable", False)),
         "use --ckpt-format torch, or torch_dist with --dist-ckpt-optim-fully-reshardable"),
        ("--num-experts with --save / --load", "the expert layers' optimizer state in checkpoints is not yet "
         "proven equal to 1F1B's with it",
         lambda a: getattr(a, "num_experts", None) is not None
         and (getattr(a, "save", None) is not None or getattr(a, "load", None) is not None),
         "remove --save and --load, or remove --dualpipe-shared-shard-group for MoE models"),
        ("--optimizer", "only adam and sgd build Megatron's distributed optimizer chunk by chunk",
         lambda a: getattr(a, "optimizer", "adam") not in ("adam", "sgd"), "use --optimizer adam or sgd"),
        ("--context-parallel-size", "context parallelism is not yet proven equal to 1F1B with it",
         lambda a: (getattr(a, "context_parallel_size", 1) or 1) > 1,
         "set --context-parallel-size 1, or remove --dualpipe-shared-shard-group"),
        ("--expert-tensor-parallel-size", "an expert tensor-parallel size other than the tensor-parallel size is "
         "not yet proven equal to 1F1B with it",
         lambda a: getattr(a, "num_experts", None) is not None and getattr(a, "expert_tensor_parallel_size", None)
         not in (None, getattr(a, "tensor_model_parallel_size", 1)),
         "remove --expert-tensor-parallel-size, or remove --dualpipe-shared-shard-group"),
        ("--fp16", "its loss scaler is not yet proven equal to 1F1B with it", lambda a: getattr(a, "fp16", False),
         "use --bf16, or remove --dualpipe-shared-shard-group"),
        ("--use-precision-aware-optimizer / --fp8-param-gather", "not yet proven equal to 1F1B with it",
         lambda a: getattr(a, "use_precision_aware_optimizer", False) or getattr(a, "fp8_param_gather", False),
         "remove them, or remove --dualpipe-shared-shard-group"),
        ("--data-parallel-random-init", "not yet proven equal to 1F1B with it",
         lambda a: getattr(a, "data_parallel_random_init", False), "remove --data-parallel-random-init"),
        ("--tensor-parallel-num-weight-shards", "a gradient buffer's replicate group is then not its data-"
         "distribution group, and neither is proven with it",
         lambda a: (getattr(a, "gtp_weight_remat_size", 1) or 1) > 1,
         "remove --tensor-parallel-num-weight-shards, or remove --dualpipe-shared-shard-group"),
        ("--use-nccl-ub", "its warm-up all-reduce runs over each chunk's group in chunk order",
         lambda a: getattr(a, "use_nccl_ub", False), "remove --use-nccl-ub"),
    )
) + _needs_of_a_dualpipe_flag(
    # What --dualpipe-dp-first (a Megatron-LM flag: args only) runs with so far.
    DP_FIRST, "A `dp-first refuses ...`", (
        ("--use-distributed-optimizer", "the shards it sums are the distributed optimizer's, which is off (without "
         "it the pair would carry the whole gradient either way)",
         lambda a: not getattr(a, "use_distributed_optimizer", False), "set --use-distributed-optimizer"),
        ("--num-distributed-optimizer-instances", "above 1 is not yet proven equal to 1F1B with it",
         lambda a: (getattr(a, "num_distributed_optimizer_instances", 1) or 1) > 1,
         "set --num-distributed-optimizer-instances 1, or remove --dualpipe-dp-first"),
        ("--ddp-reduce-scatter-with-fp32-accumulation", "not yet proven equal to 1F1B with it",
         lambda a: getattr(a, "ddp_reduce_scatter_with_fp32_accumulation", False),
         "remove it, or remove --dualpipe-dp-first"),
    )
)


def flag_on(flag: str, source) -> bool:
    """Whether Megatron-LM's switch ``flag`` is on in ``source`` (args, or a config's same-named field)."""
    return bool(getattr(source, flag[2:].replace("-", "_"), False))


def problems(source, schedule: str, side: str) -> List[str]:
    """Messages (without the schedule's name) for every rule of :data:`REFUSED` that ``source`` breaks under
    ``schedule``; a ``needs`` rule only while its flag is on, prefixed with the flag."""
    return [f"{rule.needs}: {rule.message()}" if rule.needs else rule.message() for rule in REFUSED
            if schedule in rule.schedules and rule.applies(side) and (not rule.needs or flag_on(rule.needs, source))
            and rule.is_set(rule.value(source, side))]


def combined_step_problems(source, side: str = CONFIG) -> List[str]:
    """What megatron-core's combined step needs that ``source`` lacks, whether or not the flag is on yet."""
    return [rule.message() for rule in REFUSED if rule.needs == COMBINED_STEP and rule.value(source, side)]


def args_rules() -> Tuple[Refused, ...]:
    """The single-option rules checked on Megatron-LM's ``args`` (each has a refused case in
    tests/megatron_lm/test_megatron_lm.py)."""
    return tuple(r for r in REFUSED if r.applies(ARGS) and not r.needs)


#: Options that run, with what was compared and the test that compares it. Test files: ``A`` =
#: tests/megatron_lm/test_megatron_lm.py, ``D`` = tests/megatron_lm/test_megatron_lm_dualpipe.py, ``O`` =
#: tests/megatron_lm/test_megatron_lm_options.py, ``C`` = tests/megatron_lm/test_megatron_lm_cpu.py, ``M`` =
#: tests/mcore/test_dualpipe_megatron.py, ``E`` = tests/mcore/test_errors.py.
HANDLED: Tuple[Handled, ...] = (
    Handled('(defaults: tied embeddings, zero bubble) `dualpipe`, `executor-1f1b`, `zb-h1`',
            'equal on CPU',
            'D `test_executor_1f1b_and_zb_h1_losses_equal_megatron_1f1b`, `test_torch_checkpoint_switches_schedules`'),
    Handled('Uneven stages under `dualpipe`: `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`, '
            '`--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`, '
            '`--pipeline-model-parallel-layout` with one stage per rank',
            'equal on CPU, every printed metric (pp=4: 1+4+4+1 of 10 layers; embedding and loss as layers; a layout); '
            'each rank holds 1F1B\'s stage i and pp-1-i. The one-chunk executor schedules refuse them',
            'D `test_uneven_stages_equal_megatron_1f1b`; A `dualpipe_uneven_stages_ok`'),
    Handled('Uneven V-stages under `dualpipev`: `--pipeline-model-parallel-layout` of 2 * pp V-stages (rank i holds '
            'V-stages i and 2pp-1-i), `--account-for-embedding-in-pipeline-split` / '
            '`--account-for-loss-in-pipeline-split` (Megatron\'s interleaved meaning: the embedding and the loss '
            'count as a layer of V-stages 0 and 2pp-1, both on rank 0; (layers + counted) divisible by 2 * pp)',
            'equal on CPU, every printed metric (pp=2, 6 layers: a layout E|tttt|tt|L, rank 0 holding only the '
            'embedding and the output layer; embedding and loss as layers), against Megatron\'s 1f1b on the same '
            'model (its stage t = V-stages 2t, 2t+1), both from one '
            'torch checkpoint. Refused before training, naming a layout that works: a layout of another stage '
            'count than pp (dualpipe) or 2 * pp (dualpipev), `--decoder-first/last-pipeline-num-layers` under '
            'dualpipev (Megatron\'s interleaved meaning puts the first stage\'s layers on ranks 0 and pp-1)',
            '`tests/megatron_lm/test_megatron_lm_dualpipev.py` `test_dualpipev_uneven_v_stages_equal_megatron_1f1b`; A `dualpipev_layout_ok`, '
            '`dualpipev_layout_of_pp_stages`, `dualpipe_layout_of_2pp_stages`, `dualpipev_first_last_stage`'),
    Handled('`--position-embedding-type rope` (`--rotary-base`, `--rotary-percent`), `--swiglu`, '
            '`--normalization RMSNorm`, `--untie-embeddings-and-output-weights` (the shipped configs\' architecture)',
            'equal on CPU, every printed metric, at both tags (CPU mode moves RoPE\'s inverse frequencies to the CPU)',
            'D `test_dualpipe_and_megatron_1f1b_equal_on_the_users_architecture` (smoke)'),
    Handled("DeepSeek-V3's recipe: `--multi-latent-attention` (`--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`, "
            '`--qk-pos-emb-head-dim`, `--v-head-dim`) with YaRN (`--rope-type yarn`, `--rotary-scaling-factor`, '
            '`--mscale`, `--mscale-all-dim`), `--moe-router-score-function sigmoid` with '
            '`--moe-router-enable-expert-bias`, `--moe-router-num-groups` / `--moe-router-group-topk`, '
            '`--moe-router-topk-scaling-factor`, `--moe-shared-expert-intermediate-size`, `--moe-layer-freq` (dense '
            'first layers), `--moe-router-load-balancing-type seq_aux_loss`; `--position-embedding-type yarn` '
            '(core_v0.19.0)',
            'equal on CPU at both tags, all at once with expert parallel 2 x pp=2, 4 micro-batches: `dualpipe` from '
            "the start, `dualpipev` from 1f1b's checkpoint, every printed metric (lm loss within 1e-6, its print's "
            "last digit; the others 0) and every copy of every router's `expert_bias` (a perturbed option on one "
            'side fails it); MLA + YaRN at both tags (smoke). CPU mode: the local attention takes MLA\'s head '
            "sizes, as TE's does",
            '`tests/megatron_lm/test_megatron_lm_v3_recipe.py`'),
    Handled('`--mtp-num-layers` 1 and 2 (multi-token prediction), tied or untied output weights; one layer with '
            '`--overlap-moe-expert-parallel-comm`; one layer under `executor-1f1b` and `zb-h1`',
            "equal on CPU, every printed metric including `mtp_N loss` (largest difference 1e-6, its print's last "
            "digit), at both tags: `dualpipe` from the start (MTP on both copies of stage pp-1), `dualpipev` from "
            "1f1b's torch_dist checkpoint (MTP on rank 0's V-stage 2pp-1, beside the embedding) and 1f1b from "
            "dualpipev's, tied dualpipev from 1f1b's torch checkpoint, `--dualpipe-shared-shard-group` and "
            "`--dualpipe-dp-first`, uneven stages (`--decoder-first/last-pipeline-num-layers`) under `dualpipe`, the "
            "fused F&B units with one layer. Refused before training: MTP with context "
            "parallelism, with `--pipeline-model-parallel-layout`, and more than one MTP layer in the fused units",
            '`tests/megatron_lm/test_megatron_lm_mtp.py`; A `dualpipe_mtp_ok`, `dualpipev_two_mtp_layers_ok`, '
            '`dualpipe_overlap_moe_two_mtp_layers`'),
    Handled('`dualpipev` with `--bf16` / `--fp16` (loss scaling), the distributed optimizer with overlapped grad '
            'reduce and param gather, tp=2 + SP, MoE EP2, torch_dist checkpoints across schedules',
            "equal on CPU at core_v0.19.0 from 1f1b's weights, every printed metric (0 difference); its torch_dist "
            "checkpoint writes the tied output weight once; another layout's dp_reshardable optimizer state is "
            "refused at load naming `--dist-ckpt-optim-fully-reshardable` / `--no-load-optim`",
            '`tests/megatron_lm/test_megatron_lm_dualpipev.py`'),
    Handled('`--overlap-moe-expert-parallel-comm` (and `--delay-wgrad-compute`) with `dualpipe`, `dualpipev`',
            "accepted: fused F&B units through megatron-core's combined step (`mcore/overlap.py`); its "
            'requirements are refused below',
            '`tests/megatron_lm/test_megatron_lm_overlap.py`; `tests/mcore/test_overlap.py`'),
    Handled('`--no-dualpipe-zero-bubble`',
            'equal on CPU',
            'O `overlap-grad-reduce, pp=2 x dp=2, no zero bubble`; M'),
    Handled('`--untie-embeddings-and-output-weights`',
            'equal on CPU',
            'O `untied, full recompute, ...`'),
    Handled('`--recompute-granularity full` (`--recompute-method uniform`, `--recompute-num-layers 1`)',
            'equal on CPU',
            'O `untied, full recompute, ...`'),
    Handled('`--recompute-granularity selective`',
            'equal on CPU',
            'O `MoE aux-loss-free ...`'),
    Handled('`--recompute-modules` `core_attn`, `mlp`, `layernorm`, `moe_act`, `moe`, `shared_experts`, `mla_up_proj` '
            '(selective recomputation) with Transformer Engine layers and zero bubble through `--delay-wgrad-compute`',
            "equal on CPU at both tags, every printed metric (lm loss and mtp_1 loss within 1e-6, their print's last "
            "digit; the others 0): `dualpipe` from the start, `dualpipev` from 1f1b's checkpoint. `moe` recomputes "
            "the MoE layer (its all-to-all again) in B, with grouped GEMM and overlapped shared experts; "
            "`shared_experts` and `mla_up_proj` in the fused F&B units with MTP. Refused: `moe` with "
            "`--overlap-moe-expert-parallel-comm` (below); `shared_experts` with `--moe-shared-expert-overlap` is "
            "megatron-core's own refusal; `gdn_norm_out` (core_v0.19.0) needs `--experimental-attention-variant`, "
            "refused",
            '`tests/megatron_lm/test_megatron_lm_te.py` `MoE EP2, grouped GEMM, ...`, `MoE EP2, shared experts, MLA, ...`'),
    Handled('`--calculate-per-token-loss`',
            'equal on CPU',
            'O `untied, full recompute, ...`'),
    Handled('`--decoupled-lr`',
            'equal on CPU (both copies of the embedding / output layer get it)',
            'O `untied, full recompute, ...`'),
    Handled('`--log-params-norm`',
            'equal on CPU in every run the tests compare (they all log it): dualpipe, the shared shard group '
            'and dp-first, fp32 and bf16 (pp=2 x dp=2, distributed optimizer), tied and untied, MoE. DualPipe '
            'counts `model[0]` (with MoE the mirror asserted before); under the shared shard group with `--bf16` '
            "it reads the fp32 main parameters, sharded over both copies' ranks, and the mirror's shards count "
            "too (before: 16.820 for 1F1B's 25.122). With `--overlap-param-gather` Megatron logs it before the "
            "deferred all-gather, under 1f1b too (25.120 for 25.122): such runs are compared with 1f1b with the "
            "same flags",
            'C `test_bf16`, `test_shared_shard_group_tp2_bf16_per_token_loss_untied_equals_1f1b`; O; D'),
    Handled('`--log-num-zeros-in-grad`',
            'equal on CPU up to eight elements (every compared run logs it; observed 0 to 5): the key bias '
            'gradient, mathematically 0, whose rounding residue lands on 0.0 or not by summation order '
            '(docs/megatron-lm-cpu.md). Not compared with `--fp16` (printed): fp16 gradients accumulate in fp16 '
            'and each copy sums its own micro-batches before the bd sum, so which elements cancel to exactly 0.0 '
            'depends on that order (4 of ~15 apart at core_v0.19.0, 9 at core_v0.16.1)',
            'C; O; D'),
    Handled('`--overlap-grad-reduce` (`--no-align-grad-reduce` works, without overlap)',
            'equal on CPU: pp=4, and pp=2 x dp=2 (zero bubble on and off)',
            'O; M `test_overlap_grad_reduce_pp2_dp2_ddp_equals_single_process`'),
    Handled('`--overlap-grad-reduce` with `dualpipev` and tied embeddings',
            "equal on CPU (from 1f1b's weights)",
            'D `test_resume_without_optimizer_state_and_dualpipev_across_1f1b`; M'),
    Handled('`--num-experts` (alltoall dispatcher), `--moe-aux-loss-coeff` (`aux_loss`), `--moe-z-loss-coeff`',
            'equal on CPU, aux losses included: expert parallel 2 x pp=2 (pp=4 MoE: the quantile-balancing '
            'case, core_v0.19.0)',
            'O `MoE EP2 x pp=2, aux loss, z-loss`, `test_quantile_balancing_dualpipe_equals_1f1b`'),
    Handled('`--expert-model-parallel-size 2` (alltoall dispatcher, pp=2, 4 ranks)',
            'equal on CPU (lm loss, aux losses, grad norm, params norm; max difference 0)',
            'O `MoE EP2 x pp=2, ...` (both)'),
    Handled('`--moe-router-enable-expert-bias` (aux loss, and aux-loss-free `--moe-router-load-balancing-type '
            'none`)',
            'equal on CPU, EP2 x pp=2 (token counts summed over the bd pair; without it lm loss '
            "differs by 1.3e-3 at iteration 2); every copy of every router's `expert_bias` (2 "
            "directions x 2 expert ranks) equals 1f1b's after each iteration",
            'O `MoE EP2 x pp=2, aux-loss-free ...`'),
    Handled('`--moe-router-load-balancing-type quantile_balancing` (core_v0.19.0)',
            "equal on CPU, pp=4 (each router's per-micro-batch quantile sums and counts are summed over "
            'the bd pair before Megatron moves `qb_beta`; without it lm loss differs by 2.7e-4 at iteration 3)',
            'O `test_quantile_balancing_dualpipe_equals_1f1b`'),
    Handled('`--moe-per-layer-logging`',
            'the summed aux losses are equal on CPU; per-layer values go to tensorboard only',
            'D'),
    Handled('`--eval-iters`, `--eval-interval`',
            'equal on CPU',
            'D `test_evaluation_losses_equal_and_advice_logged_once`'),
    Handled('`--ckpt-format torch` save / `--load` across 1f1b and dualpipe, `--no-load-optim`',
            'equal on CPU',
            'D `test_torch_checkpoint_switches_schedules`, '
            '`test_resume_without_optimizer_state_and_dualpipev_across_1f1b`'),
    Handled('`dualpipev` loads a 1f1b torch checkpoint (layers remapped to its V-stages), 1f1b loads a '
            'dualpipev one',
            'equal on CPU (weights; optimizer state across the layouts is refused: `--no-load-optim`)',
            'D `test_resume_without_optimizer_state_and_dualpipev_across_1f1b`'),
    Handled('`--moe-router-load-balancing-type global_aux_loss` with `dualpipev`',
            'accepted (each chunk runs its micro-batches in order); not compared',
            'A `global_aux_loss_dualpipev_ok`'),
    Handled('`--use-distributed-optimizer` (dp=2), with `--overlap-grad-reduce --overlap-param-gather`',
            'equal on CPU (lm loss and grad norm, 4 iterations, pp=2 x dp=2); with `--overlap-param-gather` '
            "(`--align-param-gather`, the default, kept for dualpipe/dualpipev) the executor calls "
            "`config.param_sync_func` for both chunks before the first action, so each chunk's all-gathers are "
            "started at its first forward (every process says so; megatron-core: the shards a replica does not "
            "own NaN before each run, losses and gradients equal to the reference)",
            'C `test_distributed_optimizer_dualpipe_overlap_and_torch_format_across_schedules`; M '
            '`test_overlap_param_gather_pp2_dp2_starts_every_gather_before_its_chunks_first_forward`; D '
            '`test_resume_without_optimizer_state_and_dualpipev_across_1f1b` (`--load --no-load-optim`, dp=1)'),
    Handled('`--dualpipe-shared-shard-group` (`dualpipe`, `--use-distributed-optimizer`): both copies of a stage '
            'in one distributed-optimizer group',
            "equal on CPU (every printed metric, params norm and zeros included: pp=2 x dp=2, fp32 and bf16, tied "
            "embeddings; tp=2 with sequence parallelism, bf16, per-token loss, untied embeddings; MoE with expert parallel 2 (aux and z losses, "
            "params norm)); each rank's optimizer state is a quarter of its two stages "
            "(1F1B's on average; half of dualpipe without it); the shard groups' collectives in one stage order on "
            "every rank (checked with NCCL's rules); checkpoints in 1F1B's files, `--ckpt-format torch` and "
            "`torch_dist --dist-ckpt-optim-fully-reshardable` (1f1b's keys): shared -> 1f1b -> shared continues "
            "the uninterrupted curve (with torch, to the iteration after its own resume: the optimizer state it "
            "saved and loaded both show), and its torch_dist checkpoint after a resume equals 1f1b's tensor for "
            "tensor (1e-7). "
            "What it does not run with yet is refused above",
            'C `test_shared_shard_group_equals_1f1b_holds_its_optimizer_state_and_resumes_across_schedules`, '
            '`test_shared_shard_group_torch_dist_checkpoints_across_schedules`, '
            '`test_shared_shard_group_tp2_bf16_per_token_loss_untied_equals_1f1b`, `test_bf16`; O `MoE EP2 x '
            'pp=2, aux loss, z-loss`'),
    Handled('`--dualpipe-dp-first` (`dualpipe`, `--use-distributed-optimizer`): each copy reduce-scattered over its '
            'replicas first, the bd pair sums the 1/dp shards',
            "equal on CPU (every printed metric, params norm and zeros included: pp=2 x dp=2, fp32, tied "
            "embeddings, with `--overlap-grad-reduce --overlap-param-gather`; bf16 with `--overlap-grad-reduce`; MoE with expert parallel 2, aux and z losses, no "
            "overlap); every collective of the run in one order (NCCL's rules), every pair sum a reduce-scatter's "
            "shard (half the bytes at dp=2); its torch_dist checkpoint (dp_reshardable) resumed by 1f1b continues "
            "the curve. What it does not run with yet is refused above",
            'C `test_dp_first_equals_1f1b_and_torch_dist_optimizer_state_crosses_schedules`, `test_bf16`; O `MoE '
            'EP2 x pp=2, aux loss, z-loss`'),
    Handled('`dualpipev` with `--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather` (dp=2)',
            "equal on CPU to dualpipev dp=1 (its own initialisation); the chunks' reduce-scatters start during "
            'the schedule (they were reduced twice before: lm loss 2.6e-4 off)',
            'C `test_dualpipev_distributed_optimizer_overlap_equals_dualpipev_alone`'),
    Handled('`--use-distributed-optimizer` with `--ckpt-format torch`, optimizer state across schedules '
            '(dualpipe -> 1f1b -> dualpipe, dp=2)',
            "equal on CPU: the resumed curve is the uninterrupted one (`distrib_optim.pt` holds model[0]'s "
            "buffers as 1f1b lays it out; Megatron's own 1f1b needed three CPU-mode fixes to load it)",
            'C `test_distributed_optimizer_dualpipe_overlap_and_torch_format_across_schedules`'),
    Handled('`--ckpt-format torch_dist` with `--use-distributed-optimizer` (dp_reshardable), optimizer state '
            'across schedules (dualpipe -> 1f1b -> dualpipe, dp=2)',
            "equal on CPU; a dualpipe checkpoint has exactly 1f1b's keys (the mirror and its grad buffers are "
            "not written; loads sync them from the partner). A bucket layout that differs from 1f1b's (1f1b "
            '`--overlap-grad-reduce` with chunks > 40M parameters) is refused at load naming '
            '`--dist-ckpt-optim-fully-reshardable` / `--no-load-optim` (with '
            '`--dist-ckpt-optim-fully-reshardable`: equal on CPU by hand, both directions)',
            'C `test_dp_first_equals_1f1b_and_torch_dist_optimizer_state_crosses_schedules`; the refusal: '
            '`tests/megatron_lm/test_torch_dist_mirror.py`'),
    Handled('`--ckpt-format torch_dist` without the distributed optimizer (1f1b dp=1 -> dualpipe dp=2 -> 1f1b '
            'dp=2)',
            "equal on CPU (same keys as 1f1b's; the dp=2 save failed before: the fully parallel save made the "
            "mirror's tied output weight a main replica)",
            'C `test_torch_dist_without_distributed_optimizer_dp2_across_schedules`'),
    Handled('`--defer-embedding-wgrad-compute`, `--wgrad-deferral-limit` (with Transformer Engine layers and '
            '`--gradient-accumulation-fusion`; with MTP refused)',
            "equal on CPU: Megatron's drain (`finish_embedding_wgrad_compute`) runs per chunk before its bd sum, "
            "into main_grad through the CPU mode's apex stand-in (Megatron's own 1F1B with the local layers does not "
            "run it: their linears have no buffer); in a padded iteration (one real micro-batch per direction) a zero "
            "partner makes the one deferred entry two, which Megatron's drain needs",
            'T `test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b`'),
    Handled("`--transformer-impl transformer_engine` (zero bubble through TE's `delay_wgrad_compute` / "
            '`backward_dw`), with and without `--gradient-accumulation-fusion`',
            "equal on CPU through the CPU mode's Transformer Engine stand-in (TE's contract at 2.11 / 2.17: its "
            "first-in first-out wgrad queues, `main_grad` fusion; every TE queue checked empty after each "
            "iteration): dualpipe and dualpipev from 1f1b's checkpoint, every printed metric",
            'T `test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b`, '
            'T `test_te_dense_without_fusion_defers_every_weight_gradient_to_w`'),
    Handled('`--moe-grouped-gemm`, `--moe-shared-expert-overlap`, `--moe-token-dispatcher-type flex` '
            '(`--moe-enable-deepep`)',
            "equal on CPU with Transformer Engine's grouped experts (TEGroupedMLP), overlapped shared experts and "
            "the flex dispatcher on the CPU mode's stand-ins (TE, DeepEP over gloo all-to-all; at 0.16.1 the legacy "
            "GroupedMLP on the grouped_gemm stand-in equals SequentialMLP: tests/cpu). The legacy GroupedMLP's "
            "weight GEMMs are not deferred by zero bubble (`wgrad.find_undeferred_weights` reports it)",
            'T `test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b`; tests/cpu/test_deep_ep_stand_in.py, '
            'tests/cpu/test_grouped_gemm_stand_in.py'),
    Handled('`--fp8-format` with `--fp8-recipe tensorwise`',
            "equal on CPU through the stand-in's FP8 autocast, a no-op for the numerics (every recipe enters; the "
            "quantisation itself: GPU, the selftest's `--te --fp8` stage)",
            'T `test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b`'),
    Handled('`--first-last-layers-bf16` (with `--fp8-format`)',
            "equal on CPU through the stand-in's FP8 autocast (a no-op for the numerics, so the bf16 layers at the "
            "ends run as the others; the quantisation itself: GPU)",
            'T `test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b`'),
    Handled('`--bf16`',
            'equal on CPU (every printed metric bitwise equal to 1f1b `--bf16`, pp=2 x dp=2 with the distributed '
            'optimizer: dualpipe, the shared shard group, dp-first)',
            'C `test_bf16`'),
    Handled('`--fp16` (dynamic loss scaling), `--tensor-model-parallel-size 2 --sequence-parallel`',
            'equal on CPU (tested together: same loss scale and skipped iterations; lm loss within 1.9e-5 = '
            '3.5e-6 relative, fp16 gradients summed in another order)',
            'C `test_fp16_with_loss_scaling_tp2_sequence_parallel`'),
    Handled('`--check-for-nan-in-loss-and-grad` (default on; the rerun state machine)',
            'a NaN in the loss of one micro-batch (direction 1, so on rank 0) is caught in the same iteration '
            'with the same messages as under 1f1b; the step rerun, the job saved and stopped',
            'O `test_nan_in_one_microbatch_is_caught_as_under_1f1b`'),
    Handled('a rank SIGKILLed mid-iteration under `torchrun --max-restarts 1`, `--save-interval`, `--load`',
            'its pipeline neighbours stop with `P2PTimeoutError` naming it (0.1-0.2 s after the kill: gloo sees'
            ' the closed connection; the `--dualpipe-p2p-timeout` deadline covers a peer that hangs instead), '
            'the others name the neighbour that stopped (torchrun itself SIGTERMs the survivors as soon as its '
            'monitor sees the dead worker, often before they print; the test has them ignore it to check what '
            'they do on their own); the restart resumes from the last checkpoint and continues the '
            "uninterrupted loss curve exactly. torchrun's restart with gloo needs "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (with torchrun's shared store the restarted workers read "
            "the previous attempt's addresses: `Gloo connectFullMesh failed`, pytorch/pytorch#135712; not "
            'DualPipe-specific)',
            'O `test_rank_killed_mid_iteration_restarts_and_continues_the_curve`'),
    Handled('`--save-wgrads-interval`',
            "equal on CPU: every weight gradient it saves equals 1f1b's (bf16, pp=2 x dp=2, distributed "
            'optimizer: dualpipe with `--overlap-grad-reduce`, the shared shard group, dp-first with '
            '`--overlap-grad-reduce`; difference 0). DualPipe also saves `model_chunk1`, the mirror of stage '
            'pp-1-i, equal to that stage. In that iteration the executor leaves the data-parallel reduction to '
            "Megatron's finalize, which all-reduces (a reduce-scatter started early left the gradients outside "
            "the rank's shard partial), and dp-first sums whole buckets over the pair",
            'C `test_bf16`'),
)
