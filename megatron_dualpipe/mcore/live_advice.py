"""``megatron-dualpipe advise`` from a real run: measure one training iteration, log the choice.

A user who already trains with an executor schedule (``--dualpipe-advise`` in Megatron-LM,
``get_forward_backward_func(schedule, advise=True)`` in megatron-core) gets, once, at the end of
the first training iteration, what :func:`megatron_dualpipe.advise.advise` says for the costs
that iteration measured, on global rank 0's log. Nothing is guessed:

* stage costs: every rank's units are timed (the trace's in-memory recorder); per op the
  median over the rank's units, then the largest over the pipeline ranks (one ``all_reduce``
  of a few numbers over the pipeline group: the slowest stage sets the pace);
* activation memory of one micro-batch on one stage: per forward unit of the rank (not fused
  with a backward), the bytes of the distinct storages autograd saved for backward while it
  ran (parameters excluded; nothing it saves is freed before its backward, so addresses are
  not reused within it); the mean over the rank's forwards, the largest over the ranks;
* parameter memory of one stage: its parameters, their fp32 gradients and Adam's two fp32
  moments (plus an fp32 master copy for 16-bit parameters), i.e. what Megatron's plain
  optimizer holds; the distributed optimizer shards the optimizer part over data parallel;
* memory limit: the accelerator's total memory when there is one (none on the CPU);
* communication: the links of the job (P2P between pipeline neighbours, the bd pair, data
  parallel) timed right after the iteration by :mod:`.comm_probe`, the gradient bytes of a stage
  (its parameters' main-gradient bytes) and one P2P message's bytes: the advice then ranks the
  schedules by the iteration, makespan plus exposed gradient communication.

The first iteration includes one-time costs (allocations, kernel selection): the medians keep
them out of the per-op costs as long as each op ran a few times.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..executor.trace import KeptRecorder
from ..schedule import F

log = logging.getLogger("megatron_dualpipe")

_MB = float(1 << 20)
#: Columns of the all-reduced vector: per-op medians (ms), then activation bytes per micro-batch.
_OPS = ("F", "B", "W", "BW", "FB")


class LiveAdvice:
    """Measures the first training call it is given (:meth:`measuring`), then logs the advice."""

    def __init__(self):
        self.done = False

    def wanted(self, forward_only: bool) -> bool:
        return not self.done and not forward_only

    @contextlib.contextmanager
    def measuring(self, model: Sequence[torch.nn.Module]) -> Iterator[KeptRecorder]:
        """Around ``run_rank``: yields the recorder to pass it, counts the saved activations."""
        recorder = KeptRecorder()
        params = {p.data_ptr() for chunk in model for p in chunk.parameters()}
        self._packs: List[Tuple[float, int, int]] = []  # (perf_counter, storage address, bytes)

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                self._packs.append((time.perf_counter(), storage.data_ptr(), storage.nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield recorder
        self._recorder = recorder

    def report(self, *, spec_name: str, pp: int, microbatches: int, model, group, actions, is_fake,
               device: torch.device, message_bytes: float = 0.0) -> None:
        """Every rank of the job calls it after the measured call (collectives on the pipeline,
        bd pair and data-parallel groups)."""
        from ..timeline import op_medians

        self.done = True
        records = self._recorder.records
        medians = op_medians(records[-1]) if records else {}
        activation = _forward_saved_bytes(records[-1], self._recorder.origins[-1], self._packs, actions, is_fake) \
            if records else 0.0
        values = torch.tensor([medians.get(op, -1.0) for op in _OPS] + [activation], dtype=torch.float64,
                              device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        links = _links(spec_name, group, device)
        if dist.get_rank() != 0:
            return
        per_op = {op: v for op, v in zip(_OPS, values.tolist()) if v >= 0}
        comm = comm_model(links, pp, stage_grad_bytes(model[0]), message_bytes)
        message = advice_text(spec_name, pp, microbatches, per_op, values[-1].item(),
                              stage_parameter_bytes(model[0]), memory_limit_bytes(device), comm=comm)
        log.info("megatron-dualpipe: %s", message)


def _forward_saved_bytes(record: dict, origin: float, packs, actions, is_fake) -> float:
    """Mean over the record's real forward units of the distinct bytes saved while each ran."""
    per_unit: List[float] = []
    for indices, _, started, ended in record["units"]:
        a = actions[indices[0]]
        if len(indices) != 1 or a.op != F or is_fake(a):
            continue
        lo, hi = origin + started, origin + ended
        seen: Dict[int, int] = {ptr: n for t, ptr, n in packs if lo <= t <= hi}
        per_unit.append(float(sum(seen.values())))
    return sum(per_unit) / len(per_unit) if per_unit else 0.0


def _links(spec_name: str, group, device):
    from ..schedule.layout import BIDIRECTIONAL
    from ..schedule.registry import get
    from .comm_probe import measure

    return measure(group, device, get(spec_name).layout_kind == BIDIRECTIONAL)


def comm_model(links, pp: int, grad_bytes: float, message_bytes: float):
    """The communication model of the measured links (None when none was measured); a link not
    measured (no bd pair, dp=1) is taken as the first measured one of bd, dp, P2P."""
    from ..schedule.comm_cost import CommModel, Network, Placement

    known = links.bd or links.dp or links.p2p
    if known is None:
        return None
    return CommModel(Placement(pp, links.dp_size), Network(known, known), grad_bytes, message_bytes,
                     bd_link=links.bd, dp_link=links.dp, p2p_link=links.p2p)


def stage_grad_bytes(chunk: torch.nn.Module) -> float:
    """Bytes of a stage's gradients as reduced: Megatron's ``main_grad`` where there is one."""
    total = 0
    for p in chunk.parameters():
        g = getattr(p, "main_grad", None)
        total += p.numel() * (g.element_size() if g is not None else 4)
    return float(total)


def advice_text(schedule: str, pp: int, microbatches: int, per_op: dict, activation_bytes: float,
                parameter_bytes: float, limit_bytes: Optional[float], comm=None) -> str:
    """The advice for measured per-op costs (ms) and memory (bytes), as the log prints it."""
    from ..advise import advise
    from ..timeline import slowest_costs

    costs = slowest_costs([per_op])
    advice = advise(pp, [microbatches], costs, activation_memory=activation_bytes / _MB,
                    parameter_memory=parameter_bytes / _MB,
                    memory_limit=None if limit_bytes is None else limit_bytes / _MB, comm=comm)
    head = (f"advice from the first training iteration of {schedule} (pp={pp}, M={microbatches}; costs in ms: "
            f"per op the slowest rank's median; memory in MiB per rank):")
    return "\n".join([head, *advice.format().splitlines()])


def stage_parameter_bytes(chunk: torch.nn.Module) -> float:
    """A stage's parameters with fp32 gradients and Adam's fp32 moments (+ an fp32 master copy
    of 16-bit parameters): bytes."""
    total = 0
    for p in chunk.parameters():
        per = p.element_size() + 4 + 8 + (4 if p.element_size() < 4 else 0)
        total += p.numel() * per
    return float(total)


def memory_limit_bytes(device: torch.device) -> Optional[float]:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None
