"""One stage's verdict and the report built from all of them (``selftest.md``, ``selftest.json``).
A *hard* FAIL (what follows cannot be trusted) stops the selftest; speed and memory FAILs are soft.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Dict, List

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class StageResult:
    stage: str
    status: str
    summary: str
    details: List[str] = dataclasses.field(default_factory=list)
    numbers: Dict[str, Any] = dataclasses.field(default_factory=dict)
    hard: bool = True  # a FAIL here stops the selftest
    seconds: float = 0.0
    #: one result line per part the stage judges apart (printed under the stage's line, first in its report)
    lines: List[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return f"[{self.status}] {self.stage}: {self.summary} ({self.seconds:.1f} s)"


def failed_on(stage: str, errors: Dict[int, str]) -> StageResult:
    """A stage whose code raised on some ranks: the first line of each rank's error."""
    ranks = sorted(errors)
    return StageResult(stage, FAIL, f"raised on rank{'s' if len(ranks) > 1 else ''} "
                                    f"{', '.join(map(str, ranks))}: {errors[ranks[0]].splitlines()[0]}",
                       details=[f"rank {r}: {errors[r]}" for r in ranks])


def markdown(command: str, results: List[StageResult], wall_s: float, files: List[str]) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    verdict = "FAIL" if any(r.status == FAIL for r in results) else "PASS"
    out = [f"# megatron-dualpipe selftest: {verdict}", "",
           f"`{command}`, {when}, {wall_s:.0f} s in all.", "",
           "| stage | result | numbers | time |", "|---|---|---|---|"]
    for r in results:
        out.append(f"| {r.stage} | {r.status} | {r.summary.replace('|', '/')} | {r.seconds:.1f} s |")
    for r in results:
        if r.details or r.lines:
            out += ["", f"## {r.stage}", "", "```", *r.lines, *r.details, "```"]
    if files:
        out += ["", "Files: " + ", ".join(f"`{f}`" for f in files)]
    return "\n".join(out) + "\n"


def write(out_dir: str, command: str, results: List[StageResult], wall_s: float, files: List[str]) -> None:
    """``selftest.md`` and ``selftest.json`` in ``out_dir`` (rewritten after every stage)."""
    with open(os.path.join(out_dir, "selftest.md"), "w", encoding="utf-8") as fh:
        fh.write(markdown(command, results, wall_s, files))
    payload = {"command": command, "wall_s": wall_s, "failed": any(r.status == FAIL for r in results),
               "stages": [dataclasses.asdict(r) for r in results], "files": files}
    with open(os.path.join(out_dir, "selftest.json"), "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1, default=str)
