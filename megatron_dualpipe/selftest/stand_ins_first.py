"""Imported by the selftest's CPU forkserver first (:data:`.worker.STAND_INS_FIRST`), before it preloads
megatron-core: the CPU mode's stand-ins for the GPU libraries that are not installed go on the import
path, so that the ranks it forks can build Transformer Engine layers (``--te``). megatron-core reads
at import whether those libraries exist; installed later, the stand-ins would not be seen. Only the
CPU forkserver imports this module (never next to a GPU).
"""
from ..cpu import stand_ins

stand_ins.install()
