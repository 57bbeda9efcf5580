"""What Linear and LayerNormLinear share: one weight ``[out, in]`` (and bias), a parallel mode, the GEMM.

``parallel_mode="column"`` splits the output features over the TP group (the input arrives whole, or
split along the sequence and all-gathered); ``"row"`` splits the input features and sums the outputs
(all-reduce, or reduce-scatter along the sequence), the bias added after the sum; ``None`` is no
parallelism. Features TE implements with CUDA-only machinery (Userbuffers overlap, symmetric-memory
all-reduce, split parameters) are refused in one line.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .._collectives import copy_to_region, gather_from_sequence, reduce_from_region, scatter_to_sequence
from ..distributed import set_tensor_model_parallel_attributes
from ..quantization import FP8GlobalStateManager
from ._common import WeightGradStore
from ._gemm import GemmPlan, Gemms, accumulate_flag
from .base import TransformerEngineBaseModule, cpu_device, init_method_constant, init_method_normal, refuse

PARALLEL_MODES = (None, "column", "row")


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


#: The constructor arguments TE's Linear and LayerNormLinear share, as :meth:`LinearFamily._setup_linear` takes them.
_SETUP = ("in_features", "out_features", "bias", "return_bias", "parallel_mode", "tp_group", "tp_size",
          "sequence_parallel", "fuse_wgrad_accumulation", "delay_wgrad_compute", "params_dtype", "device",
          "init_method", "get_rng_state_tracker")
_USERBUFFERS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")


def linear_arguments(given: dict) -> dict:
    """:meth:`LinearFamily._setup_linear`'s keywords out of a TE constructor's own arguments (its
    ``locals()``), with the options the stand-in refuses: Userbuffers, symmetric all-reduce, split parameters."""
    kwargs = {name: given[name] for name in _SETUP}
    kwargs["unsupported"] = {"Userbuffers overlap (ub_*)": any(given[name] for name in _USERBUFFERS),
                             "symmetric_ar_type": given["symmetric_ar_type"],
                             "parameters_split": given["parameters_split"]}
    return kwargs


class LinearFamily(TransformerEngineBaseModule):
    """Base of Linear and LayerNormLinear (see module doc)."""

    def _setup_linear(self, in_features: int, out_features: int, *, bias: bool, return_bias: bool,
                      parallel_mode: Optional[str], tp_group: Any, tp_size: int, sequence_parallel: bool,
                      fuse_wgrad_accumulation: bool, delay_wgrad_compute: bool, params_dtype: Any, device: Any,
                      init_method: Optional[Callable], get_rng_state_tracker: Optional[Callable],
                      unsupported: dict) -> None:
        for what, value in unsupported.items():
            refuse(bool(value), what)
        refuse(parallel_mode not in PARALLEL_MODES, f"parallel_mode={parallel_mode!r}")
        self.fuse_wgrad_accumulation, self.use_bias, self.return_bias = fuse_wgrad_accumulation, bias, return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self._set_tp(tp_group, tp_size)
        self.parallel_mode = parallel_mode
        self.in_features = divide(in_features, self.tp_size) if parallel_mode == "row" else in_features
        self.out_features = divide(out_features, self.tp_size) if parallel_mode == "column" else out_features
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias
        kw = {"device": cpu_device(device), "dtype": params_dtype or torch.get_default_dtype()}
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(self.out_features, self.in_features, **kw)),
                                init_fn=init_method or init_method_normal(),
                                get_rng_state_tracker=get_rng_state_tracker, fp8_meta_index=0)
        if bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(self.out_features, **kw)),
                                    init_fn=init_method_constant(0.0))
        else:
            self.bias = torch.Tensor().to(**kw)

    def _mark_linear_parameters(self) -> None:
        """The TP attributes megatron-core reads, and DDP's cue to hook the module when deferring."""
        set_tensor_model_parallel_attributes(self.weight, True, 1 if self.parallel_mode == "row" else 0, 1)
        if self.use_bias:
            if self.parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        if self.wgrad_store.delay_wgrad_compute():
            for name, param in self.named_parameters(recurse=False):
                if name in self.weight_names or name in self.bias_names:
                    param.skip_backward_post_hook = True

    def _plan(self, is_first_microbatch: Optional[bool]) -> GemmPlan:
        return GemmPlan(
            splits=None, bias_in_gemm=self.apply_bias and not self.gemm_bias_unfused_add,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            accumulate=accumulate_flag(self.fuse_wgrad_accumulation, is_first_microbatch, self.weight),
            store=self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None,
            bias_grad_in_b=FP8GlobalStateManager.is_fp8_enabled())

    def _linear(self, x: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        """The parallel GEMM of ``x`` (the layer's input, after its norm if any)."""
        group = self.tp_group
        refuse(self.tp_size > 1 and group is None, "tp_size > 1 without a tensor-parallel group")
        if self.parallel_mode == "column":
            x = gather_from_sequence(x, group) if self.sequence_parallel else copy_to_region(x, group)
        plan = self._plan(is_first_microbatch)
        params = [self.weight] + ([self.bias] if plan.bias_in_gemm else [])
        out = Gemms.apply(x.reshape(-1, x.shape[-1]), plan, 1, *params).view(*x.shape[:-1], self.out_features)
        if self.parallel_mode == "row":
            out = scatter_to_sequence(out, group) if self.sequence_parallel else reduce_from_region(out, group)
        if self.gemm_bias_unfused_add:
            out = out + self.bias.to(out.dtype)
        return out

    def _returned_bias(self) -> Optional[torch.Tensor]:
        return self.bias.to(self.activation_dtype) if self.use_bias else None
