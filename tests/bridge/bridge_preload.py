"""Imported once by the Bridge tests' forkserver (``bridge_compare.run_ranks``): the CPU mode for Bridge
switched on (its stand-ins before megatron-core) and Bridge imported there, so that the ranks forked
from it start with both instead of importing Bridge each (4 ranks x ~10 s of CPU per test on 2 cores)."""
from megatron_dualpipe.bridge import cpu

cpu.enable()
