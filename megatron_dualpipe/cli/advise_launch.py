"""``advise --launch-check``: the launch script's memory gate before torchrun, one line: a schedule
that does not fit the GPU's memory is refused (exit 3) naming the fastest that fits."""
from __future__ import annotations

import sys

#: Exit status of a launch whose schedule does not fit.
DOES_NOT_FIT = 3


def _modelled_name(m, names) -> str:
    """The advise row of the run's schedule: Megatron's 1f1b with a virtual pipeline is interleaved."""
    from ..schedule.registry import INTERLEAVED_1F1B, INTERLEAVED_1F1B_A2A, ONE_F_ONE_B

    if m.schedule == ONE_F_ONE_B and m.layers_per_virtual_stage:
        kind = INTERLEAVED_1F1B_A2A if m.a2a_overlap else INTERLEAVED_1F1B
        return next((n for n in names if n.startswith(kind)), kind)
    return m.schedule


def check(s, advice) -> int:
    """``s``: the model's setup (``advise_model.Setup``); ``advice``: advise's for it."""
    from ..costs.compare import fmt

    ch = advice.choices[0]
    rows = {o.row.name: o for o in ch.options if not o.row.problem}
    name = _modelled_name(s.model, list(rows))
    mine = rows.get(name)
    best = rows.get(ch.best) if ch.best else None
    limit = fmt(advice.memory_limit)
    if mine is None:
        print(f"advise: {name} is not modelled; no memory estimate")
        return 0
    where = f"{fmt(mine.memory)} GB per GPU by advise's estimate (limit {limit} GB, GPU={s.gpu.name})"
    if not mine.fits:
        fix = (f"use SCHEDULE={best.row.name} ({fmt(best.memory)} GB, fits)" if best is not None else
               ch.reason[ch.reason.find("try "):] if "try " in ch.reason else "no schedule fits")
        print(f"advise: error: SCHEDULE={name} needs {where}: {fix}; or set MEMORY_CHECK=0 to launch anyway",
              file=sys.stderr)
        return DOES_NOT_FIT
    if best is not None and best is not mine:
        gain = 100 * (mine.row.iteration - best.row.iteration) / mine.row.iteration
        print(f"advise: SCHEDULE={name} fits ({where}); {best.row.name} would be {gain:.1f}% shorter per iteration "
              f"({fmt(best.row.iteration)} ms against {fmt(mine.row.iteration)}) and fits ({fmt(best.memory)} GB)")
    else:
        print(f"advise: SCHEDULE={name} fits ({where}) and is the fastest that fits")
    return 0
