"""Megatron's ``--pipeline-model-parallel-layout`` read without megatron-core, and the layouts a
schedule can run.

A layout lists the stages along the route, ``|`` between them: ``E`` embedding, ``t`` transformer
layer, ``m`` multi-token-prediction layer, ``L`` loss, with Megatron's shorthands ``t*4`` and
``(tt|)*14``. The schedules here take a fixed number of stages (1F1B and DualPipe ``pp``, DualPipeV
``2*pp``) and place them their own way (``Layout.stages_on``); a layout of another count is refused
with one of the right count (:func:`fix`). Standard library only.
"""
from __future__ import annotations

import re
from typing import List, Sequence, Tuple

__all__ = ["LayoutError", "parse", "to_text", "decoder_counts", "from_sizes", "even", "halved", "paired", "fix"]

KINDS = "ELtm"


class LayoutError(ValueError):
    """A layout string that cannot be read; the message names the flag."""


def parse(text: str) -> List[str]:
    """The stages of a layout string, each as its letters (``"Et|(tt|)*2,tL"`` ->
    ``["Et", "tt", "tt", "tL"]``): Megatron's unrolling of ``(...)*n`` then ``x*n``, commas ignored."""
    flat = text.replace(",", "").replace(" ", "")
    flat = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    bad = sorted(set(flat) - set(KINDS) - {"|"})
    if bad:
        raise LayoutError(f"--pipeline-model-parallel-layout {text!r}: unknown letters {''.join(bad)!r} "
                          f"(E embedding, t layer, m MTP layer, L loss, | between stages)")
    return flat.split("|")


def to_text(stages: Sequence[str]) -> str:
    """A layout string for ``stages`` in Megatron's syntax, runs of equal middle stages and of
    layers shortened (``["Et", "tt", "tt", "tt", "tL"]`` -> ``"Et|(tt|)*3,tL"``)."""
    def short(stage: str) -> str:
        return re.sub(r"t{3,}", lambda m: f"t*{len(m.group(0))}", stage)

    out, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) - 1 and stages[j + 1] == stages[i] and i > 0:
            j += 1
        n = j - i + 1
        if n >= 3:  # a run never holds the last stage: a stage follows its trailing "|"
            out.append(f"({short(stages[i])}|)*{n},")
        else:
            out += [short(s) + ("|" if k < len(stages) - 1 else "") for k, s in enumerate(stages[i:j + 1], i)]
        i = j + 1
    return "".join(out)


def decoder_counts(stages: Sequence[str]) -> Tuple[int, ...]:
    """Transformer layers per stage."""
    return tuple(s.count("t") for s in stages)


def from_sizes(sizes: Sequence[int]) -> List[str]:
    """Stages of these many layers, the embedding first and the loss last."""
    return ["E" * (i == 0) + "t" * n + "L" * (i == len(sizes) - 1) for i, n in enumerate(sizes)]


def even(num_layers: int, count: int) -> List[str]:
    """``num_layers`` over ``count`` stages as evenly as they go, the embedding first and the loss
    last; the layers left over go to the middle stages first (the two ends also hold the embedding
    and the output layer)."""
    base, extra = divmod(num_layers, count)
    order = list(range(1, count - 1)) + [count - 1, 0]
    return from_sizes([base + (i in order[:extra]) for i in range(count)])


def halved(stages: Sequence[str]) -> List[str]:
    """Each stage cut in two (the first half of its layers, with what precedes them; then the rest):
    from ``pp`` stages the ``2*pp`` V-stages whose pairs ``2t``, ``2t+1`` are the stages given."""
    out = []
    for s in stages:
        layers = [i for i, c in enumerate(s) if c == "t"]
        first = len(layers) // 2 or (len(layers) if s[:1] == "t" else 0)  # "tL" -> "t", "L", not "", "tL"
        cut = layers[first] if first < len(layers) else (layers[-1] + 1 if layers else len(s))
        out += [s[:cut], s[cut:]]
    return out


def paired(stages: Sequence[str]) -> List[str]:
    """Stages ``2t`` and ``2t+1`` joined: from ``2*pp`` V-stages the ``pp`` stages 1F1B runs the
    same layers in (1F1B's rank ``t`` holds DualPipeV's V-stages ``2t`` and ``2t+1``)."""
    return [stages[i] + stages[i + 1] for i in range(0, len(stages) - 1, 2)]


def fix(text: str, want: int, pp: int, schedule: str) -> str:
    """A layout of ``want`` stages for a layout ``text`` of another count: the given stages halved
    (``pp`` given, ``2*pp`` wanted) or paired (the reverse), else the layers spread evenly."""
    stages = parse(text)
    if len(stages) == pp and want == 2 * pp:
        new = halved(stages)
    elif len(stages) == 2 * want:
        new = paired(stages)
    else:
        new = even(sum(decoder_counts(stages)), want)
    return (f"--pipeline-model-parallel-layout has {len(stages)} stages; --pipeline-schedule {schedule} runs "
            f"{want} ({'2 * ' if want == 2 * pp else ''}--pipeline-model-parallel-size {pp}): use e.g. "
            f"'{to_text(new)}'")
