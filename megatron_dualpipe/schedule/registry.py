"""The schedule registry: every fact about a schedule, in one place.

A schedule is one :class:`ScheduleSpec`; the command line, the data split, the Megatron checks, the
dispatcher and the docs' tables all read it, so adding a schedule is one entry plus its generator.
``executor-1f1b`` is Megatron's ``1f1b`` order run by this project's executor, for comparisons on equal
terms; ``interleaved-1f1b`` (``-a2a``: with the EP all-to-all overlap; ``-vN``: virtual pipeline size N,
plain 2) is only simulated: :data:`NAMES`, :data:`SPECS` and :func:`get` hold the schedules that run,
:func:`spec` finds every one. ``M`` counts the whole iteration's micro-batches, both directions together.
Standard library only.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .actions import Action, RankActions
from .generators import dualpipe_rank, interleaved_1f1b_rank, one_f_one_b_rank
from .layout import BIDIRECTIONAL, INTERLEAVED, UNIDIRECTIONAL, V_SHAPE, Layout

#: The names, for code that means one schedule in particular.
ONE_F_ONE_B = "1f1b"
EXECUTOR_1F1B = "executor-1f1b"
ZB_H1 = "zb-h1"
DUALPIPE = "dualpipe"
DUALPIPEV = "dualpipev"
INTERLEAVED_1F1B = "interleaved-1f1b"
INTERLEAVED_1F1B_A2A = "interleaved-1f1b-a2a"

#: ``ScheduleSpec.runs_on``: megatron-core's own schedule function runs it.
MEGATRON = "megatron"
#: ``ScheduleSpec.runs_on``: this project's executor runs it (``megatron_dualpipe.executor``).
EXECUTOR = "executor"
#: ``ScheduleSpec.runs_on``: simulated and advised only (Megatron runs it under another name).
MODELLED = "modelled"


class ScheduleError(ValueError):
    """A schedule cannot be built for these arguments; the message says what would work."""


Bubble = Optional[Callable[[int, float, float, float, float], float]]  # (pp, f, b, w, fb) -> bubble


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is; its methods answer the questions callers ask of it."""

    name: str
    #: One line for ``--help`` texts and tables.
    summary: str
    #: ``layout.UNIDIRECTIONAL`` / ``BIDIRECTIONAL`` / ``V_SHAPE``.
    layout_kind: str
    #: Action order of one rank: ``(layout, microbatches, rank) -> [Action]``.
    generator: Callable[[Layout, int, int], List[Action]]
    #: ``MEGATRON``, ``EXECUTOR`` or ``MODELLED``.
    runs_on: str
    #: The closed-form bubble (DeepSeek's / the Zero Bubble paper's), as text and as a function.
    bubble_formula: str
    bubble: Bubble
    #: The pipeline size must be a multiple of this (DualPipe pairs rank i with pp-1-i).
    pp_multiple: int = 1
    #: The order needs at least ``min_microbatches_per_rank * pp`` micro-batches (and one)...
    min_microbatches_per_rank: int = 0
    #: ... and a multiple of this many (DualPipe: both directions equally).
    microbatch_multiple: int = 1
    #: Fewest real micro-batches per pipeline rank that training pads up to what the order needs.
    min_real_microbatches_per_rank: int = 0
    #: The costs the simulator and the formula take are per model chunk (DualPipeV: half a stage).
    costs_per_chunk: bool = False
    #: The order splits backwards into B and a later W (``--no-dualpipe-zero-bubble``: B runs all, W nothing).
    defers_weight_grads: bool = True
    #: Model chunks per rank of an interleaved layout (Megatron's virtual pipeline size).
    virtual: int = 1
    #: Micro-batches come in groups of pp (Megatron's interleaved 1F1B): a multiple of pp, no padding.
    microbatches_multiple_of_pp: bool = False

    # -- layout ------------------------------------------------------------------------------
    def layout(self, pp: int) -> Layout:
        return Layout(self.layout_kind, pp, self.virtual if self.layout_kind == INTERLEAVED else 1)

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (Megatron's ``model`` list length)."""
        return len(self.layout(1).directions)

    def model_stages(self, pp: int) -> int:
        """Stages the model is cut into (DualPipe's two chunks are copies): the layer count must divide by it."""
        return pp if self.mirrored else self.chunks_per_rank * pp

    @property
    def mirrored(self) -> bool:
        """Whether every stage has two copies, one per direction (``Layout.mirrored``: DualPipe)."""
        return self.layout_kind == BIDIRECTIONAL

    @property
    def data_directions(self) -> int:
        """How many directions read micro-batches from data (DualPipe: both ends of the pipe)."""
        return 2 if self.mirrored else 1

    # -- rules -------------------------------------------------------------------------------
    def pp_problem(self, pp: int, flag: str = "--pp") -> Optional[str]:
        """Why this schedule cannot run on ``pp`` ranks (naming ``flag`` and the fix), or None."""
        if pp >= 1 and pp % self.pp_multiple == 0:
            return None
        good = max(self.pp_multiple, pp + (-pp) % self.pp_multiple)
        what = "an even pipeline size >= 2" if self.pp_multiple == 2 else f"a multiple of {self.pp_multiple}"
        why, alternative = (" (ranks i and pp-1-i hold mirrored copies of the same stages)", f", or use {V_SCHEDULE}") \
            if self.mirrored else ("", "")
        return f"{self.name} needs {what}{why}, got {pp}: set {flag} to {good}{alternative}"

    def min_microbatches(self, pp: int) -> int:
        """Fewest micro-batches the order itself needs (after padding)."""
        return max(1, self.min_microbatches_per_rank * pp)

    def min_real_microbatches(self, pp: int, forward_only: bool = False) -> int:
        """Fewest real micro-batches accepted; evaluation (forward only) pads freely."""
        return 1 if forward_only else max(1, self.min_real_microbatches_per_rank * pp)

    def microbatch_problem(self, pp: int, microbatches: int) -> Optional[str]:
        """Why the order cannot be built for ``microbatches`` (after padding), or None."""
        need = self.min_microbatches(pp)
        if self.microbatches_multiple_of_pp and (microbatches < pp or microbatches % pp):
            good = max(pp, microbatches + (-microbatches) % pp)
            return (f"{self.name} (Megatron's interleaved 1F1B, micro-batch groups of pp) needs a multiple of "
                    f"pp={pp} micro-batches, got {microbatches}: use {good}")
        if microbatches >= need and microbatches % self.microbatch_multiple == 0:
            return None
        good = max(need, microbatches + (-microbatches) % self.microbatch_multiple)
        even = "an even number of " if self.microbatch_multiple == 2 else ""
        least = f" >= {self.min_microbatches_per_rank}*pp={need}" if self.min_microbatches_per_rank > 1 else ""
        return (f"{self.name} needs {even}micro-batches{least}, got {microbatches}: use {good} (the executor pads "
                f"a short batch with fake micro-batches when it has at least "
                f"{self.min_real_microbatches(pp)} real ones)")

    def padded_microbatches(self, pp: int, real: int, forward_only: bool = False) -> int:
        """How many micro-batches run (real plus fake) for ``real`` real ones; :class:`ScheduleError`
        below :meth:`min_real_microbatches`."""
        least = self.min_real_microbatches(pp, forward_only)
        if self.microbatches_multiple_of_pp:  # Megatron pads nothing
            problem = self.microbatch_problem(pp, real)
            if problem:
                raise ScheduleError(problem)
            return real
        if real < least:
            raise ScheduleError(
                f"{self.name} needs at least {least} micro-batches per iteration with pp={pp}, got {real}: raise "
                f"--global-batch-size to at least {least} x micro-batch-size x data-parallel size (with fewer "
                f"than {self.min_microbatches(pp)} the executor pads with fake micro-batches)")
        return max(self.min_microbatches(pp), real + (-real) % self.microbatch_multiple)

    def formula_bubble(self, pp: int, costs) -> Optional[float]:
        """The closed-form bubble for ``costs`` (a ``simulate.Costs``), None where pp is invalid."""
        if self.pp_problem(pp) or self.bubble is None:
            return None
        return self.bubble(pp, costs.f, costs.b, costs.w, costs.fused)

    # -- data --------------------------------------------------------------------------------
    def split(self, real: int) -> List[int]:
        """Real micro-batches per data direction: DualPipe gives direction 0 the first half
        (rounded up) of the global batch and direction 1 the rest."""
        if self.data_directions == 1:
            return [real]
        first = (real + 1) // 2
        return [first, real - first]

    def global_index(self, real: int, d: int, mb: int) -> int:
        """The global batch's index of micro-batch ``mb`` of direction ``d``."""
        return mb if self.data_directions == 1 or d == 0 else (real + 1) // 2 + mb

    def is_fake(self, real: int, d: int, mb: int) -> bool:
        """Whether micro-batch ``mb`` of direction ``d`` is padding (no data, no compute)."""
        return mb >= self.split(real)[d if self.data_directions > 1 else 0]


_ONE_F_ONE_B = dict(layout_kind=UNIDIRECTIONAL, generator=one_f_one_b_rank, bubble_formula="(pp-1)(f+b)",
                    bubble=lambda pp, f, b, w, fb: (pp - 1) * (f + b), defers_weight_grads=False)

SPECS: Dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec(ONE_F_ONE_B, "Megatron's own schedule (1F1B; interleaved 1F1B with a virtual pipeline)",
                 runs_on=MEGATRON, **_ONE_F_ONE_B),
    ScheduleSpec(EXECUTOR_1F1B, "the 1F1B order run by megatron_dualpipe's executor (for comparisons)",
                 runs_on=EXECUTOR, **_ONE_F_ONE_B),
    ScheduleSpec(ZB_H1, "ZB-H1: 1F1B with deferred weight gradients filling the cool-down",
                 UNIDIRECTIONAL, functools.partial(one_f_one_b_rank, zero_bubble=True), EXECUTOR, "(pp-1)(f+b-2w)",
                 lambda pp, f, b, w, fb: (pp - 1) * (f + b - 2 * w)),
    ScheduleSpec(DUALPIPE, "DeepSeek's DualPipe: bidirectional, a mirrored copy of stage pp-1-i on rank i",
                 BIDIRECTIONAL, dualpipe_rank, EXECUTOR, "(pp/2-1)(fb+b-3w)",
                 lambda pp, f, b, w, fb: (pp / 2 - 1) * (fb + b - 3 * w),
                 pp_multiple=2, min_microbatches_per_rank=2, microbatch_multiple=2, min_real_microbatches_per_rank=1),
    ScheduleSpec(DUALPIPEV, "DualPipeV: DualPipe cut in half, two V-shaped chunks of half a stage per rank",
                 V_SHAPE, dualpipe_rank, EXECUTOR, "(S/2-1)(fb+b-3w), S=2pp chunk stages",
                 lambda pp, f, b, w, fb: (2 * pp / 2 - 1) * (fb + b - 3 * w),
                 min_microbatches_per_rank=2, min_real_microbatches_per_rank=1, costs_per_chunk=True),
)}

_INTERLEAVED = dict(layout_kind=INTERLEAVED, runs_on=MODELLED, defers_weight_grads=False, virtual=2,
                    costs_per_chunk=True, min_microbatches_per_rank=1, microbatches_multiple_of_pp=True)

#: Schedules simulated and advised only: Megatron runs them as ``1f1b`` with a virtual pipeline.
MODELLED_SPECS: Dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec(INTERLEAVED_1F1B, "Megatron's interleaved 1F1B (virtual pipeline, v chunks of 1/v stage per rank; "
                 "simulated only: run it as 1f1b with --virtual-pipeline-model-parallel-size)",
                 generator=interleaved_1f1b_rank, bubble_formula="(pp-1)(f+b), f, b per chunk",
                 bubble=_ONE_F_ONE_B["bubble"], **_INTERLEAVED),
    ScheduleSpec(INTERLEAVED_1F1B_A2A, "Megatron's interleaved 1F1B with --overlap-moe-expert-parallel-comm: each "
                 "steady step's F and B one fused unit (fb), like DualPipe's F&B (simulated only)",
                 generator=functools.partial(interleaved_1f1b_rank, overlap=True), bubble_formula="none", bubble=None,
                 **_INTERLEAVED),
)}

_VIRTUAL = re.compile(r"^(?P<base>.+)-v(?P<v>[0-9]+)$")


def interleaved_name(base: str, v: int) -> str:
    """The name of interleaved schedule ``base`` with virtual pipeline size ``v`` (plain: 2)."""
    return base if v == MODELLED_SPECS[base].virtual else f"{base}-v{v}"


def spec(name: str) -> ScheduleSpec:
    """Any schedule, runnable or modelled; ``interleaved-1f1b-v4``: virtual pipeline size 4."""
    if name in SPECS:
        return SPECS[name]
    if name in MODELLED_SPECS:
        return MODELLED_SPECS[name]
    m = _VIRTUAL.match(name)
    if m and m.group("base") in MODELLED_SPECS:
        v = int(m.group("v"))
        if v < 2:
            raise ScheduleError(f"{name}: the virtual pipeline size must be >= 2, got {v}")
        return dataclasses.replace(MODELLED_SPECS[m.group("base")], name=name, virtual=v)
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES + tuple(MODELLED_SPECS))} "
                        f"({', '.join(MODELLED_SPECS)} take -vN for a virtual pipeline of size N)")


#: The schedule that replaces DualPipe where the pipeline size is odd.
V_SCHEDULE = DUALPIPEV

#: Every schedule name, in the order tables list them.
NAMES: Tuple[str, ...] = tuple(SPECS)
#: The default of ``--pipeline-schedule``: Megatron's own.
DEFAULT = ONE_F_ONE_B


def names(runs_on: Optional[str] = None, chunks_per_rank: Optional[int] = None,
          mirrored: Optional[bool] = None) -> Tuple[str, ...]:
    """Schedule names, optionally only those run by ``runs_on``, holding ``chunks_per_rank`` chunks,
    or (``mirrored``) whose stages have a copy per direction or not."""
    return tuple(n for n, s in SPECS.items()
                 if (runs_on is None or s.runs_on == runs_on)
                 and (chunks_per_rank is None or s.chunks_per_rank == chunks_per_rank)
                 and (mirrored is None or s.mirrored == mirrored))


def distinct_orders() -> Tuple[str, ...]:
    """One name per distinct action order (``executor-1f1b`` runs ``1f1b``'s), the modelled
    incumbents included: for comparisons and tables."""
    first: Dict[tuple, str] = {}
    for n, s in {**SPECS, **MODELLED_SPECS}.items():
        first.setdefault((s.generator, s.layout_kind), n)
    return tuple(first.values())


def get(name: str) -> ScheduleSpec:
    """A schedule that runs (Megatron's or the executor's)."""
    if name in SPECS:
        return SPECS[name]
    if name in MODELLED_SPECS or (_VIRTUAL.match(name) and _VIRTUAL.match(name).group("base") in MODELLED_SPECS):
        raise ScheduleError(f"{name} is simulated only (simulate, advise): Megatron runs its interleaved 1F1B as "
                            f"{ONE_F_ONE_B} with --virtual-pipeline-model-parallel-size; choose one of {', '.join(NAMES)}")
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")


@dataclass(frozen=True)
class Schedule:
    """The built order: every pipeline rank's actions for ``microbatches`` micro-batches."""

    name: str
    pp: int
    microbatches: int
    layout: Layout
    ranks: Tuple[RankActions, ...]

    @property
    def spec(self) -> ScheduleSpec:
        return spec(self.name)

    def to_json(self) -> dict:
        return {
            "schedule": self.name,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "ranks": [[a.to_json() for a in acts] for acts in self.ranks],
        }

    def microbatches_per_direction(self) -> Dict[int, int]:
        acts = [a for rank in self.ranks for a in rank]
        return {d: 1 + max(a.mb for a in acts if a.dir == d) for d in sorted({a.dir for a in acts})}


def validate(name: str, pp: int, microbatches: int) -> ScheduleSpec:
    """Raise :class:`ScheduleError` naming what would work; return the spec. Padding is the
    executor's job: this checks the order itself."""
    spec_ = spec(name)
    if not isinstance(pp, int) or pp < 1:
        raise ScheduleError(f"pipeline size must be a positive integer, got {pp!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"number of micro-batches must be a positive integer, got {microbatches!r}")
    problem = spec_.pp_problem(pp) or spec_.microbatch_problem(pp, microbatches)
    if problem:
        raise ScheduleError(problem)
    return spec_


def build_schedule(name: str, pp: int, microbatches: int) -> Schedule:
    spec_ = validate(name, pp, microbatches)
    layout = spec_.layout(pp)
    ranks = tuple(tuple(spec_.generator(layout, microbatches, r)) for r in range(pp))
    return Schedule(name, pp, microbatches, layout, ranks)
