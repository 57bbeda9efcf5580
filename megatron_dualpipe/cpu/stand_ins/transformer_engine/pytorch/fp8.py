"""``transformer_engine.pytorch.fp8``: TE 2.x keeps this module as a shim over ``quantization``."""
from .quantization import (  # noqa: F401
    FP8GlobalStateManager,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    quantized_model_init,
)
