"""Which stages each rank holds under a schedule, and what they cost together: how DualPipe's pairing of stage ``i``
with ``pp-1-i`` evens out a heavy first or last stage that 1F1B leaves alone.

A rank's load is its work per micro-batch: 1F1B ``c[i]``, DualPipe ``(c[i] + c[pp-1-i]) / 2`` (each copy runs one
direction's half), DualPipeV ``v[i] + v[2pp-1-i]``; the slowest rank's share of the mean is what uneven stages cost.
Standard library only, like ``schedule``."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..schedule import registry, stage_layout
from ..schedule.layout import BIDIRECTIONAL, UNIDIRECTIONAL, V_SHAPE, Layout

__all__ = ["held", "loads", "views", "layout_costs", "parse_costs", "parse_layer_costs", "report"]

#: A layer letter's cost where ``--layer-costs`` does not say (``stage_layout.KINDS``).
DEFAULT_LAYER_COSTS = {"E": 0.0, "t": 1.0, "m": 1.0, "L": 0.0}


def held(schedule: str, pp: int) -> List[Tuple[int, ...]]:
    """The stages of each rank (model[0] first): 1F1B ``(i,)``, DualPipe ``(i, pp-1-i)``, DualPipeV ``(i, 2pp-1-i)``."""
    layout = Layout(registry.get(schedule).layout_kind, pp)
    return [layout.stages_on(r) for r in range(pp)]


def loads(schedule: str, costs: Sequence[float]) -> List[float]:
    """Each rank's work per micro-batch (module docstring) for ``costs`` of the schedule's stages."""
    spec = registry.get(schedule)
    pp = len(costs) // (spec.model_stages(1))
    share = 0.5 if spec.mirrored else 1.0  # each DualPipe copy runs one direction's half
    return [share * sum(costs[s] for s in stages) for stages in held(schedule, pp)]


def views(costs: Sequence[float], pp: int) -> Tuple[List[float], List[float]]:
    """(the ``pp`` stages' costs, the ``2*pp`` V-stages') from either: a stage is two equal V-stages,
    V-stages ``2t`` + ``2t+1`` are stage t (as in ``stage_layout.paired``)."""
    if len(costs) == pp:
        return list(costs), [c / 2 for c in costs for _ in (0, 1)]
    if len(costs) == 2 * pp:
        return [costs[i] + costs[i + 1] for i in range(0, 2 * pp, 2)], list(costs)
    raise ValueError(f"{len(costs)} stage costs for pp={pp}: give {pp} (one per stage) or {2 * pp} (DualPipeV's "
                     f"V-stages)")


def layout_costs(text: str, layer_costs: Dict[str, float], pp: int) -> Tuple[List[float], List[float]]:
    """``views`` of a layout of ``pp`` or ``2*pp`` stages (``stage_layout.halved``) priced per layer letter."""
    stages = stage_layout.parse(text)
    price = dict(DEFAULT_LAYER_COSTS, **layer_costs)
    if len(stages) == pp:
        stages = stage_layout.halved(stages)
    elif len(stages) != 2 * pp:
        raise ValueError(f"--layout {text!r} has {len(stages)} stages: give {pp} (1F1B, DualPipe) or {2 * pp} "
                         f"(DualPipeV's V-stages) for pp={pp}")
    return views([sum(price[c] for c in s) for s in stages], pp)


def parse_costs(text: str) -> List[float]:
    """``3,4,4,2`` -> ``[3.0, 4.0, 4.0, 2.0]`` (``4*3`` repeats a value)."""
    out: List[float] = []
    for part in text.replace(" ", "").split(","):
        value, _, times = part.partition("*")
        out += [float(value)] * int(times or 1)
    if not out or any(not c >= 0 for c in out):
        raise ValueError(f"stage costs {text!r}: give numbers >= 0, e.g. 3,4,4,2 or 3,4*14,2")
    return out


def parse_layer_costs(text: str) -> Dict[str, float]:
    """``E=0.5,t=1,L=2`` -> the cost of each layer letter (E embedding, t layer, m MTP, L output and loss)."""
    out = {}
    for part in text.replace(" ", "").split(","):
        letter, _, value = part.partition("=")
        if letter not in DEFAULT_LAYER_COSTS or not value:
            raise ValueError(f"--layer-costs {text!r}: give LETTER=COST for the letters E, t, m, L, e.g. E=0.5,t=1,L=2")
        out[letter] = float(value)
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _cell(schedule: str, stages: Tuple[int, ...], costs: Sequence[float], load: float) -> str:
    if len(stages) == 1:
        return f"{stages[0]}: {_fmt(costs[stages[0]])}"
    a, b = stages
    return f"{a}+{b}: {_fmt(costs[a])}+{_fmt(costs[b])}={_fmt(costs[a] + costs[b])}" + \
        (f" (/2 {_fmt(load)})" if registry.get(schedule).mirrored else "")


def report(stage_costs: Sequence[float], v_costs: Sequence[float], schedules: Sequence[str],
           unit: str = "") -> List[str]:
    """Per rank the stages each schedule puts there and their cost; the slowest rank against the mean."""
    pp = len(stage_costs)
    names = [n for n in schedules if registry.get(n).layout_kind in (UNIDIRECTIONAL, BIDIRECTIONAL, V_SHAPE)
             and not registry.get(n).pp_problem(pp)]
    of = {n: v_costs if registry.get(n).layout_kind == V_SHAPE else stage_costs for n in names}
    load = {n: loads(n, of[n]) for n in names}
    mean = sum(stage_costs) / pp
    cells = {n: [_cell(n, st, of[n], load[n][r]) for r, st in enumerate(held(n, pp))] for n in names}
    width = {n: max(len(n), *(len(c) for c in cells[n])) for n in names}
    lines = [f"stages each rank holds and their cost{unit} (DualPipe's two copies each run half the micro-batches: "
             f"/2; DualPipeV's V-stages are {2 * pp}):",
             "  rank  " + "  ".join(f"{n:<{width[n]}}" for n in names)]
    lines += [f"  {r:>4}  " + "  ".join(f"{cells[n][r]:<{width[n]}}" for n in names) for r in range(pp)]
    slowest = {n: (max(load[n]) / mean, load[n].index(max(load[n]))) for n in names} if mean else {}
    lines.append("  slowest rank's load / mean " + _fmt(mean) + ": " + ", ".join(
        f"{n} x{ratio:.3f} (rank {rank})" for n, (ratio, rank) in slowest.items()) if mean else
        "  (every stage costs 0)")
    heavy = max(range(pp), key=lambda s: (round(abs(stage_costs[s] - mean), 12), stage_costs[s]))  # heavy on a tie
    cost = stage_costs[heavy]
    if not (mean and heavy in (0, pp - 1) and abs(cost - mean) > 1e-9 * mean):
        return lines
    # what each schedule does with an end stage off the mean
    said = [f"  stage {heavy} is {'heavy' if cost > mean else 'light'} ({_fmt(cost)}, the mean {_fmt(mean)})"]
    if registry.ONE_F_ONE_B in slowest:
        said.append(f"1F1B leaves it alone on rank {heavy} (slowest rank x{slowest[registry.ONE_F_ONE_B][0]:.3f})")
    if registry.DUALPIPE in slowest:
        said.append(f"DualPipe pairs it with stage {pp - 1 - heavy}, the other end, on ranks {heavy} and "
                    f"{pp - 1 - heavy}, each running half the micro-batches through each "
                    f"(x{slowest[registry.DUALPIPE][0]:.3f})")
    if registry.DUALPIPEV in slowest:
        ratio, rank = slowest[registry.DUALPIPEV]
        said.append(f"DualPipeV holds both ends, V-stages 0 and {2 * pp - 1} (embedding and output layer), on rank 0 "
                    f"(x{ratio:.3f}" + ("; a layout giving those two V-stages fewer layers evens it)"
                                        if rank == 0 and ratio > 1 + 1e-9 else ")"))
    return lines + ["; ".join(said)]
