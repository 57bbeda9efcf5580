"""Checkpoints under the executor's schedules: the same logical model, in 1F1B's layout.

DualPipe holds every stage twice: ``model[0]`` is stage ``i`` on rank ``i`` (exactly the chunk
1F1B has there) and ``model[1]`` the mirrored copy of stage ``pp-1-i``, kept equal to its home
copy; a checkpoint needs only ``model[0]``, and the mirror is reconstructed at load. DualPipeV has
no mirrors: its two chunks are V-stages ``i`` and ``2pp-1-i``, and 1F1B's stage ``i`` is V-stages
``2i`` and ``2i+1``.

:mod:`.strategies` has the (schedule, format) -> save / load table; :mod:`.hooks` wraps Megatron's
``save_checkpoint`` / ``load_checkpoint`` to look it up. Supported optimizers (``torch`` format):
``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer`` (and a
``ChainedOptimizer`` of them). Optimizer state does not cross between the DualPipeV and 1F1B
layouts: such a load needs ``--no-load-optim``.
"""
