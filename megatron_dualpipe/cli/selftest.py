"""``megatron-dualpipe selftest``: the command of :mod:`megatron_dualpipe.selftest` (argparse only until it runs)."""
from __future__ import annotations

from .. import selftest
from .args import Command

COMMAND = Command("selftest", selftest.HELP, selftest.configure, selftest.run)
