"""What Megatron-LM's training code takes from a newer Python: core_v0.19.0 imports
``typing.override`` (Python 3.12); the manifest's ``python`` part supplies it where ``typing`` lacks it."""


def typing_override(original):
    """``typing.override`` for Python < 3.12: ``typing_extensions.override``."""
    from typing_extensions import override

    return override
