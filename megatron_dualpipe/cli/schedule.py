"""``megatron-dualpipe schedule``: build a schedule and print each rank's actions (or JSON)."""
from __future__ import annotations

import argparse
import json

from ..apps.progress import Progress
from ..schedule import format_grid
from .args import Command
from .build import add_schedule_args, build, padding_note, per_direction


def configure(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    p.add_argument("--json", action="store_true", help="print the per-rank action lists as JSON")


def run(args) -> int:
    with Progress(f"schedule {args.schedule} pp={args.pp} M={args.microbatches}") as prog:
        padded = build(args, prog)
        s = padded.schedule
        if args.json:
            print(json.dumps(dict(s.to_json(), **({"real_microbatches": padded.real} if padded.fake_count else {}))))
            return 0
        prog.phase("formatting")
        text = format_grid(s.ranks)
    layout = s.layout
    print(f"{s.name}: pp={s.pp} M={s.microbatches} ({layout.kind} layout; {per_direction(s)})")
    if note := padding_note(padded):
        print(note)
    two = len(layout.directions) > 1
    print("F forward, B input-grad backward, BW full backward, W deferred weight grad; "
          f"F0.3 = {layout.dir_word + ' 0, ' if two else ''}micro-batch 3; '+' = F fused with the backward after it"
          + (f"; {layout.dir_word}s: " + ", ".join(layout.dir_label(d) for d in layout.directions) if two else ""))
    print(text)
    return 0


COMMAND = Command("schedule", "print the per-rank action lists of a schedule", configure, run)
