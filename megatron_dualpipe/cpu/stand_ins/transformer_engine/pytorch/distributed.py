"""``transformer_engine.pytorch.distributed``: RNG tracker, activation checkpointing, TP helpers.

TE's ``CudaRNGStatesTracker`` keeps named CUDA generator states; on the CPU the named states are states of
torch's default (CPU) generator, as the CPU mode's tracker for megatron-core's own class does, so that
``fork()`` draws dropout masks and initial weights from the named stream and leaves the default one as it
was. ``checkpoint`` recomputes the forward in backward with the RNG states and the autocast state of the
forward (TE's reentrant checkpoint).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from megatron_dualpipe.cpu.torch_view import generator_state_for

from ._collectives import all_gather_first_dim, all_reduce, reduce_scatter_first_dim, world_size
from .quantization import FP8GlobalStateManager, autocast

_ALL_ACTIVE_RNG_STATES: Dict[str, torch.Tensor] = {}
_RECOMPUTE = {"enabled": False, "phase": False}


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The named states of the last tracker that added one (megatron's ``_get_all_rng_states``)."""
    return _ALL_ACTIVE_RNG_STATES


def set_all_rng_states(states: Dict[str, torch.Tensor]) -> None:
    global _ALL_ACTIVE_RNG_STATES
    _ALL_ACTIVE_RNG_STATES = states


class CudaRNGStatesTracker:
    """Named RNG states (of the CPU generator here); ``fork(name)`` runs a block on one of them."""

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self.states_[name] = generator_state_for(seed)
        set_all_rng_states(self.states_)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        generator = torch.default_generator
        outer = generator.get_state()
        generator.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = generator.get_state()
            generator.set_state(outer)


class activation_recompute_forward(contextlib.ContextDecorator):  # noqa: N801  (TE's name)
    """Marks the forward (``recompute_phase=False``) or the recomputation (True) of a checkpoint."""

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False) -> None:
        self.activation_recompute = activation_recompute
        self.recompute_phase = recompute_phase

    def __enter__(self) -> "activation_recompute_forward":
        _RECOMPUTE["enabled"] = self.activation_recompute and FP8GlobalStateManager.is_fp8_enabled()
        _RECOMPUTE["phase"] = self.recompute_phase
        return self

    def __exit__(self, *exc: Any) -> None:
        _RECOMPUTE["enabled"] = _RECOMPUTE["phase"] = False


def is_fp8_activation_recompute_enabled() -> bool:
    return _RECOMPUTE["enabled"]


def in_fp8_activation_recompute_phase() -> bool:
    return _RECOMPUTE["phase"]


class _RNGSnapshot:
    """The CPU generator and a tracker's named states, taken at forward, put back for recomputation."""

    def __init__(self, get_rng_state_tracker: Optional[Callable]) -> None:
        self.tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
        self.cpu = torch.get_rng_state()
        self.named = self.tracker.get_states() if self.tracker is not None else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        now = _RNGSnapshot.__new__(_RNGSnapshot)
        now.tracker, now.cpu = self.tracker, torch.get_rng_state()
        now.named = self.tracker.get_states() if self.tracker is not None else None
        self._apply()
        try:
            yield
        finally:
            now._apply()

    def _apply(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.tracker is not None:
            self.tracker.set_states(dict(self.named))


class _Checkpoint(torch.autograd.Function):
    """Runs ``function`` without keeping activations; backward recomputes it as the forward ran."""

    @staticmethod
    def forward(ctx, function, get_rng_state_tracker, kwargs, *args):
        ctx.function, ctx.kwargs = function, kwargs
        ctx.rng = _RNGSnapshot(get_rng_state_tracker)
        ctx.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        ctx.recipe = FP8GlobalStateManager.get_fp8_recipe() if ctx.fp8 else None
        tensors = [a if torch.is_tensor(a) else None for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), activation_recompute_forward(True, recompute_phase=False):
            return function(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        args = [_detached(t) if t is not None else o for t, o in zip(ctx.saved_tensors, ctx.others)]
        with ctx.rng.restored(), torch.enable_grad(), autocast(enabled=ctx.fp8, recipe=ctx.recipe), \
                activation_recompute_forward(True, recompute_phase=True):
            outputs = ctx.function(*args, **ctx.kwargs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None) + tuple(a.grad if torch.is_tensor(a) else None for a in args)


def _detached(t: torch.Tensor) -> torch.Tensor:
    out = t.detach()
    out.requires_grad_(t.requires_grad)
    return out


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group: Any = None,
               use_reentrant: bool = True, **kwargs: Any) -> Any:
    """TE's activation checkpoint. ``distribute_saved_activations`` (a memory saving that splits the
    saved input over the TP group) is accepted and not applied: the recomputation is the same."""
    return _Checkpoint.apply(function, get_rng_state_tracker, kwargs, *args)


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """The attributes megatron-core reads to know how a parameter is split over the TP group."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def get_distributed_world_size(group: Any = None) -> int:
    return world_size(group)


def gather_along_first_dim(inp: torch.Tensor, process_group: Any, async_op: bool = False, quantizer: Any = None):
    """All-gather along dim 0 (no autograd), as TE's helper: (output, handle None)."""
    return all_gather_first_dim(inp, process_group), None


def reduce_scatter_along_first_dim(inp: torch.Tensor, tp_group: Any, async_op: bool = False):
    return reduce_scatter_first_dim(inp, tp_group), None


def allreduce(inp: torch.Tensor, tp_group: Any = None, async_op: bool = False):
    return all_reduce(inp, tp_group), None
