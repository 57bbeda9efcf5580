"""``forward_backward_dualpipe``: a drop-in ``forward_backward_func`` for megatron-core.

It has the signature and the contract of megatron-core's schedules (see the docstring of
``megatron.core.pipeline_parallel.get_forward_backward_func``): it runs every micro-batch's
forward and backward with ``schedules.forward_step`` / ``schedules.backward_step`` (so loss
scaling by the number of micro-batches, MoE aux-loss scaling and ``calculate_per_token_loss``
behave as in Megatron), finalizes gradients with ``config.finalize_model_grads_func``, and
returns the per-micro-batch loss dicts of ALL real micro-batches, of both directions, on the
last pipeline rank (``[]`` elsewhere), which is where Megatron's training loop reads them.

The schedule itself is data (``megatron_dualpipe.schedule``); ``executor.runner`` interprets
it. This module adapts Megatron to the runner: :class:`MegatronStageCompute`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, get_model_type

from ..executor.p2p import DEFAULT_TIMEOUT_S, P2P
from ..executor.runner import StageComputeBase, TensorSpec, compile_program, run_rank
from ..schedule import B, Action
from ..schedule.layout import Layout
from .data import MicrobatchSource, global_index, padded_microbatches, split_microbatches
from .direction import direction_of

log = logging.getLogger("megatron_dualpipe")

#: Padding configurations already reported (the log line is printed once, not every iteration).
_PADDING_REPORTED: set = set()

#: Schedules this executor runs; Megatron's own 1F1B stays the default of the dispatcher.
EXECUTOR_SCHEDULES = ("dualpipe", "dualpipev", "1f1b", "zb-h1")


class DualPipeConfigError(ValueError):
    """A configuration DualPipe cannot run, found before any communication."""


class MegatronStageCompute(StageComputeBase):
    """What F, B, BW and W mean for this rank's Megatron model chunks.

    Chunk ``d`` of ``model`` serves direction ``d`` (single-direction schedules use chunk 0).
    Saved activations and deferred weight gradients are keyed by (direction, micro-batch,
    stage), never by order.
    """

    def __init__(self, *, schedule: str, model: Sequence[torch.nn.Module], layout: Layout, rank: int,
                 forward_step_func: Callable, source: MicrobatchSource, real: int, real_per_dir: List[int],
                 config, forward_only: bool, collect_non_loss_data: bool, first_val_step, global_ranks,
                 wgrad_store=None):
        self.schedule, self.model, self.layout, self.rank = schedule, model, layout, rank
        self.forward_step_func, self.source = forward_step_func, source
        self.real, self.real_per_dir = real, real_per_dir
        self.config, self.forward_only, self.collect_non_loss_data = config, forward_only, collect_non_loss_data
        self.first_val_step, self.global_ranks = first_val_step, global_ranks
        self.wgrad_store = wgrad_store
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.model_type = get_model_type(model[0])
        self.saved: Dict[tuple, tuple] = {}
        self.loss_store: List[List[Any]] = [[] for _ in layout.directions]
        self.total_num_tokens = None
        self.first_forward_done = [False] * len(model)

    def is_fake(self, a: Action) -> bool:
        return a.mb >= self.real_per_dir[a.dir if len(self.real_per_dir) > 1 else 0]

    def forward(self, a: Action, input_tensor):
        chunk = a.dir
        is_first_mb = schedules.check_first_val_step(self.first_val_step, self.forward_only,
                                                     not self.first_forward_done[chunk])
        self.first_forward_done[chunk] = True
        g = global_index(self.schedule, self.real, a.dir, a.mb)
        with direction_of(self.layout, self.rank, a.dir, self.global_ranks):
            output, num_tokens = schedules.forward_step(
                self.forward_step_func, self.source.view(g), self.model[chunk], self.real, input_tensor,
                self.loss_store[a.dir], self.config, self.cp_size,
                collect_non_loss_data=self.collect_non_loss_data, is_first_microbatch=is_first_mb,
                current_microbatch=g, is_last_stage=self.layout.is_last(a.dir, a.stage))
        self.total_num_tokens = num_tokens if self.total_num_tokens is None else self.total_num_tokens + num_tokens
        if not self.forward_only:
            self.saved[(a.dir, a.mb, a.stage)] = (input_tensor, output)
        return output

    def backward(self, a: Action, output_grad):
        input_tensor, output = self.saved.pop((a.dir, a.mb, a.stage))
        defer = self.wgrad_store.deferring((a.dir, a.mb, a.stage)) if (a.op == B and self.wgrad_store is not None) \
            else contextlib.nullcontext()
        with defer:
            return schedules.backward_step(input_tensor, output, output_grad, self.model_type, self.config)

    def weight(self, a: Action) -> None:
        if self.wgrad_store is not None:
            self.wgrad_store.run((a.dir, a.mb, a.stage))

    def release(self, a: Action, output) -> None:
        schedules.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)


def get_forward_backward_func(schedule: str = "1f1b", **options) -> Callable:
    """The ``forward_backward_func`` for a schedule name.

    ``1f1b`` returns megatron-core's own function (unchanged behaviour); ``dualpipe``,
    ``dualpipev`` (and ``executor-1f1b`` / ``zb-h1``, our executor running those orders, for
    comparisons) return :func:`forward_backward_dualpipe` bound to the schedule.
    """
    if schedule == "1f1b":
        return schedules.get_forward_backward_func()
    name = {"executor-1f1b": "1f1b"}.get(schedule, schedule)
    if name not in EXECUTOR_SCHEDULES:
        raise DualPipeConfigError(f"unknown pipeline schedule {schedule!r}: choose 1f1b, dualpipe, dualpipev, "
                                  f"executor-1f1b or zb-h1")
    return functools.partial(forward_backward_dualpipe, schedule=name, **options)


def validate(schedule: str, model: Sequence[torch.nn.Module], num_microbatches: int, forward_only: bool,
             adjust_tensor_shapes_fn, config, zero_bubble: bool) -> int:
    """Check everything that can be checked before communicating; return the padded M."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if schedule == "dualpipe" and (pp < 2 or pp % 2):
        raise DualPipeConfigError(f"dualpipe needs an even pipeline size >= 2, got {pp}: change "
                                  f"--pipeline-model-parallel-size, or use --pipeline-schedule dualpipev")
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp is not None and vp > 1:
        raise DualPipeConfigError(f"{schedule} cannot be combined with a virtual pipeline (size {vp}): remove "
                                  f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    chunks = 2 if schedule in ("dualpipe", "dualpipev") else 1
    if len(model) != chunks:
        raise DualPipeConfigError(
            f"{schedule} needs {chunks} model chunk(s) per rank, got {len(model)}: build the model with "
            f"megatron_dualpipe.mcore.model.build_two_direction_model" if chunks == 2 else
            f"{schedule} runs one model chunk per rank, got {len(model)}: pass a single model (no virtual "
            f"pipeline), or use --pipeline-schedule dualpipe/dualpipev")
    if adjust_tensor_shapes_fn is not None:
        raise DualPipeConfigError(f"{schedule} does not support adjust_tensor_shapes_fn (ModelOpt distillation): run "
                                  f"distillation with --pipeline-schedule 1f1b, or pass adjust_tensor_shapes_fn=None")
    if getattr(config, "variable_seq_lengths", False):
        raise DualPipeConfigError(f"{schedule} needs fixed shapes between micro-batches: turn off "
                                  f"variable_seq_lengths (every micro-batch must be seq_length x micro_batch_size)")
    if getattr(config, "overlap_p2p_comm", False):
        raise DualPipeConfigError(f"{schedule} batches its own P2P: turn off --overlap-p2p-communication")
    if zero_bubble and not forward_only and config.no_sync_func is not None:
        raise DualPipeConfigError(f"{schedule} with deferred weight gradients cannot overlap the gradient "
                                  f"reduction: remove --overlap-grad-reduce or pass --no-dualpipe-zero-bubble")
    if num_microbatches < 1:
        raise DualPipeConfigError(f"need at least one micro-batch per iteration, got {num_microbatches}: raise "
                                  f"--global-batch-size")
    try:
        return padded_microbatches(schedule, pp, num_microbatches, forward_only)
    except ValueError as e:
        raise DualPipeConfigError(str(e)) from None


def forward_backward_dualpipe(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    schedule: str = "dualpipe",
    zero_bubble: bool = True,
    p2p_timeout: float = DEFAULT_TIMEOUT_S,
):
    """Run one iteration of ``schedule`` over ``num_microbatches`` micro-batches (both
    directions together). ``model`` is ``[model_dir0, model_dir1]`` for DualPipe/DualPipeV."""
    model = list(model) if isinstance(model, (list, tuple)) else [model]
    if p2p_communicator is not None or pg_collection is not None:
        raise DualPipeConfigError(f"{schedule} uses megatron-core's parallel_state groups; custom "
                                  f"p2p_communicator / pg_collection are not supported yet: pass p2p_communicator=None "
                                  f"and pg_collection=None, or use --pipeline-schedule 1f1b")
    config = get_model_config(model[0])
    padded = validate(schedule, model, num_microbatches, forward_only, adjust_tensor_shapes_fn, config, zero_bubble)
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise DualPipeConfigError(f"{schedule} reads both directions from one data iterator; got a list of "
                                      f"{len(data_iterator)}: pass one iterator (or a list of one)")
        data_iterator = data_iterator[0]

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    global_ranks = dist.get_process_group_ranks(pp_group)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = len(global_ranks)
    program = compile_program(schedule, pp, padded, forward_only)
    layout = program.schedule.layout
    real_per_dir = split_microbatches(schedule, num_microbatches)
    if padded != num_microbatches and (schedule, pp, num_microbatches, forward_only) not in _PADDING_REPORTED:
        _PADDING_REPORTED.add((schedule, pp, num_microbatches, forward_only))
        if dist.get_rank() == 0:
            log.warning("megatron-dualpipe: %s with pp=%d needs %d micro-batches, got %d: added %d fake "
                        "micro-batch(es) (no data, no compute, zero loss and gradient)%s", schedule, pp, padded,
                        num_microbatches, padded - num_microbatches, " in evaluation" if forward_only else "")

    wgrad_store = None
    if zero_bubble and not forward_only and any(a.op == B for a in program.actions[rank]):
        from .. import wgrad
        wgrad.install()
        wgrad_store = wgrad.WeightGradStore()
    compute = MegatronStageCompute(
        schedule=schedule, model=model, layout=layout, rank=rank, forward_step_func=forward_step_func,
        source=MicrobatchSource(data_iterator), real=num_microbatches, real_per_dir=real_per_dir, config=config,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        global_ranks=global_ranks, wgrad_store=wgrad_store)
    shape = schedules.get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group())[0]
    device = next(model[0].parameters()).device
    spec = TensorSpec(tuple(shape), config.pipeline_dtype, device)
    p2p = P2P(pp_group, global_ranks, rank, timeout_s=p2p_timeout)
    if id(pp_group) not in _GROUPS_USED:
        p2p.first_collective(device)
        _GROUPS_USED.add(id(pp_group))

    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    no_sync = _no_sync_contexts(config, model) if not forward_only else contextlib.nullcontext()
    with no_sync:
        run_rank(program, rank, compute, p2p, spec)
    if wgrad_store is not None:
        wgrad_store.assert_empty()
    if not forward_only and config.grad_sync_func is not None:
        funcs = config.grad_sync_func if isinstance(config.grad_sync_func, list) else [config.grad_sync_func]
        for f, chunk in zip(funcs * len(model) if len(funcs) == 1 else funcs, model):
            f(chunk.parameters())

    losses = _losses_on_last_rank(compute.loss_store, layout, rank, global_ranks, pp_group, device)

    if config.finalize_model_grads_func is not None and not forward_only:
        tokens = compute.total_num_tokens
        if tokens is None:
            tokens = torch.zeros([], dtype=torch.int, device=device)
        tokens = tokens.to(device)
        if len(model) == 2:
            from .grads import finalize_dualpipe_grads
            finalize_dualpipe_grads(model, tokens if config.calculate_per_token_loss else None,
                                    finalize_func=config.finalize_model_grads_func, force_all_reduce=force_all_reduce)
        else:
            config.finalize_model_grads_func(model, tokens if config.calculate_per_token_loss else None,
                                             force_all_reduce=force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return losses


#: Pipeline groups that have had their first collective (see ``P2P.first_collective``).
_GROUPS_USED: set = set()


@contextlib.contextmanager
def _no_sync_contexts(config, model):
    """Keep data-parallel gradient reduction off until every micro-batch is done (each chunk's
    gradients are complete only after its last W), as Megatron's schedules do."""
    funcs = config.no_sync_func
    if funcs is None:
        yield
        return
    funcs = funcs if isinstance(funcs, list) else [funcs] * len(model)
    with contextlib.ExitStack() as stack:
        for f in funcs:
            stack.enter_context(f())
        yield


def _losses_on_last_rank(loss_store, layout: Layout, rank: int, global_ranks, group, device) -> List[Any]:
    """Gather the loss entries of every direction onto the last pipeline rank.

    Each direction's entries live where its last stage is: DualPipe direction 1 and DualPipeV
    finish on rank 0. They are shipped to rank pp-1 as tensors (a small header of keys and
    shapes first), in global micro-batch order: direction 0, then direction 1.
    """
    last = layout.pp - 1
    result: List[Any] = []
    for d in layout.directions:
        final = layout.stages(d)[-1]
        if not layout.is_last(d, final):
            continue  # DualPipeV's first chunk: its micro-batches go on up the V
        owner, entries = layout.rank_of(d, final), loss_store[d]
        if owner == last:
            if rank == last:
                result.extend(entries)
            continue
        if rank == owner:
            _send_entries(entries, global_ranks[last], group)
        elif rank == last:
            result.extend(_recv_entries(global_ranks[owner], group, device))
    return result if rank == last else []


def _header(entries) -> list:
    head = []
    for e in entries:
        if isinstance(e, dict) and all(isinstance(v, torch.Tensor) for v in e.values()):
            head.append(("dict", [(k, tuple(v.shape), v.dtype) for k, v in e.items()]))
        elif isinstance(e, torch.Tensor):
            head.append(("tensor", [(None, tuple(e.shape), e.dtype)]))
        else:
            head.append(("object", e))
    return head


def _send_entries(entries, dst: int, group) -> None:
    head = _header(entries)
    dist.send_object_list([head], dst=dst, group=group)
    tensors = [t.detach().contiguous() for e in entries
               for t in (e.values() if isinstance(e, dict) else [e]) if isinstance(t, torch.Tensor)]
    if tensors:
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst, group) for t in tensors]):
            req.wait()


def _recv_entries(src: int, group, device) -> List[Any]:
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    head = box[0]
    bufs = [torch.empty(shape, dtype=dtype, device=device) for kind, spec in head if kind != "object"
            for _, shape, dtype in spec]
    if bufs:
        for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src, group) for t in bufs]):
            req.wait()
    out, it = [], iter(bufs)
    for kind, spec in head:
        if kind == "dict":
            out.append({k: next(it) for k, _, _ in spec})
        elif kind == "tensor":
            out.append(next(it))
        else:
            out.append(spec)
    return out
