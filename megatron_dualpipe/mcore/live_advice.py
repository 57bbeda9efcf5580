"""``megatron-dualpipe advise`` from a real run: measure training iterations, log the choice once.

With ``--dualpipe-advise`` (Megatron-LM) or ``advise=True`` (megatron-core), global rank 0 logs what
:func:`megatron_dualpipe.costs.advice.advise` says for costs measured in :data:`MEASURED_ITERATIONS` training
iterations after a warm-up (:data:`DEFAULT_WARMUP`): the first iterations carry one-time costs in *every* unit,
which no median removes, and costs no real run can have are not advised from (:func:`cost_problem`). Measured:
per-op medians, the slowest pipeline rank's; the storages autograd saved in a lone forward; the parameters with
Megatron's plain optimizer state; the accelerator's memory; the job's links (:mod:`.comm_probe`).
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


#: Training iterations skipped before measuring (their units all carry one-time costs).
DEFAULT_WARMUP = 3
#: Training iterations measured and pooled after the warm-up.
MEASURED_ITERATIONS = 3


class LiveAdvice:
    """Skips ``warmup`` training calls, measures the next :data:`MEASURED_ITERATIONS`
    (:meth:`measuring`), then logs the advice once (:meth:`report`)."""

    def __init__(self, warmup: int = DEFAULT_WARMUP, measured: int = MEASURED_ITERATIONS):
        if warmup < 0 or measured < 1:
            raise ValueError(f"advise warm-up must be >= 0 and measured iterations >= 1, got {warmup}, {measured}")
        self.warmup, self.measured = warmup, measured
        self.done = False
        self.calls = 0  # training calls seen (the same on every rank: collectives stay matched)
        self._records: List[dict] = []
        self._measuring_now = False

    def wanted(self, forward_only: bool) -> bool:
        return not self.done and not forward_only

    @contextlib.contextmanager
    def measuring(self, model: Sequence[torch.nn.Module]) -> Iterator[Optional[KeptRecorder]]:
        """Around ``run_rank``: yields the recorder to pass it (None during the warm-up, which is
        not recorded) and, on the last measured call, counts the saved activations."""
        self.calls += 1
        self._measuring_now = self.calls > self.warmup
        if not self._measuring_now:
            yield None
            return
        recorder = KeptRecorder()
        last = self.calls == self.warmup + self.measured
        params = {p.data_ptr() for chunk in model for p in chunk.parameters()}
        self._packs: List[Tuple[float, int, int]] = []  # (perf_counter, storage address, bytes)

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                self._packs.append((time.perf_counter(), storage.data_ptr(), storage.nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if last else contextlib.nullcontext():
            yield recorder
        self._recorder = recorder
        self._records += recorder.records[-1:]

    def iterations(self) -> str:
        first, last = self.warmup + 1, self.warmup + self.measured
        return f"iterations {first}-{last}" if last > first else f"iteration {first}"

    def report(self, *, spec_name: str, pp: int, microbatches: int, model, group, actions, is_fake,
               device: torch.device, message_bytes: float = 0.0) -> None:
        """Called by every rank after each training call; after the last measured one the costs are all-reduced
        over the pipeline, the job's links timed, and rank 0 logs the advice."""
        from ..costs.comm_cost import CommModel, Network, Placement
        from ..executor.trace import op_medians
        from ..schedule.layout import BIDIRECTIONAL
        from ..schedule.registry import get
        from .comm_probe import measure

        if not self._measuring_now or len(self._records) < self.measured:
            return
        self.done = True
        records = self._records
        medians = op_medians(*records) if records else {}
        activation = _forward_saved_bytes(records[-1], self._recorder.origins[-1], self._packs, actions, is_fake) \
            if records else 0.0
        values = torch.tensor([medians.get(op, -1.0) for op in _OPS] + [activation], dtype=torch.float64,
                              device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
        links = measure(group, device, get(spec_name).layout_kind == BIDIRECTIONAL)
        if dist.get_rank() != 0:
            return
        per_op = {op: v for op, v in zip(_OPS, values.tolist()) if v >= 0}
        measured = (f"training {self.iterations()} of {spec_name}, the first {self.warmup} skipped as warm-up "
                    f"(--dualpipe-advise-warmup)")
        problem = cost_problem(per_op)
        if problem:
            log.warning("megatron-dualpipe: no advice from %s: %s", measured, problem)
            return
        # bytes of a stage's gradients as reduced: Megatron's main_grad where there is one
        grad_bytes = float(sum(p.numel() * getattr(getattr(p, "main_grad", None), "element_size", lambda: 4)()
                               for p in model[0].parameters()))
        # an unmeasured link (no bd pair, dp=1) is taken as the first measured one of bd, dp, P2P
        known = links.bd or links.dp or links.p2p
        comm = None if known is None else CommModel(
            Placement(pp, links.dp_size), Network(known, known), grad_bytes, message_bytes, bd_link=links.bd,
            dp_link=links.dp, p2p_link=links.p2p, **reduction_of(model))
        limit = float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None
        message = advice_text(spec_name, pp, microbatches, per_op, values[-1].item(),
                              stage_parameter_bytes(model[0]), limit, measured=measured, comm=comm)
        log.info("megatron-dualpipe: %s", message)


def cost_problem(per_op: Dict[str, float]) -> Optional[str]:
    """Why measured per-op medians (ms) cannot be a real run's, or None: a fused F&B unit costs at least the
    larger of its forward and backward."""
    b_key = "B" if "B" in per_op else "BW"
    fb, f, b = per_op.get("FB"), per_op.get("F"), per_op.get(b_key)
    if fb is None or f is None or b is None:
        return None
    if fb < max(f, b):
        return (f"the fused F&B units measured {fb:.2f} ms, less than F ({f:.2f} ms) or {b_key} ({b:.2f} ms) alone, "
                f"which a unit running both cannot be: the iterations were disturbed (warm-up, other work on the "
                f"machine); raise --dualpipe-advise-warmup or measure on an otherwise idle machine")
    return None


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


def reduction_of(model) -> dict:
    """How the running job reduces its gradients, as ``CommModel`` fields (optimizer, overlap, copy sum)."""
    from .copies import of

    cfg = getattr(model[0], "ddp_config", None)
    mode = of(model).way
    return {"distributed_optimizer": bool(cfg is not None and cfg.use_distributed_optimizer),
            "overlap_grad_reduce": bool(cfg is None or cfg.overlap_grad_reduce), "bd_mode": mode}


def advice_text(schedule: str, pp: int, microbatches: int, per_op: dict, activation_bytes: float,
                parameter_bytes: float, limit_bytes: Optional[float], measured: Optional[str] = None,
                comm=None) -> str:
    """The advice for measured per-op costs (ms) and memory (bytes), as the log prints it."""
    from ..costs.advice import advise
    from ..executor.trace import slowest_costs

    costs = slowest_costs([per_op])
    advice = advise(pp, [microbatches], costs, activation_memory=activation_bytes / _MB,
                    parameter_memory=parameter_bytes / _MB,
                    memory_limit=None if limit_bytes is None else limit_bytes / _MB, comm=comm)
    where = measured or f"training iterations of {schedule}"
    head = (f"advice for pp={pp}, M={microbatches} from {where}; costs in ms: per op the slowest rank's median; "
            f"memory in MiB per rank:")
    return "\n".join([head, *advice.format().splitlines()])


def stage_parameter_bytes(chunk: torch.nn.Module) -> float:
    """Bytes of a stage's parameters with fp32 gradients and Adam's fp32 moments (+ an fp32 master copy of
    16-bit parameters)."""
    return float(sum(p.numel() * (p.element_size() + 12 + (4 if p.element_size() < 4 else 0))
                     for p in chunk.parameters()))
