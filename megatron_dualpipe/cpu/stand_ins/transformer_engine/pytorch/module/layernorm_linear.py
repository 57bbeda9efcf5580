"""``transformer_engine.pytorch.LayerNormLinear``: a norm and a column-parallel (or plain) Linear in one."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .._collectives import gather_from_sequence
from ._linear_family import LinearFamily, linear_arguments
from ._norm import NORMALIZATIONS, normalize
from .base import cpu_device, init_method_constant, refuse


class LayerNormLinear(LinearFamily):
    """TE's LayerNormLinear (megatron-core's TELayerNormColumnParallelLinear: ``linear_qkv``, ``linear_fc1``).

    Parameters ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), ``weight``, ``bias``; the
    norm's are marked ``sequence_parallel`` (their gradients are summed over TP by megatron)."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group: Any = None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split: Any = None, zero_centered_gamma: bool = False, device: Any = "cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 name: Optional[str] = None) -> None:
        super().__init__(name=name)
        refuse(normalization not in NORMALIZATIONS, f"normalization={normalization!r}")
        refuse(parallel_mode == "row", "LayerNormLinear with parallel_mode='row'")
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered and return_layernorm_output
        self.ub_name, self.symmetric_ar_type = ub_name, symmetric_ar_type
        self._setup_norm(in_features, params_dtype, device)
        self._setup_linear(**linear_arguments(locals()))
        self.reset_parameters(defer_init=self.weight.device.type == "meta")

    def _setup_norm(self, in_features: int, params_dtype: Optional[torch.dtype], device: Any) -> None:
        kw = {"device": cpu_device(device), "dtype": params_dtype or torch.get_default_dtype()}
        gamma = init_method_constant(0.0 if self.zero_centered_gamma else 1.0)
        self.register_parameter("layer_norm_weight", torch.nn.Parameter(torch.empty(in_features, **kw)),
                                init_fn=gamma)
        if self.normalization == "LayerNorm":
            self.register_parameter("layer_norm_bias", torch.nn.Parameter(torch.empty(in_features, **kw)),
                                    init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self.layer_norm_weight.sequence_parallel = self.sequence_parallel
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.sequence_parallel = self.sequence_parallel
            self._mark_linear_parameters()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        self._enter_forward(inp)
        ln_out = normalize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                           self.zero_centered_gamma)
        out = self._linear(ln_out, is_first_microbatch)
        if self.return_layernorm_output_gathered and self.sequence_parallel:
            ln_out = gather_from_sequence(ln_out, self.tp_group)
        extra = (self._returned_bias(),) if self.return_bias else ()
        extra += (ln_out,) if self.return_layernorm_output else ()
        return (out, *extra) if extra else out
