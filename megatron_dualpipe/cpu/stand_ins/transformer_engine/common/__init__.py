"""``transformer_engine.common``: the recipes (the real package also loads the CUDA library)."""
from . import recipe  # noqa: F401
