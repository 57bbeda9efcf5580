"""Checkpoints under the executor's schedules: the same logical model, in 1F1B's layout.

DualPipe holds every stage twice: ``model[0]`` is stage ``i`` on rank ``i`` (exactly the chunk
1F1B has there) and ``model[1]`` the mirrored copy of stage ``pp-1-i``, kept equal to its home
copy; a checkpoint needs only ``model[0]``, and the mirror is reconstructed at load. DualPipeV has
no mirrors: its two chunks are V-stages ``i`` and ``2pp-1-i``, and 1F1B's stage ``i`` is V-stages
``2i`` and ``2i+1``.

One module per job:

* :mod:`.strategies` -- the (schedule, format) -> save / load table (its docstring has the table);
* :mod:`.hooks` -- the wrapped ``save_checkpoint`` / ``load_checkpoint`` that look it up;
* :mod:`.files` -- what a load is about to read (format, keys, the schedule that wrote it);
* :mod:`.optimizers` -- which optimizer, which of its parameters and buffers are ``model[0]``'s, and
  the offsets its fully reshardable state is written at (``exact_offsets``);
* :mod:`.one_chunk_optimizer` -- ``torch`` format: the optimizer state as 1F1B's one chunk;
* :mod:`.torch_dist_mirror` -- ``torch_dist``: the mirror never written;
* :mod:`.dualpipev_layers` -- DualPipeV's V-stages <-> 1F1B's stages;
* :mod:`.mirrors` -- after a load, every mirror made equal to its home copy;
* :mod:`.megatron_io` -- the two places of Megatron's checkpointing a strategy edits, scoped.

Supported optimizers (``torch`` format): ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer`` (and a ``ChainedOptimizer`` of them). Optimizer state does not cross
between the DualPipeV and 1F1B layouts: such a load needs ``--no-load-optim``.
"""
