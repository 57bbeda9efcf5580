"""Checkpoints under the executor's schedules: the same logical model, in 1F1B's layout (DualPipe's
mirror, ``model[1]``, is never written but reconstructed at load; DualPipeV's V-stages ``2i`` and
``2i+1`` are 1F1B's stage ``i``). :mod:`.strategies` has the (schedule, format) table, :mod:`.hooks` looks it up.
"""
