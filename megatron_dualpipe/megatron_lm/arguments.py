"""``--pipeline-schedule`` and friends for Megatron-LM's argument parser.

Flags (added to every ``megatron.training.arguments.parse_args`` parser once :func:`install` ran):

``--pipeline-schedule NAME``
    One of the registry's schedules (``megatron_dualpipe.schedule.registry``). ``1f1b``
    (default) keeps Megatron's own schedule selection untouched (1F1B, or interleaved 1F1B when
    a virtual pipeline is configured). ``dualpipe`` is DeepSeek's bidirectional DualPipe (two
    model copies per rank, ``pp`` even); ``dualpipev`` is the "cut-in-half" V variant (two
    chunks of ``num_layers / (2*pp)`` layers per rank). ``executor-1f1b`` and ``zb-h1`` run
    the 1F1B and ZB-H1 orders on megatron_dualpipe's executor (one chunk per rank, same model
    and checkpoints as ``1f1b``): for comparing schedules on equal terms.
``--dualpipe-zero-bubble`` / ``--no-dualpipe-zero-bubble``
    Split backward into input-grad (B) and weight-grad (W) steps to fill bubbles (default on).
``--dualpipe-p2p-timeout SECONDS``
    Timeout of one schedule step's batched P2P exchange (default: the process group's timeout).

How the flags reach Megatron (see :func:`install`): ``parse_args`` (``arguments.py``) looks up
the module global ``add_megatron_arguments`` at call time, so wrapping that attribute adds the
flags to the parser no matter which ``extra_args_provider`` the script passes
(``pretrain_gpt.py`` passes its own). The DualPipe checks run right after Megatron's
``validate_args``, wrapped both as ``megatron.training.arguments.validate_args`` and as the
by-name import ``megatron.training.initialize.validate_args`` (which is what
``initialize_megatron`` calls), and after ``initialize.validate_yaml`` for ``--yaml-cfg`` runs.
They need the values ``validate_args`` derives (``data_parallel_size``,
``virtual_pipeline_model_parallel_size``).

With ``--pipeline-schedule 1f1b`` the only difference to stock Megatron is that ``args`` carries
the three extra attributes; no check runs and no value is changed.
"""

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from ..schedule import registry

_GROUP_TITLE = "DualPipe pipeline schedule (megatron_dualpipe)"


class DualPipeArgumentError(ValueError):
    """An argument combination the DualPipe schedules cannot run."""


def add_dualpipe_arguments(parser):
    """Add the DualPipe flags to an ``argparse`` parser and return it (idempotent)."""
    if any("--pipeline-schedule" in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(title=_GROUP_TITLE)
    group.add_argument(
        "--pipeline-schedule",
        type=str,
        default=registry.DEFAULT,
        choices=registry.NAMES,
        help="Pipeline schedule. " + "; ".join(f"{s.name}: {s.summary}" for s in registry.SPECS.values()) + ".",
    )
    group.add_argument(
        "--dualpipe-zero-bubble",
        action="store_true",
        dest="dualpipe_zero_bubble",
        default=True,
        help="Split backward into input-grad and deferred weight-grad steps (default).",
    )
    group.add_argument(
        "--no-dualpipe-zero-bubble",
        action="store_false",
        dest="dualpipe_zero_bubble",
        help="Run the full backward (input and weight grads) in one step.",
    )
    group.add_argument(
        "--dualpipe-p2p-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Timeout in seconds for one DualPipe step's batched P2P exchange "
        "(default: the process group timeout, --distributed-timeout-minutes).",
    )
    group.add_argument(
        "--dualpipe-advise",
        action="store_true",
        help="After the first training iteration, log which schedule megatron-dualpipe advise chooses for "
        "the stage costs and memory that iteration measured (executor schedules).",
    )
    group.add_argument(
        "--dualpipe-drift-check-interval",
        type=int,
        default=0,
        metavar="N",
        help="dualpipe: every N training iterations, check that both copies of every stage are bit-identical "
        "(a checksum per parameter over each bd pair; the error names the first parameter that differs). "
        "0 (default): off.",
    )
    return parser


def num_microbatches(args) -> int:
    """Micro-batches per global batch and data-parallel rank, as Megatron computes it."""
    dp = getattr(args, "data_parallel_size", None) or 1
    return args.global_batch_size // (args.micro_batch_size * dp)


@dataclass(frozen=True)
class RefusedOption:
    """A Megatron-LM option that an executor schedule cannot honour, with the reason and the fix.

    ``flags`` is what the user typed (and must change), ``dest`` the ``args`` attribute it sets,
    ``is_set(value)`` whether that value turns the feature on. The table below is the one place
    these refusals live: ``dualpipe_problems`` reads it, docs/megatron-options.md lists it and
    tests/test_megatron_lm.py checks every entry's message.
    """

    flags: str
    dest: str
    why: str
    schedules: Tuple[str, ...] = registry.names(chunks_per_rank=2)
    is_set: Callable[[Any], bool] = bool
    fix: Optional[str] = None

    def message(self) -> str:
        return f"does not support {self.flags} ({self.why}); {self.fix or 'remove ' + self.flags}"


def _not_none(value) -> bool:
    return value not in (None, "none")


def _has_global_aux_loss(value) -> bool:
    return "global_aux_loss" in (value if isinstance(value, (list, tuple)) else [value])


#: Schedules run by the executor; schedules whose two chunks are mirrored copies of one stage.
_EXECUTOR = registry.names(runs_on=registry.EXECUTOR)
_MIRRORED = (registry.DUALPIPE,)

REFUSED_OPTIONS: Tuple[RefusedOption, ...] = (
    RefusedOption("--use-torch-fsdp2", "use_torch_fsdp2", "FSDP shards the chunks' parameters itself"),
    RefusedOption("--use-megatron-fsdp", "use_megatron_fsdp", "FSDP shards the chunks' parameters itself"),
    RefusedOption("--mtp-num-layers", "mtp_num_layers",
                  "multi-token prediction is tied to the last pipeline stage of one direction"),
    RefusedOption("--cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph", "cuda_graph_impl",
                  "a captured graph replays one fixed order of forwards and backwards",
                  is_set=_not_none, fix="use --cuda-graph-impl none"),
    RefusedOption("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm",
                  "a one-chunk order has no fused F&B units to overlap; --delay-wgrad-compute needs it too",
                  schedules=registry.names(runs_on=registry.EXECUTOR, chunks_per_rank=1),
                  fix="remove it, or use --pipeline-schedule " + " or ".join(registry.names(chunks_per_rank=2))),
    RefusedOption("--iterations-to-skip", "iterations_to_skip", "the skip path assumes one data iterator"),
    RefusedOption("--sft", "sft", "packed variable-length sequences need variable P2P shapes"),
    RefusedOption("--perform-rl-step", "perform_rl_step",
                  "RL builds a separate inference model through get_model and drives its own train loop",
                  fix="remove --perform-rl-step or use --pipeline-schedule 1f1b"),
    RefusedOption("--hybrid-context-parallel", "hybrid_context_parallel",
                  "micro-batches of different lengths need variable P2P shapes"),
    RefusedOption("--moe-router-load-balancing-type global_aux_loss", "moe_router_load_balancing_type",
                  "its loss for micro-batch k averages the token counts of micro-batches 1..k in 1F1B order, "
                  "and DualPipe's two copies of a stage each see only one direction's micro-batches",
                  schedules=_MIRRORED, is_set=_has_global_aux_loss,
                  fix="use aux_loss or seq_aux_loss, or --pipeline-schedule dualpipev"),
    RefusedOption("--qk-clip", "qk_clip",
                  "each copy of a stage would clip its weights by the largest attention logit of its own "
                  "direction's micro-batches, so the copies would drift apart", schedules=_MIRRORED),
    RefusedOption("--moe-enable-routing-replay", "moe_enable_routing_replay",
                  "its process-wide list of routers would hold both copies of every MoE layer",
                  schedules=_MIRRORED),
    RefusedOption("--save-dgrads-interval", "save_dgrads_interval",
                  "it records the input gradients of 'the last micro-batch', which depends on the schedule's order",
                  is_set=lambda v: v is not None),
    RefusedOption("--use-ring-exchange-p2p", "use_ring_exchange_p2p",
                  "the executor posts its own batched point-to-point operations",
                  schedules=_EXECUTOR),
    RefusedOption("--fine-grained-activation-offloading", "fine_grained_activation_offloading",
                  "its offload handlers are advanced and reset by Megatron's own schedules",
                  schedules=_EXECUTOR),
    RefusedOption("--inprocess-restart", "inprocess_restart",
                  "a restart inside the process would rebuild the process groups but not DualPipe's bd groups"),
    RefusedOption("--moe-use-upcycling", "moe_use_upcycling",
                  "upcycling loads a dense one-chunk model and converts it in place"),
)


def refused_option_problems(args, schedule: str) -> List[str]:
    """Messages for the options of `REFUSED_OPTIONS` that are on in ``args`` and refused for ``schedule``."""
    return [f"--pipeline-schedule {schedule}: {opt.message()}" for opt in REFUSED_OPTIONS
            if schedule in opt.schedules and opt.is_set(getattr(args, opt.dest, None))]


def dualpipe_problems(args):
    """Return a list of messages, one per violated constraint (empty if fine or 1f1b).

    ``args`` must already have been through Megatron's ``validate_args``.
    """
    schedule = getattr(args, "pipeline_schedule", registry.DEFAULT)
    spec = registry.get(schedule)
    if spec.runs_on != registry.EXECUTOR:
        if getattr(args, "dualpipe_advise", False):
            return [f"--dualpipe-advise measures the executor's schedules, not Megatron's own {schedule}: use "
                    f"--pipeline-schedule {registry.EXECUTOR_1F1B} (the same 1F1B order, timed) or remove it"]
        return []
    problems = []
    flag = f"--pipeline-schedule {schedule}"
    pp = args.pipeline_model_parallel_size

    def bad(msg):
        problems.append(f"{flag}: {msg}")

    if spec.chunks_per_rank == 1:
        return _one_chunk_problems(spec, args, bad, problems)

    # Pipeline size.
    if pp < 2:
        bad(
            f"needs --pipeline-model-parallel-size >= 2 (got {pp}); increase it or use "
            f"--pipeline-schedule {registry.DEFAULT}"
        )
    elif spec.pp_problem(pp, flag="--pipeline-model-parallel-size"):
        bad(spec.pp_problem(pp, flag="--pipeline-model-parallel-size"))

    # Layer layout.
    if (
        getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
        or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None
    ):
        bad(
            "cannot be combined with a virtual pipeline; remove "
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank "
            f"({schedule} already places two chunks on every rank)"
        )
    if getattr(args, "pipeline_model_parallel_layout", None) is not None:
        bad("does not support --pipeline-model-parallel-layout; remove it")
    if (
        getattr(args, "decoder_first_pipeline_num_layers", None) is not None
        or getattr(args, "decoder_last_pipeline_num_layers", None) is not None
    ):
        bad(
            "needs evenly split stages; remove --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers"
        )
    if getattr(args, "account_for_embedding_in_pipeline_split", False) or getattr(
        args, "account_for_loss_in_pipeline_split", False
    ):
        bad(
            "needs evenly split stages; remove --account-for-embedding-in-pipeline-split / "
            "--account-for-loss-in-pipeline-split"
        )
    num_layers = getattr(args, "num_layers", None)
    if num_layers is not None and pp >= 1:
        divisor = spec.model_stages(pp)
        if num_layers % divisor != 0:
            what = "pipeline size" if divisor == pp else f"{divisor // pp} * pipeline size"
            bad(
                f"--num-layers ({num_layers}) must be divisible by the {what} ({divisor}); "
                "change --num-layers or --pipeline-model-parallel-size"
            )

    # Micro-batches.
    if pp >= 2:
        dp = getattr(args, "data_parallel_size", None) or 1
        m = num_microbatches(args)
        least = spec.min_real_microbatches(pp)
        if m < least:
            bad(
                f"needs at least {least} micro-batches per step with pipeline size {pp}, got {m} = "
                f"--global-batch-size {args.global_batch_size} // (--micro-batch-size "
                f"{args.micro_batch_size} * data-parallel size {dp}); increase "
                "--global-batch-size or decrease --micro-batch-size"
            )
        rampup = getattr(args, "rampup_batch_size", None)
        if rampup:
            start = int(rampup[0])
            m0 = start // (args.micro_batch_size * dp)
            if m0 < spec.min_real_microbatches(pp):
                bad(
                    f"--rampup-batch-size starts at global batch {start}, i.e. {m0} "
                    f"micro-batches, fewer than the pipeline size ({pp}); raise its start value"
                )

    problems.extend(refused_option_problems(args, schedule))
    from ..mcore.validation import fp8_delayed_problem  # the check the executor repeats at its first call

    fp8 = fp8_delayed_problem(spec, pp, getattr(args, "fp8", None), getattr(args, "fp8_recipe", None))
    if fp8:
        bad(fp8)
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        # Fused F&B units through megatron-core's combined step (mcore.overlap); no virtual
        # pipeline needed (training_hooks adapts the config).
        from ..mcore.overlap import combined_step_problems

        for problem in combined_step_problems(args):
            bad(f"--overlap-moe-expert-parallel-comm: {problem}")

    timeout = getattr(args, "dualpipe_p2p_timeout", None)
    if timeout is not None and not timeout > 0:
        bad(f"--dualpipe-p2p-timeout must be a positive number of seconds (got {timeout})")
    return problems


def _one_chunk_problems(spec, args, bad, problems):
    """The executor's 1F1B and ZB-H1: one chunk per rank, Megatron's model, batched P2P of its own."""
    if args.pipeline_model_parallel_size < 2:
        bad(f"needs --pipeline-model-parallel-size >= 2; use --pipeline-schedule {registry.DEFAULT}")
    if (
        getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None
        or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None
    ):
        bad(
            "runs one model chunk per rank; remove --num-layers-per-virtual-pipeline-stage / "
            f"--num-virtual-stages-per-pipeline-rank or use --pipeline-schedule {registry.DEFAULT}"
        )
    if getattr(args, "overlap_p2p_comm", False):
        bad("batches its own P2P; remove --overlap-p2p-communication")
    if getattr(args, "variable_seq_lengths", False):
        bad("needs fixed shapes between micro-batches; remove --variable-seq-lengths")
    problems.extend(refused_option_problems(args, spec.name))
    timeout = getattr(args, "dualpipe_p2p_timeout", None)
    if timeout is not None and not timeout > 0:
        bad(f"--dualpipe-p2p-timeout must be a positive number of seconds (got {timeout})")
    return problems


def validate_dualpipe_args(args):
    """Raise :class:`DualPipeArgumentError` listing every problem; return ``args`` otherwise."""
    problems = dualpipe_problems(args)
    if problems:
        raise DualPipeArgumentError(
            "invalid arguments for the DualPipe schedule:\n  - " + "\n  - ".join(problems)
        )
    return args


# ------------------------------------------------------------------------------------------
# Installation into megatron.training
# ------------------------------------------------------------------------------------------

_MARK = "_megatron_dualpipe_wrapped"


def _wrap_add_megatron_arguments(orig):
    @functools.wraps(orig)
    def add_megatron_arguments(parser):
        parser = orig(parser)
        return add_dualpipe_arguments(parser)

    setattr(add_megatron_arguments, _MARK, orig)
    return add_megatron_arguments


def _wrap_validate(orig):
    @functools.wraps(orig)
    def validate(args, *a, **kw):
        result = orig(args, *a, **kw)
        validate_dualpipe_args(result if result is not None else args)
        return result

    setattr(validate, _MARK, orig)
    return validate


def install():
    """Patch ``megatron.training`` so its parser knows the flags and its validation checks them.

    Idempotent. Must run before ``pretrain()`` (i.e. before ``initialize_megatron``).
    """
    import megatron.training.arguments as margs
    import megatron.training.initialize as minit

    if not hasattr(margs.add_megatron_arguments, _MARK):
        margs.add_megatron_arguments = _wrap_add_megatron_arguments(margs.add_megatron_arguments)
    for mod, name in ((margs, "validate_args"), (minit, "validate_args"), (minit, "validate_yaml")):
        fn = getattr(mod, name, None)
        if fn is not None and not hasattr(fn, _MARK):
            setattr(mod, name, _wrap_validate(fn))


def uninstall():
    """Undo :func:`install` (for tests)."""
    import megatron.training.arguments as margs
    import megatron.training.initialize as minit

    for mod, name in (
        (margs, "add_megatron_arguments"),
        (margs, "validate_args"),
        (minit, "validate_args"),
        (minit, "validate_yaml"),
    ):
        fn = getattr(mod, name, None)
        if fn is not None and hasattr(fn, _MARK):
            setattr(mod, name, getattr(fn, _MARK))
