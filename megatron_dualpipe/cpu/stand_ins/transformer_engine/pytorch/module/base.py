"""``transformer_engine.pytorch.module.base``: what every TE layer shares.

Parameter registration with deferred initialisation under the RNG tracker, the tensor-parallel group, the
(empty) FP8 extra state of checkpoints, and the weight-gradient protocol megatron-core drives:
``backward_dw()`` pops the module's oldest deferred work, sets ``param.grad`` (without
``fuse_wgrad_accumulation``; TE *assigns* it, it does not accumulate) or leaves the gradient where the
work accumulated it (``main_grad``), then runs the hooks megatron's DDP registered with
``register_wgrad_accumulation_and_reduce_hooks`` (TE marks deferring parameters
``skip_backward_post_hook`` so that DDP hooks the module instead of the parameter).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from ..._version import version_tuple
from ..distributed import get_distributed_world_size
from ..quantization import FP8GlobalStateManager
from ._common import WeightGradStore

_dummy_wgrads: Dict[tuple, torch.Tensor] = {}


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """One reusable gradient per (shape, dtype) that megatron's DDP hook discards: the weight's real
    gradient went into ``main_grad`` and ``grad_added_to_main_grad`` says so."""
    key = (*shape, dtype)
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.empty(shape, dtype=dtype, device="cpu", requires_grad=False)
    if zero:
        _dummy_wgrads[key].fill_(0)
    return _dummy_wgrads[key].detach()


def init_method_normal(std: float = 0.023) -> Callable[[torch.Tensor], None]:
    return lambda w: torch.nn.init.normal_(w, mean=0.0, std=std)


def init_method_constant(value: float) -> Callable[[torch.Tensor], None]:
    return lambda w: torch.nn.init.constant_(w, value)


def cpu_device(device: Any) -> torch.device:
    """Where the stand-in allocates: 'meta' stays (deferred init), any other device is the CPU."""
    return torch.device("meta") if torch.device(device if device is not None else "cpu").type == "meta" \
        else torch.device("cpu")


def refuse(condition: bool, what: str) -> None:
    """One line naming a TE feature the CPU stand-in does not have."""
    if condition:
        raise NotImplementedError(f"Transformer Engine stand-in (CPU mode): {what} is not supported")


class _ParameterInitMeta(NamedTuple):
    init_fn: Callable[[torch.Tensor], Any]
    get_rng_state_tracker: Optional[Callable]
    fp8_meta_index: Optional[int]


class TransformerEngineBaseModule(torch.nn.Module):
    """Base of Linear, LayerNormLinear, GroupedLinear and DotProductAttention."""

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self.param_init_meta: Dict[str, _ParameterInitMeta] = {}
        self.fp8 = self.fp8_calibration = self.fp8_parameters = self.primary_weights_in_fp8 = False
        self.fp8_meta: Dict[str, Any] = {"fp8_checkpoint": False, "recipe": None, "num_gemms": 1}
        self.autocast_recipe = None  # stand-in: the recipe of the last forward (None outside autocast)
        self.tp_group, self.tp_size, self.sequence_parallel = None, 1, False
        self.wgrad_store: Optional[WeightGradStore] = None
        self.wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []
        self.activation_dtype: Optional[torch.dtype] = None
        self.save_original_input = False

    # -- parameters -------------------------------------------------------------------------------
    def register_parameter(self, name: str, param: Optional[torch.nn.Parameter], init_fn=None,
                           get_rng_state_tracker=None, fp8_meta_index=None) -> None:
        super().register_parameter(name, param)
        if name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(
                init_fn or init_method_normal(), get_rng_state_tracker, fp8_meta_index)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        """Initialise every parameter with its init_fn, under the tracker's fork when one was given."""
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            if param.device.type == "meta":
                param = torch.nn.Parameter(torch.empty_like(param, device="cpu"))
                setattr(self, name, param)
            meta = self.param_init_meta[name]
            with torch.no_grad():
                if meta.get_rng_state_tracker is None:
                    meta.init_fn(param)
                else:
                    name_ = getattr(self, "rng_tracker_name", None)
                    tracker = meta.get_rng_state_tracker()
                    with tracker.fork(name_) if name_ else tracker.fork():
                        meta.init_fn(param)

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def _set_tp(self, tp_group: Any, tp_size: int) -> None:
        """TE's rule: a given group decides the size; without one, ``tp_size`` (a group set later)."""
        if tp_group is None:
            self.tp_size = tp_size
            if tp_size == 1:
                self.set_tensor_parallel_group(None)
        else:
            self.tp_size = get_distributed_world_size(tp_group)
            self.set_tensor_parallel_group(tp_group)

    def fast_setattr(self, name: str, value: Any) -> None:
        setattr(self, name, value)

    # -- forward bookkeeping ------------------------------------------------------------------------
    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8_meta["num_gemms"] = num_gemms

    def _enter_forward(self, inp: torch.Tensor) -> torch.dtype:
        """Record the autocast recipe this forward runs under; the compute dtype is the input's."""
        enabled = FP8GlobalStateManager.is_fp8_enabled()
        self.autocast_recipe = FP8GlobalStateManager.get_fp8_recipe() if enabled else None
        self.activation_dtype = inp.dtype
        return inp.dtype

    def get_extra_state(self) -> torch.Tensor:
        """No FP8 metadata on the CPU: TE's encoding of 'none' (an empty byte tensor)."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """A real TE checkpoint's FP8 scales have no use here (the autocast is a no-op): ignored."""

    # -- deferred weight gradients ------------------------------------------------------------------
    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def _get_weight_tensors(self) -> List[torch.nn.Parameter]:
        return [getattr(self, name) for name in self.weight_names]

    def _get_bias_tensors(self) -> List[torch.nn.Parameter]:
        return [getattr(self, name) for name in self.bias_names]

    def backward_dw(self) -> None:
        """Compute the oldest deferred weight gradients of this module (no-op without deferral)."""
        if not self.need_backward_dw():
            return
        if self._skips_empty_backward_dw() and self.wgrad_store.empty():
            return
        grads, _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            for weight, wgrad in zip(self._get_weight_tensors(), grads.wgrads):
                weight.grad = wgrad.to(weight.dtype)
        if self.use_bias:
            for bias, bgrad in zip(self._get_bias_tensors(), grads.bgrads):
                if bias.grad is None:
                    self._assign_deferred_bias_grad(bias, bgrad)
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    def _skips_empty_backward_dw(self) -> bool:
        """GroupedLinear returns on an empty queue from TE 2.14 on; every other case raises."""
        return False

    def _assign_deferred_bias_grad(self, bias: torch.nn.Parameter, bgrad: Optional[torch.Tensor]) -> None:
        if bgrad is None:
            raise AttributeError(
                f"{type(self).__name__}.backward_dw: the bias has no gradient and the deferred GEMM computed "
                "none (the bias is returned to the caller, return_bias=True, or added in B under the autocast); "
                "Transformer Engine fails here too ('NoneType' object has no attribute 'to'): with "
                "delay_wgrad_compute its backward_dw sets bias.grad from the deferred GEMM only when bias.grad "
                "is None, e.g. after megatron DDP's hook of an earlier backward_dw consumed it")
        bias.grad = bgrad.to(bias.dtype)


def claims_at_least(major: int, minor: int) -> bool:
    """True when the claimed TE release is ``major.minor`` or newer."""
    return version_tuple() >= (major, minor)
