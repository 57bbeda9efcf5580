"""Imported first by the selftest's CPU forkserver: megatron-core reads at import whether the GPU
libraries exist, so the CPU mode's stand-ins (``--te``) must be installed before it is preloaded.
"""
from ..cpu import stand_ins

stand_ins.install()
