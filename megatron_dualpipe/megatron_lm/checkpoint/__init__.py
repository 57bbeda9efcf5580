"""Checkpoints under the executor's schedules: the same logical model, in 1F1B's layout.

DualPipe's ``model[0]`` on rank ``i`` is exactly 1F1B's stage ``i`` and ``model[1]`` a mirror of stage
``pp-1-i``: a checkpoint needs only ``model[0]``, the mirror is reconstructed at load. DualPipeV's
chunks are V-stages ``i`` and ``2pp-1-i``; 1F1B's stage ``i`` is V-stages ``2i`` and ``2i+1``.
:mod:`.strategies` has the (schedule, format) -> save / load table, :mod:`.hooks` looks it up.
"""
