"""The collectives every rank issues after the schedule and around the optimizer step, as ops.

Why: after the schedule a rank issues a dozen collectives more every iteration on communicators
that overlap the pipeline's; two members issuing them in different orders hang on NCCL (or, where
the sizes agree, add unrelated tensors), and on one hardware queue a collective holds the rank's
later work. :func:`programs` gives each rank's ``coll KIND over GROUP`` ops in the order the code
issues them; ``iteration_plan.build`` checks them with the rest.

The order per rank (megatron-core 0.16.1 / 0.19.2 ``finalize_model_grads.py``, ``optimizer.py``,
``distrib_optimizer.py``, ``clip_grads.py``, Megatron-LM ``training.train_step``):

1. the rest of the finalize (``mcore.finalize``, then ``finalize_model_grads``): the routers'
   statistics summed over the bd pair per stage (expert bias, quantile balancing; the code sums
   them before the waits for ``GradReduction``'s reductions, the plan after); each chunk's
   data-parallel reduction without ``--overlap-grad-reduce`` (over its stage's shard group with
   ``--dualpipe-shared-shard-group``), then dp-first's shard sums over the bd pair, in stage
   order; the tensor-parallel all-reduce (sequence parallel, qk layernorm); the embedding group's
   (one-chunk schedules, tied embeddings); expert bias, quantile balancing; the token count's
   broadcast and all-reduce (per-token loss);
2. ``--dualpipe-advise``, once per job: the costs' max over the pipeline and the link probes;
3. Megatron-LM's rerun state machine (``--rerun-mode`` not ``disabled``): its any-rank
   all-reduce over the default group after the schedule (``--check-for-nan-in-loss-and-grad``'s
   checks are rank-local and travel in it); then, with ``--timing-log-level`` >= 1 and
   ``--barrier-with-L1-time``, the optimizer timer's barrier;
4. the optimizer step: per sub-optimizer (dense, experts; per stage under the shared shard
   group) fp16's found-inf, the grad norm and zero count over the gradient-statistics group (the
   distributed optimizer's instance, else model parallel), the parameter all-gathers after the
   step (distributed optimizer without ``--overlap-param-gather``);
5. Megatron-LM's train step: with ``--qk-clip`` or ``--log-max-attention-logit`` the largest
   logits' max over dp-cp, then success, grad norm and zero count over model parallel, the loss
   over data parallel on the last pipeline rank;
6. ``--log-params-norm`` (``calc_params_l2_norm``): the sharded main parameters' squared norms
   (core_v0.19.0: dense twice over dp-cp, experts twice over expert data parallel, then over
   expert-gtp; core_v0.16.1 a subset), then the sum over model parallel (the experts' over
   expert model parallel);
7. ``training_log``: per tracked MoE metric the sum over the pipeline, over its reduce group, the
   mean over data parallel (not the global load-balancing loss's); MTP's over dp-cp (ranks without
   such layers leave the last two out with every member of those groups); at a logging iteration
   the interval timer's barrier and, at timing level >= 1, the timers' all-gathers (two more with
   ``--log-timers-to-tensorboard``), over the default group;
8. ``--async-save``'s finalize all-reduce, ``--exit-signal-handler``'s all-gather and
   ``--exit-duration-in-mins``'s all-reduce, over the default group;
9. the drift check before the next call (``mcore.drift``), then its forward-backward timer's barrier.

Evaluation (forward only): the loss's sum over dp-cp on the last pipeline rank, then
``--exit-duration-in-mins``'s all-reduce. Optional collectives (advise, drift, zero count, the
logging iteration's) are in the plan every iteration: one every member leaves out only removes
waits. A group is its members within one replica (:func:`members`); ``iteration_plan.replicated``
joins replicas along the axes :data:`SPANS` names. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .copy_sum import BD_FIRST, CopySum, paired, stage_order
from .layout import Layout
from .lowering.ops import Op, OpKind, coll

#: communicator -> the replica axes it spans (``iteration_plan.replicated``). Megatron's groups, and
#: bd (a stage's two copies), embd (first and last pipeline rank), world (the distributed
#: optimizer's instance), shard:S / expt-shard:S (stage S's shared shard groups), default (every
#: rank of the job), expt-gtp (core_v0.19.0's expert GTP-remat group, within expert data parallel).
SPANS = {"pp": (), "bd": (), "embd": (), "mp": ("tp",), "expt-mp": ("tp",), "world": ("tp", "dp"),
         "default": ("tp", "dp"), "tp-cp": ("tp",), "expt-gtp": ("dp",),
         "tp": ("tp",), "dp": ("dp",), "dp-cp": ("dp",), "tp-dp-cp": ("tp", "dp"), "expt-dp": ("dp",),
         "shard": ("dp",), "expt-shard": ("dp",)}


@dataclass(frozen=True)
class StepOptions:
    """What decides the collectives after the schedule (``mcore.step_options`` reads them). Where a
    run cannot tell, the default issues the collective: more, alike on every member, prove fewer."""

    tp_grads: bool = False            # tp > 1 with sequence parallel or qk layernorm
    moe: bool = False                 # expert parameters: expert bucket groups and optimizer
    fp16: bool = False                # a loss scaler: the found-inf all-reduce
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    expert_bias: bool = False         # --moe-router-enable-expert-bias
    quantile_balancing: bool = False  # --moe-router-load-balancing-type quantile_balancing (0.19)
    copy_sum: CopySum = BD_FIRST      # how DualPipe's copies are summed (schedule.copy_sum)
    per_token_loss: bool = False      # --calculate-per-token-loss: the token count's collectives
    tied_embeddings: bool = False     # shared embedding and output weight (or MTP)
    drift_check: bool = False         # --dualpipe-drift-check-interval
    advise: bool = False              # --dualpipe-advise
    log_zeros: bool = True            # --log-num-zeros-in-grad
    megatron_lm: bool = True          # Megatron-LM's train step (its reductions after the step)
    rerun: bool = True                # Megatron-LM's --rerun-mode is not disabled (its default)
    params_norm: bool = False         # Megatron-LM's --log-params-norm
    moe_logged: Tuple[str, ...] = ()  # the MoE metrics training_log tracks, in its order
    mtp: bool = False                 # multi-token prediction layers (training_log's MTP metrics)
    exit_signal: bool = False         # Megatron-LM's --exit-signal-handler
    exit_duration: bool = False       # Megatron-LM's --exit-duration-in-mins
    async_save: bool = False          # Megatron-LM's --async-save (its finalization's all-reduce)
    qk_logits: bool = False           # --qk-clip or --log-max-attention-logit (clip_qk's all-reduces)
    timing_level: int = 0             # Megatron's timers' log level (--timing-log-level)
    l1_barrier: bool = True           # the level-1 timers' barriers (--barrier-with-L1-time, its default)
    timers_written: bool = False      # --log-timers-to-tensorboard


def comm_base(group: str) -> str:
    return group.split(":", 1)[0]


def members(layout: Layout, r: int, group: str) -> Tuple[int, ...]:
    """Rank ``r``'s communicator ``group`` within one replica of the pipeline."""
    base, pp = comm_base(group), layout.pp
    if base in ("pp", "mp", "expt-mp", "world", "default"):
        return tuple(range(pp))
    if base in ("bd", "shard", "expt-shard"):
        return tuple(sorted({r, layout.partner(r)}))
    if base == "embd":
        return (0, pp - 1)
    if base not in SPANS:
        raise ValueError(f"unknown communicator {group!r} (one of: {', '.join(SPANS)})")
    return (r,)


def programs(layout: Layout, opts: StepOptions, *, dp: int, overlap_grad_reduce: bool,
             forward_only: bool = False) -> List[Tuple[Op, ...]]:
    """Every rank's ops after the schedule's (module docstring)."""
    lm = opts.megatron_lm  # Megatron-LM's train step, its rerun state machine (``_reduce_any``) and logging
    if forward_only:
        return [tuple(_evaluation(layout, r, opts) if lm else ()) for r in range(layout.pp)]
    return [tuple(_finalize(layout, r, opts, dp, overlap_grad_reduce) + _advise(layout, r, opts, dp)
                  + ([coll("rerun", "default")] if lm and opts.rerun else [])
                  + _timer_barrier(opts, "optimizer", lm) + _optimizer(layout, r, opts, dp)
                  + (_train_step(layout, r, opts) + _params_norm(opts) + _logged(opts) + _timers_logged(opts)
                     + _exit(opts) if lm else [])
                  + _drift(layout, r, opts) + _timer_barrier(opts, "forward-backward", True))
            for r in range(layout.pp)]


def _advise(layout: Layout, r: int, opts: StepOptions, dp: int) -> List[Op]:
    if not opts.advise:
        return []
    out = [coll("advice-costs", "pp"), coll("probe-p2p", "pp")]
    out += [coll("probe-bd", "bd")] if paired(layout, r) else []
    return out + ([coll("probe-dp", "dp")] if dp > 1 else [])


def _finalize(layout: Layout, r: int, opts: StepOptions, dp: int, overlap: bool) -> List[Op]:
    """The finalize after its token all-reduce over the pipeline and the waits for the reductions
    ``GradReduction`` started (those the plan already holds)."""
    out: List[Op] = []
    if paired(layout, r) and (opts.expert_bias or opts.quantile_balancing):
        out += [coll(f"router-stats:{layout.stage_on(r, c)}", "bd") for c in stage_order(layout, r)]
    out += CopySum(opts.copy_sum).grad_syncs(layout, r, moe=opts.moe, dp=dp, overlap=overlap)
    if opts.tp_grads:
        out.append(coll("tp-grads", "tp"))
    if opts.tied_embeddings and len(layout.directions) == 1 and r in (0, layout.pp - 1):
        out.append(coll("embd-grads", "embd"))
    if opts.expert_bias:
        out.append(coll("expert-bias", "tp-dp-cp"))
    if opts.quantile_balancing:
        out.append(coll("qb-beta", "dp-cp"))
    if opts.per_token_loss:
        out += [coll("tokens-broadcast", "pp"), coll("tokens", "dp-cp")]
    return out


def _optimizer(layout: Layout, r: int, opts: StepOptions, dp: int) -> List[Op]:
    """``optimizer.step()``: found-inf per sub-optimizer (fp16), the grad norm and zero count over
    the gradient-statistics group (one all-reduce where every sub-optimizer shares it: the
    distributed optimizer's instance), the parameter all-gathers after the step."""
    way = CopySum(opts.copy_sum)
    subs = way.sub_optimizers(layout, r, opts.moe)

    def stats(expert: bool) -> str:
        return "world" if opts.distributed_optimizer else ("expt-mp" if expert else "mp")

    # keyed by the position in the chain: NCCL pairs the scalars' all-reduces by position, whatever
    # stage each rank's k-th sub-optimizer holds (the shared shard group's: not the same on all)
    out = [coll(f"found-inf:{k}", stats(e)) for k, (e, _) in enumerate(subs)] if opts.fp16 else []
    shared = len({stats(e) for e, _ in subs}) == 1
    for kind, wanted in (("grad-norm", True), ("zeros", opts.log_zeros)):
        if wanted:
            out += [coll(kind, stats(False))] if shared else [coll(f"{kind}:{k}", stats(e))
                                                               for k, (e, _) in enumerate(subs)]
    if opts.distributed_optimizer and not opts.overlap_param_gather:
        for _, chunks in subs:
            out += [op for c in chunks for op in way.param_gathers(layout, r, c, moe=opts.moe, dp=dp)]
    return out


def _train_step(layout: Layout, r: int, opts: StepOptions) -> List[Op]:
    out = [coll("qk-logits", "dp-cp")] if opts.qk_logits else []
    out += [coll("update-ok", "mp"), coll("grad-norm-max", "mp")]
    out += [coll("zeros-max", "mp")] if opts.log_zeros else []
    return out + ([coll("loss", "dp-cp")] if r == layout.pp - 1 else [])


def _params_norm(opts: StepOptions) -> List[Op]:
    """``calc_params_l2_norm``'s all-reduces (module docstring, 6)."""
    if not opts.params_norm:
        return []
    out = [coll(f"params-norm-sharded:{k}", "dp-cp") for k in range(2)]
    out += [coll(f"params-norm-expert-sharded:{k}", "expt-dp") for k in range(2)]
    out.append(coll("params-norm-gtp", "expt-gtp"))
    return out + [coll("params-norm", "mp")] + ([coll("params-norm-expert", "expt-mp")] if opts.moe else [])


def _logged(opts: StepOptions) -> List[Op]:
    """``training_log``'s MoE and MTP trackers (module docstring, 7)."""
    out: List[Op] = []
    for name in opts.moe_logged:
        overall = name == "global_load_balancing_loss"
        group = "tp-dp-cp" if overall or name == "z_loss" else "tp-cp"
        out += [coll(f"moe-log:{name}", "pp"), coll(f"moe-log-reduce:{name}", group)]
        out += [] if overall else [coll(f"moe-log-dp:{name}", "dp")]
    return out + ([coll(f"mtp-log:{k}", "dp-cp") for k in range(3)] if opts.mtp else [])


def _timer_barrier(opts: StepOptions, timer: str, issued: bool) -> List[Op]:
    """A level-1 timer's barrier at its start (``Timer.start(barrier=...)``)."""
    return [coll(f"timer-barrier:{timer}", "default")] if issued and opts.timing_level >= 1 and opts.l1_barrier else []


def _timers_logged(opts: StepOptions) -> List[Op]:
    """``training_log`` at a logging iteration: the interval timer's barrier, then the timers' all-gathers."""
    out = [coll("interval-barrier", "default")]
    if opts.timing_level >= 1:
        out += [coll(f"timers-write:{k}", "default") for k in range(2 if opts.timers_written else 0)]
        out.append(coll("timers-log", "default"))
    return out


def _evaluation(layout: Layout, r: int, opts: StepOptions) -> List[Op]:
    """``evaluate``'s collectives after a forward-only call (module docstring)."""
    out = [coll("eval-loss", "dp-cp")] if r == layout.pp - 1 else []
    return out + ([coll("exit-duration", "default")] if opts.exit_duration else [])


def _exit(opts: StepOptions) -> List[Op]:
    """``maybe_finalize_async_save``'s and ``checkpoint_and_decide_exit``'s collectives (module docstring, 8)."""
    wanted = (("async-save", opts.async_save), ("exit-signal", opts.exit_signal), ("exit-duration", opts.exit_duration))
    return [coll(kind, "default") for kind, on in wanted if on]


def _drift(layout: Layout, r: int, opts: StepOptions) -> List[Op]:
    return [coll(f"drift:{layout.stage_on(r, c)}", "bd") for c in stage_order(layout, r)] \
        if opts.drift_check and paired(layout, r) else []


def kinds(ops: Sequence[Op]) -> List[str]:
    """The kinds of ``ops``' collectives, without their stage or chunk (``reduce-scatter:3`` -> ``reduce-scatter``)."""
    return [op.what.split(":", 1)[0] for op in ops if op.kind is OpKind.COLL]
