"""Imported first by the selftest's CPU forkserver (:data:`.worker.STAND_INS_FIRST`): megatron-core
reads at import whether the GPU libraries exist, so the CPU mode's stand-ins (``--te``) must be on
the import path before it is preloaded.
"""
from ..cpu import stand_ins

stand_ins.install()
