"""``transformer_engine.pytorch.GroupedLinear``: one GEMM per expert over consecutive row splits.

megatron-core's ``TEGroupedMLP`` passes the expert-sorted tokens and ``m_splits`` (tokens per local
expert, zeros allowed); GEMM ``i`` multiplies rows ``sum(m_splits[:i]) : sum(m_splits[:i+1])`` by
``weight{i}``. TE leaves the tensor-parallel communication of experts to megatron's token dispatcher, so
this module communicates nothing. Deferred weight gradients (``delay_wgrad_compute``) queue one entry per
backward holding every expert's work; ``backward_dw()`` computes them all.

One deliberate difference: without ``fuse_wgrad_accumulation`` TE's deferring backward hands autograd the
weight-gradient buffers it has only allocated (their contents are computed later, in ``backward_dw``, which
assigns ``.grad`` anyway); the stand-in hands autograd None, so a missed W shows as a missing gradient.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from ..distributed import set_tensor_model_parallel_attributes
from ..quantization import FP8GlobalStateManager
from ._common import WeightGradStore
from ._gemm import GemmPlan, Gemms, accumulate_flag
from ._linear_family import PARALLEL_MODES, divide
from .base import TransformerEngineBaseModule, claims_at_least, cpu_device, init_method_constant, refuse


class GroupedLinear(TransformerEngineBaseModule):
    """TE's GroupedLinear (megatron-core's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device: Any = "cuda", ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 save_original_input: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name=name)
        refuse(ub_overlap_rs or ub_overlap_ag, "Userbuffers overlap (ub_*) in GroupedLinear")
        refuse(single_grouped_weight or single_grouped_bias,
               "single_grouped_weight / single_grouped_bias (moe_single_grouped_weight / _bias)")
        refuse(parallel_mode not in PARALLEL_MODES, f"parallel_mode={parallel_mode!r}")
        self.num_gemms, self.fuse_wgrad_accumulation = num_gemms, fuse_wgrad_accumulation
        self.use_bias, self.return_bias, self.apply_bias = bias, return_bias, bias and not return_bias
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.ub_name, self.save_original_input = ub_name, save_original_input
        self.single_grouped_weight = self.single_grouped_bias = False
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self._set_tp(tp_group, tp_size)
        if self.tp_size > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. "
                             "Because the TP communication is handled outside of this module.")
        self.parallel_mode = parallel_mode
        self.in_features = divide(in_features, self.tp_size) if parallel_mode == "row" else in_features
        self.out_features = divide(out_features, self.tp_size) if parallel_mode == "column" else out_features
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.weight_names = [f"weight{i}" for i in range(num_gemms)]
        self.bias_names = [f"bias{i}" for i in range(num_gemms)]
        self._register_expert_parameters(init_method, params_dtype, device)
        self.reset_parameters(defer_init=cpu_device(device).type == "meta")

    def _register_expert_parameters(self, init_method, params_dtype, device) -> None:
        kw = {"device": cpu_device(device), "dtype": params_dtype or torch.get_default_dtype()}
        for i in range(self.num_gemms):
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(torch.empty(self.out_features, self.in_features, **kw)),
                init_fn=init_method, get_rng_state_tracker=self.get_rng_state_tracker, fp8_meta_index=1 + 3 * i)
            if self.use_bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(self.out_features, **kw)),
                                        init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(**kw))

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        for weight, bias in zip(self._get_weight_tensors(), self._get_bias_tensors()):
            set_tensor_model_parallel_attributes(weight, True, 1 if self.parallel_mode == "row" else 0, 1)
            if self.use_bias and self.parallel_mode == "row":
                bias.sequence_parallel = self.sequence_parallel
            elif self.use_bias and self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(bias, True, 0, 1)
            if self.wgrad_store.delay_wgrad_compute():
                for param in (weight, bias) if self.use_bias else (weight,):
                    param.skip_backward_post_hook = True

    def forward(self, inp: torch.Tensor, m_splits: List[int], is_first_microbatch: Optional[bool] = None):
        if len(m_splits) != self.num_gemms:
            raise AssertionError("Number of splits should match number of GEMMs.")
        dtype = self._enter_forward(inp)
        weights, biases = self._get_weight_tensors(), self._get_bias_tensors()
        plan = GemmPlan(
            splits=[int(m) for m in m_splits], bias_in_gemm=self.apply_bias,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            accumulate=accumulate_flag(self.fuse_wgrad_accumulation, is_first_microbatch, weights[0]),
            store=self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None,
            bias_grad_in_b=FP8GlobalStateManager.is_fp8_enabled())
        params = weights + (biases if plan.bias_in_gemm else [])
        out = Gemms.apply(inp.reshape(-1, inp.shape[-1]), plan, self.num_gemms, *params)
        out = out.view(-1, *inp.shape[1:-1], out.shape[-1])
        if self.return_bias:
            return out, [b.to(dtype) for b in biases]
        return out

    def _skips_empty_backward_dw(self) -> bool:
        return claims_at_least(2, 14)

    def _assign_deferred_bias_grad(self, bias: torch.nn.Parameter, bgrad: Optional[torch.Tensor]) -> None:
        if bgrad is None and claims_at_least(2, 14):
            return  # TE >= 2.14 skips a bias whose deferred gradient is absent
        super()._assign_deferred_bias_grad(bias, bgrad)
