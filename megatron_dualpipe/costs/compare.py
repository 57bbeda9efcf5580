"""One model under every schedule: what each would cost, from the simulator. Costs are per *stage* of a
pp-stage pipeline; DualPipeV's chunks are half a stage, so it runs at half those costs, its activations
counted in stages. A short batch runs padded, fakes costing nothing. Standard library only."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.padding import Padded, build_padded
from ..schedule.placement import PlacementError
from ..schedule.registry import ScheduleError, ScheduleSpec, distinct_orders
from ..schedule.registry import spec as get
from ..schedule.simulate import Costs, SimResult, simulate
from .comm_cost import MEGATRON, PAIRED, CommModel, GradComm, grad_comm


def stage_fraction(spec: ScheduleSpec, pp: int) -> float:
    """How much of one pipeline stage a model chunk of ``spec`` is (DualPipeV: 1/2)."""
    return pp / spec.model_stages(pp)


def parameter_copies(spec: ScheduleSpec, pp: int) -> float:
    """Stages' worth of parameters one rank holds: DualPipe 2 (its partner's mirror too), others 1."""
    return spec.chunks_per_rank * stage_fraction(spec, pp)


@dataclass(frozen=True)
class Row:
    """One schedule on the model: numbers, or ``problem`` saying why it cannot run."""

    name: str
    problem: Optional[str] = None
    microbatches: int = 0          # run, fakes included
    costs: Optional[Costs] = None  # as simulated: per stage, or per chunk (DualPipeV)
    makespan: float = 0.0
    bubble: float = 0.0            # maximum over ranks
    formula: Optional[float] = None
    peak_activations: float = 0.0  # stages' worth of one micro-batch's activations, maximum over ranks
    peak_weight_grad_states: float = 0.0  # deferred weight gradients pending (stages' worth)
    parameter_copies: float = 0.0  # stages' worth of parameters per rank
    grad: Optional[GradComm] = None  # the gradient communication, when a CommModel was given

    @property
    def exposed(self) -> float:
        """The largest exposure of a rank's gradient communication past the makespan."""
        return self.grad.iteration - self.makespan if self.grad else 0.0

    @property
    def iteration(self) -> float:
        """Makespan plus the exposed gradient communication: what the model predicts per iteration."""
        return self.makespan + self.exposed

    def to_json(self) -> dict:
        if self.problem:
            return {"schedule": self.name, "problem": self.problem}
        grad = {} if self.grad is None else {
            "iteration": self.iteration, "grad_exposed": self.exposed,
            "grad_exposed_per_rank": self.grad.exposed, "bd_sum_per_rank": self.grad.bd_total,
            "dp_reduce_per_rank": self.grad.dp_total}
        return {**grad, "schedule": self.name, "microbatches": self.microbatches, "makespan": self.makespan,
                "bubble": self.bubble, "formula_bubble": self.formula, "peak_activations": self.peak_activations,
                "peak_weight_grad_states": self.peak_weight_grad_states,
                "parameter_copies": self.parameter_copies,
                "costs": {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "fb": self.costs.fused,
                          "p2p": self.costs.p2p}}


#: name -> (the padded schedule, its simulation), for schedules a caller has simulated already.
Known = Dict[str, Tuple[Padded, SimResult]]


def run(name: str, pp: int, real: int, stage_costs: Costs, known: Optional[Known] = None,
        comm: Optional[CommModel] = None) -> Row:
    """Simulate ``name`` on the model whose stages cost ``stage_costs`` (``comm``: and its communication)."""
    spec = get(name)
    frac = stage_fraction(spec, pp)
    costs = stage_costs.scaled(frac)
    comm = None if comm is None else comm.for_schedule(spec.mirrored)
    if known and name in known:
        padded, res = known[name]
    else:
        try:
            padded = build_padded(name, pp, real)
        except ScheduleError as e:
            return Row(name, problem=str(e))
        s = padded.schedule
        res = simulate(s.layout, s.ranks, padded.costs(costs), p2p=comm.p2p if comm else None)
    grad = None if comm is None else grad_comm(padded.schedule, res, comm, frac, spec.defers_weight_grads,
                                               padded.is_fake)
    return Row(name, None, padded.schedule.microbatches, costs, res.makespan, max(res.bubble),
               spec.formula_bubble(pp, costs), max(res.peak_activations) * frac,
               max(t.peak_weight_grad_states for t in res.ranks) * frac, parameter_copies(spec, pp), grad)


def in_other_placement(name: str, pp: int, real: int, stage_costs: Costs,
                       comm: CommModel) -> Tuple[str, Optional[Row], Optional[str]]:
    """``name`` (a schedule with bd pairs) in the other rank placement than ``comm``'s: (the
    placement's name, the row there or None, why the pairs cannot be placed so or None)."""
    paired = not comm.placement.paired
    try:
        other = comm.with_placement(paired)
    except PlacementError as e:
        return PAIRED, None, str(e)
    return (PAIRED if paired else MEGATRON), run(name, pp, real, stage_costs, comm=other), None


def orders_with(name: str) -> List[str]:
    """One schedule per distinct order, ``name`` standing for its own (``executor-1f1b`` for ``1f1b``)."""
    mine = get(name)
    return [name if (get(n).generator, get(n).layout_kind) == (mine.generator, mine.layout_kind) else n
            for n in distinct_orders()]


def compare(pp: int, real: int, stage_costs: Costs, names: Optional[Sequence[str]] = None,
            known: Optional[Known] = None, comm: Optional[CommModel] = None) -> List[Row]:
    """Every schedule (one per distinct order unless ``names``) on the same model."""
    return [run(n, pp, real, stage_costs, known=known, comm=comm) for n in (names or distinct_orders())]


def fmt(x: Optional[float]) -> str:
    """A number as short as it can be said: 3, 2.5, 0.333, n/a, inf."""
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    if x == int(x):
        return str(int(x))
    # four significant digits at least, three decimals at most: 13038.712 -> 13039, 209.064 -> 209.1
    decimals = min(3, max(0, 4 - len(str(int(abs(x))))))
    return f"{x:.{decimals}f}".rstrip("0").rstrip(".") if decimals else str(int(round(x)))


def table(rows: Sequence[Row], mark: Optional[str] = None) -> List[str]:
    """Rows of :func:`compare` as an aligned text table; ``mark`` flags one schedule."""
    comm = any(r.grad is not None for r in rows)
    cells: List[Sequence[str]] = [("schedule", "M", "makespan", "bubble", "closed form", "peak act.", "params")
                                  + (("exposed", "iteration") if comm else ()),
                                  ("", "", "", "", "(its own costs)", "(stages)", "(stages/rank)")
                                  + (("grad. comm.", "") if comm else ())]
    for r in rows:
        if r.problem:
            cells.append((r.name, "cannot run: " + r.problem))
            continue
        cells.append((r.name, str(r.microbatches), fmt(r.makespan), fmt(r.bubble),
                      f"{get(r.name).bubble_formula} = {fmt(r.formula)}", fmt(r.peak_activations),
                      fmt(r.parameter_copies))
                     + ((fmt(round(r.exposed, 3)), fmt(round(r.iteration, 3))) if comm else ())
                     + (("<- this schedule",) if r.name == mark else ()))
    return align(cells, left=(0, 4, 9 if comm else 7))


def align(rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> List[str]:
    """Text columns, right-aligned but for ``left``; a row of two cells is printed as it is."""
    full = [r for r in rows if len(r) > 2]
    widths = [max(len(r[i]) for r in full if i < len(r)) for i in range(max(len(r) for r in full))]
    return [f"{r[0]:<{widths[0]}}  {r[1]}" if len(r) == 2 else
            "  ".join(c.ljust(widths[i]) if i in left else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
            for r in rows]
