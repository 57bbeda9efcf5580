"""``--pipeline-schedule`` and the DualPipe flags for Megatron-LM's argument parser (:func:`install`).
The checks run right after Megatron's ``validate_args``: they need the values it derives
(``data_parallel_size``, the virtual pipeline). Under ``1f1b`` ``args`` only gains the extra attributes.
"""

import functools
from typing import List

from .. import hooks, versions
from ..mcore import copies, options
from ..schedule import registry, stage_layout


class DualPipeArgumentError(ValueError):
    """An argument combination the DualPipe schedules cannot run."""


def add_dualpipe_arguments(parser):
    """Add the DualPipe flags to an ``argparse`` parser and return it (idempotent)."""
    if any("--pipeline-schedule" in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="DualPipe pipeline schedule (megatron_dualpipe)")
    group.add_argument("--pipeline-schedule", type=str, default=registry.DEFAULT, choices=registry.NAMES,
                       help="Pipeline schedule. " + "; ".join(f"{s.name}: {s.summary}" for s in registry.SPECS.values())
                       + ".")
    group.add_argument("--dualpipe-zero-bubble", action="store_true", dest="dualpipe_zero_bubble", default=True,
                       help="Split backward into input-grad and deferred weight-grad steps (default).")
    group.add_argument("--no-dualpipe-zero-bubble", action="store_false", dest="dualpipe_zero_bubble",
                       help="Run the full backward (input and weight grads) in one step.")
    group.add_argument("--dualpipe-p2p-timeout", type=float, default=None, metavar="SECONDS",
                       help="Timeout in seconds for one DualPipe step's batched P2P exchange "
                       "(default: the process group timeout, --distributed-timeout-minutes).")
    group.add_argument("--dualpipe-advise", action="store_true",
                       help="After the warm-up (--dualpipe-advise-warmup), log which schedule megatron-dualpipe "
                       "advise chooses for the stage costs and memory the next training iterations measured "
                       "(executor schedules).")
    group.add_argument("--dualpipe-advise-warmup", type=int, default=None, metavar="N",
                       help="Training iterations --dualpipe-advise skips before measuring (default 3: their units "
                       "carry one-time costs).")
    group.add_argument("--dualpipe-drift-check-interval", type=int, default=0, metavar="N",
                       help="dualpipe: every N training iterations, check that both copies of every stage are "
                       "bit-identical (a checksum per parameter over each bd pair; the error names the first "
                       "parameter that differs). 0 (default): off.")
    group.add_argument("--dualpipe-shared-shard-group", action="store_true",
                       help="dualpipe with --use-distributed-optimizer: the two copies of every stage share one "
                       "distributed-optimizer group (2 x data-parallel ranks), so a rank holds 1F1B's optimizer state "
                       "instead of twice it, and the copies are summed by the reduce-scatter the optimizer does "
                       "anyway (docs/design-shared-shard-group.md).")
    group.add_argument("--dualpipe-dp-first", action="store_true",
                       help="dualpipe with --use-distributed-optimizer: reduce-scatter each copy of a stage over its "
                       "data-parallel replicas first, then sum the two copies over the bd pair on the 1/dp shards (the "
                       "pair carries 1/dp of the gradient bytes; cheapest where the pair crosses nodes and the "
                       "replicas do not; the optimizer state stays twice 1F1B's: --dualpipe-shared-shard-group saves "
                       "that).")
    return parser


def schedule_of(args) -> str:
    """The ``--pipeline-schedule`` of ``args`` (the registry's default when it has none)."""
    return getattr(args, "pipeline_schedule", None) or registry.DEFAULT


def advise_problems(args) -> list:
    """--dualpipe-advise-warmup: not negative, and leaving measured iterations within --train-iters."""
    from megatron_dualpipe.mcore.live_advice import DEFAULT_WARMUP, MEASURED_ITERATIONS

    warmup = getattr(args, "dualpipe_advise_warmup", None)
    if warmup is not None and warmup < 0:
        return [f"--dualpipe-advise-warmup must be >= 0, got {warmup}"]
    iters = getattr(args, "train_iters", None)
    needed = (DEFAULT_WARMUP if warmup is None else warmup) + MEASURED_ITERATIONS
    if getattr(args, "dualpipe_advise", False) and iters is not None and iters < needed:
        fit = iters - MEASURED_ITERATIONS
        how = f"--dualpipe-advise-warmup {fit}" if fit >= 0 else f"--train-iters {needed}"
        return [f"--dualpipe-advise measures {MEASURED_ITERATIONS} training iterations after a warm-up of "
                f"{needed - MEASURED_ITERATIONS}, more than --train-iters {iters}: use {how}"]
    return []


#: The options that split the layers over the stages unevenly (Megatron-LM checks the split).
UNEVEN_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                "pipeline_model_parallel_layout")


def layout_problems(args) -> List[str]:
    """A ``--pipeline-model-parallel-layout`` of another stage count than the two-chunk schedule runs,
    naming one of the right count; before ``validate_args``, which asserts on a count ``pp`` does not divide."""
    schedule, text = schedule_of(args), getattr(args, "pipeline_model_parallel_layout", None)
    spec = registry.get(schedule)
    if text is None or spec.chunks_per_rank != 2:
        return []
    pp = args.pipeline_model_parallel_size
    try:
        count = len(stage_layout.parse(text))
    except stage_layout.LayoutError as e:
        return [str(e)]
    want = spec.model_stages(pp)
    return [] if count == want else [stage_layout.fix(text, want, pp, schedule)]


def v_split_problems(args) -> List[str]:
    """DualPipeV's uneven V-stages beyond a layout, in Megatron's interleaved meaning: the embedding and
    loss counted as layers must divide by ``2*pp``; ``--decoder-first/last-pipeline-num-layers`` refused."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = (getattr(args, f"decoder_{end}_pipeline_num_layers", None) for end in ("first", "last"))
    if first is not None or last is not None:
        ends = [n for n in (first, last) if n is not None]
        middle = pp - len(ends)
        sizes = ((first,) if first is not None else ()) + ((layers - sum(ends)) // max(middle, 1),) * middle \
            + ((last,) if last is not None else ())
        halves = stage_layout.halved(stage_layout.from_sizes(sizes))
        return [f"--decoder-first/last-pipeline-num-layers: Megatron's interleaved meaning puts the first stage's "
                f"layers in V-stages 0 and {pp} (ranks 0 and {pp - 1}); give the V-stages instead, e.g. "
                f"--pipeline-model-parallel-layout '{stage_layout.to_text(halves)}'"]
    counted = layers + sum(bool(getattr(args, f"account_for_{what}_in_pipeline_split", False))
                           for what in ("embedding", "loss"))
    if counted != layers and counted % (2 * pp):
        return [f"--num-layers {layers} with the embedding / loss counted ({counted}) does not divide into "
                f"2 * --pipeline-model-parallel-size ({2 * pp}) V-stages: change --num-layers, or give the V-stages "
                f"as --pipeline-model-parallel-layout '{stage_layout.to_text(stage_layout.even(layers, 2 * pp))}'"]
    return []


def without_virtual_pipeline(args) -> None:
    """DualPipeV's ``2*pp``-stage layout, which ``validate_args`` made a virtual pipeline: DualPipeV builds
    its V-stages itself (``mcore.model.dualpipev_config``), so both values go back to no virtual pipeline's."""
    if schedule_of(args) == registry.DUALPIPEV and getattr(args, "pipeline_model_parallel_layout", None) is not None:
        args.virtual_pipeline_model_parallel_size = None
        args.overlap_p2p_comm = False


def dualpipe_problems(args):
    """One message per violated constraint (empty if fine or 1f1b); ``args`` after Megatron's ``validate_args``."""
    schedule = schedule_of(args)
    spec = registry.get(schedule)
    if ways := copies.flag_problems(args, schedule):
        return ways
    if spec.runs_on != registry.EXECUTOR:
        if getattr(args, "dualpipe_advise", False):
            return [f"--dualpipe-advise measures the executor's schedules, not Megatron's own {schedule}: use "
                    f"--pipeline-schedule {registry.EXECUTOR_1F1B} (the same 1F1B order, timed) or remove it"]
        return []
    problems = advise_problems(args)
    flag = f"--pipeline-schedule {schedule}"

    def bad(msg):
        problems.append(f"{flag}: {msg}")

    if spec.chunks_per_rank == 2:
        _two_chunk_problems(spec, args, bad)
    elif args.pipeline_model_parallel_size < 2:
        bad(f"needs --pipeline-model-parallel-size >= 2; use --pipeline-schedule {registry.DEFAULT}")
    # Every option of the table (with --overlap-moe-expert-parallel-comm: what megatron-core's
    # combined step needs; training_hooks adapts the config so that no virtual pipeline is needed).
    for problem in options.problems(args, schedule, options.ARGS):
        bad(problem)
    timeout = getattr(args, "dualpipe_p2p_timeout", None)
    if timeout is not None and not timeout > 0:
        bad(f"--dualpipe-p2p-timeout must be a positive number of seconds (got {timeout})")
    return problems


def _two_chunk_problems(spec, args, bad) -> None:
    """DualPipe's and DualPipeV's own needs: torch, the layout, the pipeline size, the layer and
    micro-batch counts."""
    pp = args.pipeline_model_parallel_size
    if torch_problem := versions.torch_problem():
        bad(f"{torch_problem}, or use --pipeline-schedule {registry.DEFAULT}")
    for problem in layout_problems(args) + (v_split_problems(args) if spec.name == registry.DUALPIPEV else []):
        bad(problem)
    if pp < 2:
        bad(f"needs --pipeline-model-parallel-size >= 2 (got {pp}); increase it or use "
            f"--pipeline-schedule {registry.DEFAULT}")
    elif spec.pp_problem(pp, flag="--pipeline-model-parallel-size"):
        bad(spec.pp_problem(pp, flag="--pipeline-model-parallel-size"))
    num_layers, divisor = getattr(args, "num_layers", None), spec.model_stages(pp)
    uneven = any(getattr(args, name, None) not in (None, False) for name in UNEVEN_SPLIT)
    if num_layers is not None and pp >= 1 and not uneven and num_layers % divisor:
        what = "pipeline size" if divisor == pp else f"{divisor // pp} * pipeline size"
        bad(f"--num-layers ({num_layers}) must be divisible by the {what} ({divisor}); "
            "change --num-layers or --pipeline-model-parallel-size")
    if pp >= 2:
        for problem in _microbatch_problems(spec, args, pp):
            bad(problem)


def _microbatch_problems(spec, args, pp: int):
    """The micro-batch counts the schedule needs, at the start of a batch-size ramp-up too."""
    dp = getattr(args, "data_parallel_size", None) or 1
    m = args.global_batch_size // (args.micro_batch_size * dp)
    least = spec.min_real_microbatches(pp)
    if m < least:
        yield (f"needs at least {least} micro-batches per step with pipeline size {pp}, got {m} = "
               f"--global-batch-size {args.global_batch_size} // (--micro-batch-size "
               f"{args.micro_batch_size} * data-parallel size {dp}); increase "
               "--global-batch-size or decrease --micro-batch-size")
    rampup = getattr(args, "rampup_batch_size", None)
    if rampup:
        start = int(rampup[0])
        m0 = start // (args.micro_batch_size * dp)
        if m0 < least:
            yield (f"--rampup-batch-size starts at global batch {start}, i.e. {m0} "
                   f"micro-batches, fewer than the pipeline size ({pp}); raise its start value")


def validate_dualpipe_args(args):
    """Raise :class:`DualPipeArgumentError` listing every problem; return ``args`` otherwise."""
    if problems := dualpipe_problems(args):
        raise DualPipeArgumentError("invalid arguments for the DualPipe schedule:\n  - " + "\n  - ".join(problems))
    return args


# ------------------------------------------------------------------------------------------
# Installation into megatron.training
# ------------------------------------------------------------------------------------------

_PART = "megatron-lm arguments"  # hooks/manifest.py lists what install() patches


def wrap_add_megatron_arguments(orig):
    """``add_megatron_arguments`` that also adds the DualPipe flags."""

    @functools.wraps(orig)
    def add_megatron_arguments(parser):
        return add_dualpipe_arguments(orig(parser))

    return add_megatron_arguments


def keep_aligned_param_gather(args, aligned) -> None:
    """``validate_args`` turns ``--align-param-gather`` off without a virtual pipeline, but the executor
    gathers both chunks' parameters before the first action, as the interleaved schedule does: it stands."""
    if aligned and registry.get(schedule_of(args)).chunks_per_rank == 2:
        args.align_param_gather = True


def wrap_validate(orig):
    """``validate_args`` (or ``validate_yaml``) followed by :func:`keep_aligned_param_gather` and
    :func:`validate_dualpipe_args`."""

    @functools.wraps(orig)
    def validate(args, *a, **kw):
        aligned = getattr(args, "align_param_gather", None)
        if early := layout_problems(args):
            raise DualPipeArgumentError(f"invalid arguments for the DualPipe schedule: --pipeline-schedule "
                                        f"{schedule_of(args)}: {early[0]}")
        result = orig(args, *a, **kw)
        without_virtual_pipeline(result if result is not None else args)
        keep_aligned_param_gather(result if result is not None else args, aligned)
        validate_dualpipe_args(result if result is not None else args)
        return result

    return validate


def install():
    """Patch ``megatron.training`` so its parser knows the flags and its validation checks them (the
    ``megatron-lm arguments`` part of the hooks manifest). Idempotent; before ``pretrain()``."""
    hooks.install([_PART])


def uninstall():
    """Undo :func:`install` (for tests)."""
    hooks.uninstall([_PART])
