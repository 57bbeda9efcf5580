"""``megatron-dualpipe trace DIR``: the arguments; the work is :func:`megatron_dualpipe.pictures.timeline.run`."""
from __future__ import annotations

import argparse

from ..pictures.timeline import HELP, run
from .args import Command, png_path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="the MEGATRON_DUALPIPE_TRACE directory")
    p.add_argument("--png", metavar="FILE.png", type=png_path,
                   help="measured and simulated timelines, one above the other")
    p.add_argument("--json", metavar="FILE", help="Chrome / Perfetto trace of both")
    p.add_argument("--iteration", type=int, default=None,
                   help="which recorded run_rank call (default: the last one every rank recorded)")
    p.add_argument("--global-rank", type=int, default=None, help="the pipeline holding this global rank "
                   "(default: the lowest)")


COMMAND = Command("trace", HELP, configure, run)
