"""Megatron-core glue for DualPipe / DualPipeV: bd groups and reversed pipeline groups
(`groups`), the two-chunk model (`model`), and the gradient finalize (`grads`)."""
