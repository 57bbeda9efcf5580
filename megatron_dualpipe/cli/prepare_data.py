"""``megatron-dualpipe prepare-data``: the arguments; the work is :mod:`megatron_dualpipe.apps.data_prep`."""
from __future__ import annotations

import argparse
import shlex

from ..apps.data_prep import add_data_arguments, prepare_from_args
from ..apps.progress import Progress
from .args import Command

HELP = "text -> tokenizer -> Megatron's indexed dataset (.bin/.idx), cached; prints pretrain_gpt.py's data arguments"


def run(args: argparse.Namespace) -> int:
    with Progress("prepare-data") as progress:
        data, _ = prepare_from_args(args, progress)
        progress.say("arguments for Megatron-LM's pretrain_gpt.py (stdout):")
    print(shlex.join(data.megatron_args(args.split)), flush=True)
    return 0


COMMAND = Command("prepare-data", HELP, add_data_arguments, run)
