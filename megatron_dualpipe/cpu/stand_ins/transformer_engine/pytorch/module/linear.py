"""``transformer_engine.pytorch.Linear``: ``y = x W^T + b``, tensor-parallel, with deferrable weight gradients."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ._linear_family import LinearFamily, linear_arguments


class Linear(LinearFamily):
    """TE's Linear (megatron-core's TELinear, TEColumnParallelLinear, TERowParallelLinear)."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split: Any = None, device: Any = "cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__(name=name)
        self.rng_tracker_name, self.ub_name, self.symmetric_ar_type = rng_tracker_name, ub_name, symmetric_ar_type
        self._setup_linear(**linear_arguments(locals()))
        self.save_original_input = save_original_input
        self.reset_parameters(defer_init=self.weight.device.type == "meta")

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self._mark_linear_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        self._enter_forward(inp)
        out = self._linear(inp, is_first_microbatch)
        return (out, self._returned_bias()) if self.return_bias else out
