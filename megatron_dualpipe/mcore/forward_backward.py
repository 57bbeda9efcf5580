"""megatron-core's ``forward_backward_func`` for the schedules this project's executor runs.

:func:`get_forward_backward_func`: Megatron's own ``1f1b`` gets megatron-core's function; the executor's
schedules an :class:`ExecutorSchedule`, which keeps the contract of megatron-core's schedules (its keyword
arguments; ``model`` is ``[chunk_dir0, chunk_dir1]`` for DualPipe/DualPipeV, ``mcore.model``; one data
iterator, split into the directions inside). Every micro-batch runs through ``schedules.forward_step`` /
``backward_step``, so loss and aux-loss scaling and ``calculate_per_token_loss`` are Megatron's;
``config.no_sync_func`` holds data-parallel reduction off while the schedule runs, and each chunk's reduction
starts where the checked iteration plan says (``grad_reduction``), as do the parameter all-gathers
(``param_gather``) and ``config.finalize_model_grads_func``. The loss entries of all real micro-batches, both
directions, come back in global order on the last pipeline rank (``[]`` elsewhere), where Megatron reads them.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import math
import weakref
from typing import Callable, Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

from ..executor.p2p import DEFAULT_TIMEOUT_S, P2P
from ..executor.runner import TensorSpec, run_rank
from ..executor import abort, watchdog
from ..schedule import B, iteration_plan, registry
from ..schedule.lowering import after_finish
from ..schedule.lowering.program import ProgramOptions, build_program
from . import copies
from .data import MicrobatchSource
from .grad_reduction import GradReduction, clear_deferred_output_wgrads
from .live_advice import DEFAULT_WARMUP as ADVISE_WARMUP, LiveAdvice
from .overlap import OverlappedStageCompute, offers_combined_step
from .program_ops import ProgramOps
from .stage_compute import MegatronStageCompute
from .step_options import step_options
from .validation import DualPipeConfigError, check_call

log = logging.getLogger("megatron_dualpipe")

__all__ = ["DualPipeConfigError", "ExecutorSchedule", "forward_backward_dualpipe", "get_forward_backward_func"]


def get_forward_backward_func(schedule: str = registry.DEFAULT, **options) -> Callable:
    """The ``forward_backward_func`` for a schedule name (see the module docstring).

    ``options`` (executor schedules only): ``zero_bubble`` (default True), ``p2p_timeout`` (seconds,
    default ``MEGATRON_DUALPIPE_P2P_TIMEOUT`` or 600), ``advise`` (default False; :mod:`.live_advice`),
    ``advise_warmup`` (training iterations skipped before measuring), ``drift_check_every`` (default 0,
    off: every N-th training call first checks both copies of every stage bit-identical, :mod:`.drift`).
    """
    try:
        spec = registry.get(schedule)
    except registry.ScheduleError as e:
        raise DualPipeConfigError(f"unknown pipeline schedule {schedule!r}: choose one of "
                                  f"{', '.join(registry.NAMES)}") from e
    if spec.runs_on == registry.MEGATRON:
        return schedules.get_forward_backward_func()
    return _executor_schedule(spec.name, **options)


@functools.lru_cache(maxsize=None)
def _executor_schedule(name: str, **options):
    """One instance per (schedule, options): Megatron-LM asks for the function every iteration."""
    return ExecutorSchedule(registry.get(name), **options)


def forward_backward_dualpipe(*, schedule: str = registry.DUALPIPE, zero_bubble: bool = True,
                              p2p_timeout: float = DEFAULT_TIMEOUT_S, advise: bool = False,
                              advise_warmup: int = ADVISE_WARMUP, drift_check_every: int = 0, **kwargs):
    """Run one iteration of an executor schedule: ``get_forward_backward_func(schedule, ...)(**kwargs)``."""
    func = get_forward_backward_func(schedule, zero_bubble=zero_bubble, p2p_timeout=p2p_timeout, advise=advise,
                                     advise_warmup=advise_warmup, drift_check_every=drift_check_every)
    if not isinstance(func, ExecutorSchedule):
        raise DualPipeConfigError(f"{schedule} is Megatron's own schedule: call megatron-core's "
                                  f"get_forward_backward_func() for it")
    return func(**kwargs)


#: What one call runs: the checked ``Program``, this pipeline rank, its group's global ranks, the group, the
#: ``P2P`` and the ``TensorSpec`` of the messages.
_Iteration = collections.namedtuple("_Iteration", "program rank global_ranks group p2p tensor_spec")


class ExecutorSchedule:
    """A ``forward_backward_func`` running ``spec``'s order on the executor."""

    def __init__(self, spec: registry.ScheduleSpec, *, zero_bubble: bool = True,
                 p2p_timeout: float = DEFAULT_TIMEOUT_S, advise: bool = False, advise_warmup: int = ADVISE_WARMUP,
                 drift_check_every: int = 0):
        self.spec, self.zero_bubble, self.p2p_timeout = spec, zero_bubble, p2p_timeout
        self.drift_check_every, self._training_calls = drift_check_every, 0
        self._advice = LiveAdvice(warmup=advise_warmup) if advise else None
        self._padding_reported: set = set()
        self._audited = False
        self._wgrad = None
        if zero_bubble and spec.defers_weight_grads:
            # Process-wide and idempotent: megatron-core's local linear backward learns to defer its
            # weight gradient, but only inside a WeightGradStore's ``deferring`` block.
            from . import wgrad

            wgrad.install()
            self._wgrad = wgrad

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                 adjust_tensor_shapes_fn: Optional[Callable] = None, p2p_communicator=None, pg_collection=None,
                 force_all_reduce: Optional[bool] = False):
        model = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(model[0])
        padded = check_call(self.spec, model=model, num_microbatches=num_microbatches, forward_only=forward_only,
                            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, config=config,
                            zero_bubble=self.zero_bubble, p2p_communicator=p2p_communicator,
                            pg_collection=pg_collection, data_iterator=data_iterator)
        if isinstance(data_iterator, (list, tuple)):
            data_iterator = data_iterator[0]
        it = self._plan(model, config, num_microbatches, padded, forward_only,
                        (seq_length, micro_batch_size, decoder_seq_length))
        # A rank that raises from here on stops its peers' waits; on an accelerator every stream wait
        # of the iteration is under the watchdog (deadline, abort signal), drained at the end.
        with abort.signalling_failure(), watchdog.watching(self.p2p_timeout):
            if not forward_only and self.drift_check_every:  # every N-th training call first: drift.py
                self._training_calls += 1
                if (self._training_calls - 1) % self.drift_check_every == 0:
                    from .drift import check_copies_identical

                    check_copies_identical(model, timeout_s=self.p2p_timeout)
            return self._iterate(it, model, config, forward_step_func, data_iterator, num_microbatches,
                                 forward_only, collect_non_loss_data, first_val_step, force_all_reduce)

    def _iterate(self, it: "_Iteration", model, config, forward_step_func, data_iterator, num_microbatches: int,
                 forward_only: bool, collect_non_loss_data: bool, first_val_step, force_all_reduce):
        """Run, gather the losses, finalize."""
        has_b = any(a.op == B for a in it.program.actions[it.rank])
        store = self._wgrad.WeightGradStore() if self._wgrad is not None and not forward_only and has_b else None
        reduction = None if forward_only else GradReduction(model, config)
        # Through megatron-core's combined step when the model offers it (mcore.overlap).
        compute = (OverlappedStageCompute if offers_combined_step(config, forward_only) else MegatronStageCompute)(
            program=it.program, model=model, rank=it.rank, forward_step_func=forward_step_func,
            source=MicrobatchSource(data_iterator), config=config, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step, global_ranks=it.global_ranks,
            wgrad_store=store, audit=self._wgrad.DeferralAudit() if store is not None and not self._audited else None)
        advice = self._advice if self._advice is not None and self._advice.wanted(forward_only) else None
        ops = ProgramOps(it.program.ops[it.rank], it=it, model=model, config=config, compute=compute,
                         reduction=reduction, forward_only=forward_only, force_all_reduce=force_all_reduce,
                         timeout_s=self.p2p_timeout, describe=f"{self.spec.name} pipeline rank {it.rank}: ")
        with _timer(config):
            with advice.measuring(model) if advice is not None else contextlib.nullcontext() as recorder:
                losses = self._run(it, compute, ops, config, model, forward_only, recorder)
            if forward_only:
                clear_deferred_output_wgrads(config, model)  # evaluation: what its forwards deferred
            if advice is not None:
                advice.report(spec_name=self.spec.name, pp=len(it.global_ranks), microbatches=num_microbatches,
                              model=model, group=it.group, actions=it.program.actions[it.rank],
                              is_fake=it.program.padded.is_fake, device=it.tensor_spec.device,
                              message_bytes=math.prod(it.tensor_spec.shape) * it.tensor_spec.dtype.itemsize)
            if compute.audit is not None:  # once per process: how much weight-gradient work W holds if B kept some
                self._audited = True
                message = compute.audit.report()
                if message:
                    log.warning("megatron-dualpipe: %s pipeline rank %d: %s", self.spec.name, it.rank, message)
        return losses

    # -- plan ------------------------------------------------------------------------------------
    def _plan(self, model, config, real: int, padded: int, forward_only: bool, shape_args) -> _Iteration:
        group = parallel_state.get_pipeline_model_parallel_group()
        global_ranks = dist.get_process_group_ranks(group)
        rank = parallel_state.get_pipeline_model_parallel_rank()
        # forward only: evaluation's collectives after the program (step_collectives' evaluation)
        step = step_options(model, config, drift_check=bool(self.drift_check_every), advise=self._advice is not None)
        options = ProgramOptions(zero_bubble=self.zero_bubble, overlap_grad_reduce=config.grad_sync_func is not None,
                                 dp=parallel_state.get_data_parallel_world_size(),
                                 param_gather=config.param_sync_func is not None,
                                 bd_sums=copies.of(model).way.sums_in_schedule, step=step)
        program = _checked_iteration(self.spec.name, len(global_ranks), padded, real, forward_only, options).program
        if padded != real and (len(global_ranks), real, forward_only) not in self._padding_reported:
            self._padding_reported.add((len(global_ranks), real, forward_only))  # said once per process
            if dist.get_rank() == 0:
                log.warning("megatron-dualpipe: %s with pp=%d needs %d micro-batches, got %d: added %d fake "
                            "micro-batch(es) (no data, no compute, zero loss and gradient)%s", self.spec.name,
                            len(global_ranks), padded, real, padded - real, " in evaluation" if forward_only else "")
        seq_length, micro_batch_size, decoder_seq_length = shape_args
        shape = schedules.get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            config=config, tp_group=parallel_state.get_tensor_model_parallel_group(),
            cp_group=parallel_state.get_context_parallel_group())[0]
        device = next(model[0].parameters()).device
        p2p = P2P(group, global_ranks, rank, timeout_s=self.p2p_timeout)
        if group not in _READY_GROUPS:  # a group's first collective, once (``P2P.first_collective``)
            p2p.first_collective(device)
            _READY_GROUPS.add(group)
        tensor_spec = TensorSpec(tuple(shape), config.pipeline_dtype, device)
        return _Iteration(program, rank, global_ranks, group, p2p, tensor_spec)

    # -- run ---------------------------------------------------------------------------------------
    def _run(self, it: _Iteration, compute: MegatronStageCompute, ops: ProgramOps, config, model,
             forward_only: bool, recorder=None) -> list:
        """The rank's program: the schedule with data-parallel reduction held off, its collectives
        issued by ``ops`` where the list has them, then the ops after it; returns the loss entries."""
        program = it.program.ops[it.rank]
        end = after_finish(program)
        reduction = ops.reduction
        with _no_sync(config, model, forward_only), \
                (reduction.during_schedule() if reduction is not None else contextlib.nullcontext()):
            run_rank(it.program, it.rank, compute, it.p2p, it.tensor_spec, trace=recorder,
                     listeners=() if forward_only else (ops,))
        if compute.wgrad_store is not None:
            compute.wgrad_store.assert_empty()
        if not forward_only:
            compute.check_te_queues_empty()
        return ops.after_schedule(program[end:])


#: Pipeline groups that have had their first collective (see ``P2P.first_collective``).
_READY_GROUPS: "weakref.WeakSet" = weakref.WeakSet()


@contextlib.contextmanager
def _timer(config):
    if config.timers is None:
        yield
        return
    config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        config.timers("forward-backward").stop()


@contextlib.contextmanager
def _no_sync(config, model, forward_only: bool):
    """Keep data-parallel gradient reduction off until every micro-batch is done (each chunk's
    gradients are complete only after its last W), as Megatron's schedules do."""
    funcs = [] if config.no_sync_func is None or forward_only else config.no_sync_func
    with contextlib.ExitStack() as stack:
        for f in funcs if isinstance(funcs, list) else [funcs] * len(model):
            stack.enter_context(f())
        yield


@functools.lru_cache(maxsize=64)
def _checked_iteration(name: str, pp: int, padded: int, real: int, forward_only: bool,
                       options: ProgramOptions) -> iteration_plan.IterationPlan:
    """The iteration's whole communication, checked under NCCL stream semantics before anything runs
    (raises ``IterationPlanError`` naming the cycle); its ``program`` is what runs. Python's cyclic garbage
    collector is paused: building and checking the plan allocates many small acyclic objects (dualpipe pp=32
    M=1024: 2.2 s of CPU, 1.2 s paused)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        return iteration_plan.plan_for(build_program(name, pp, padded, real, forward_only, options))
    finally:
        if was_on:
            gc.enable()
