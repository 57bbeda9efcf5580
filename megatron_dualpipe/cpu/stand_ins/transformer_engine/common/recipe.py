"""``transformer_engine.common.recipe``: the low-precision recipes megatron-core builds.

megatron-core picks a recipe from its config (``fp8_utils.get_fp8_recipe``, the per-module quantization
overrides) and hands it to the autocast; the layers only ask which kind it is (``recipe.delayed()``, ...).
TE's recipes are pydantic dataclasses that ignore unknown keyword arguments (megatron's ``TEDelayedScaling``
passes ``override_linear_precision``, ``params_dtype`` and ``device``, which no recipe has); these are
plain classes with the same fields, defaults and kind predicates, and they ignore unknown arguments too.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar, Dict, NamedTuple


class _FormatHelper(NamedTuple):
    """Largest representable value in the forward and backward pass of a format."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """Low-precision formats (HYBRID: E4M3 forward, E5M2 backward)."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class MMParams(NamedTuple):
    """GEMM options of a recipe (read, never used on the CPU)."""

    use_split_accumulator: bool = True


class Recipe:
    """Base of every recipe: keyword fields with defaults (``FIELDS``) and the kind predicates."""

    FIELDS: ClassVar[Dict[str, Any]] = {"fp8_dpa": False, "fp8_mha": False}

    def __init__(self, **kwargs: Any) -> None:
        for name, default in self.FIELDS.items():
            setattr(self, name, kwargs.get(name, default))
        self._check()

    def _check(self) -> None:
        fmt = getattr(self, "fp8_format", None)
        if fmt is not None and not isinstance(fmt, Format):
            raise TypeError(f"{type(self).__name__}: fp8_format must be a Format, got {fmt!r}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self).__name__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({fields})"

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)


_GEMMS = {name: MMParams() for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")}


class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history (pure E5M2 refused, as TE does)."""

    FIELDS = {"margin": 0, "fp8_format": Format.HYBRID, "amax_history_len": 1024,
              "amax_compute_algo": "max", "scaling_factor_compute_algo": None, "reduce_amax": True,
              **Recipe.FIELDS}

    def _check(self) -> None:
        super()._check()
        if self.fp8_format == Format.E5M2:
            raise ValueError("Pure E5M2 training is not supported.")


class Float8CurrentScaling(Recipe):
    """Per-tensor scales from the current amax."""

    FIELDS = {"fp8_format": Format.HYBRID, "use_power_2_scales": False, **_GEMMS, **Recipe.FIELDS}


class MXFP8BlockScaling(Recipe):
    """E8M0 scales per 32-element block."""

    FIELDS = {"margin": 0, "fp8_format": Format.E4M3, **Recipe.FIELDS}


class Float8BlockScaling(Recipe):
    """FP32 scales per 1x128 / 128x128 block."""

    FIELDS = {"fp8_format": Format.E4M3, "use_f32_scales": False, "x_block_scaling_dim": 1,
              "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1, **_GEMMS, **Recipe.FIELDS}


class NVFP4BlockScaling(Recipe):
    """E2M1 values with E4M3 block scales."""

    FIELDS = {"fp4_format": Format.E2M1, "fp8_format": Format.E4M3, "disable_rht": False,
              "disable_stochastic_rounding": False, "disable_2d_quantization": False, **Recipe.FIELDS}


class CustomRecipe(Recipe):
    """A user quantizer factory (``qfactory``), megatron's ``Fp8Recipe.custom``."""

    FIELDS = {"qfactory": None, **Recipe.FIELDS}

    def _check(self) -> None:
        if not callable(self.qfactory):
            raise TypeError(f"CustomRecipe needs a callable qfactory, got {self.qfactory!r}")


def default_recipe() -> Recipe:
    """The recipe of an autocast entered without one (TE's default on Hopper: delayed scaling)."""
    return DelayedScaling()


__all__ = ["Format", "MMParams", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
           "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]
