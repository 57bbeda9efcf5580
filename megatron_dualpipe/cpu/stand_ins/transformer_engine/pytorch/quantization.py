"""``transformer_engine.pytorch.quantization``: the low-precision autocast and its global state.

On the CPU the autocast is a no-op for the numerics: inside ``autocast(enabled=True, recipe=...)`` the
layers compute in their input's dtype exactly as outside it. What it keeps is TE's state, which
megatron-core reads: whether quantization is on (``FP8GlobalStateManager.is_fp8_enabled()``), with which
recipe and amax-reduction group, nesting (the innermost context wins, the outer one comes back on exit),
and which recipe each layer ran under (``module.autocast_recipe``, a stand-in attribute the tests read).
So every recipe can be entered, FP8 configs build and run, and a schedule is compared with megatron's
1F1B under the same autocast; FP8 rounding itself is not emulated (delayed scaling's amax history would
make the numbers depend on the order of the micro-batches, which is what the comparison must not see).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

from ..common.recipe import Recipe, default_recipe


class FP8GlobalStateManager:
    """Class-level autocast state, as TE keeps it (megatron calls these as class methods)."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Optional[Recipe] = None
    FP8_DISTRIBUTED_GROUP: Any = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    AUTOCAST_DEPTH = 0
    SKIP_FP8_WEIGHT_UPDATE_TENSOR = None

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else default_recipe()

    @classmethod
    def get_fp8_group(cls) -> Any:
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True once per outermost autocast (TE reduces the backward amaxes there)."""
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return False

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Any:
        return cls.SKIP_FP8_WEIGHT_UPDATE_TENSOR

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: Any) -> None:
        cls.SKIP_FP8_WEIGHT_UPDATE_TENSOR = skip

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """No amax history on the CPU: nothing to reduce."""

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: Any) -> None:
        """No amax history on the CPU: nothing to register."""

    @classmethod
    def get_autocast_state(cls) -> Tuple[Any, ...]:
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE)

    @classmethod
    def set_autocast_state(cls, state: Tuple[Any, ...]) -> None:
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE) = state


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group: Any = None, _graph: bool = False) -> Iterator[None]:
    """Quantized execution of the TE layers inside (numerics unchanged on the CPU, see module doc)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast: recipe must be a transformer_engine.common.recipe.Recipe, got {recipe!r}")
    state = FP8GlobalStateManager.get_autocast_state()
    gsm = FP8GlobalStateManager
    gsm.FP8_ENABLED, gsm.FP8_CALIBRATION = bool(enabled), bool(calibrating)
    gsm.FP8_RECIPE = recipe if recipe is not None else default_recipe()
    gsm.FP8_DISTRIBUTED_GROUP = amax_reduction_group
    if gsm.AUTOCAST_DEPTH == 0:
        gsm.IS_FIRST_FP8_MODULE = bool(enabled)
    gsm.AUTOCAST_DEPTH += 1
    try:
        yield
    finally:
        gsm.AUTOCAST_DEPTH -= 1
        gsm.set_autocast_state(state)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group: Any = None, _graph: bool = False):
    """TE's older name of :func:`autocast` (still what megatron-core calls)."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe,
                    amax_reduction_group=fp8_group, _graph=_graph)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Layers built inside would keep quantized primary weights; here they stay high precision."""
    gsm = FP8GlobalStateManager
    saved = (gsm.FP8_PARAMETERS, gsm.HIGH_PRECISION_INIT_VAL)
    gsm.FP8_PARAMETERS, gsm.HIGH_PRECISION_INIT_VAL = bool(enabled), bool(preserve_high_precision_init_val)
    try:
        yield
    finally:
        gsm.FP8_PARAMETERS, gsm.HIGH_PRECISION_INIT_VAL = saved


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """TE's older name of :func:`quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


def _available(*_: Any, **__: Any) -> Tuple[bool, str]:
    """Every recipe can be entered (as a no-op for the numerics)."""
    return True, ""


is_fp8_available = is_mxfp8_available = is_fp8_block_scaling_available = is_nvfp4_available = _available


def get_default_recipe() -> Recipe:
    return default_recipe()
