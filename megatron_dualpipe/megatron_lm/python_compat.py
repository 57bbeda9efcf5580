"""What Megatron-LM's training code takes from a newer Python than the one running it.

Megatron-LM core_v0.19.0 (``megatron/training/models/gpt.py`` and ``hybrid.py``) imports
``typing.override``, new in Python 3.12; megatron-core itself uses ``typing_extensions.override``,
the same decorator for older Pythons. The manifest's ``python`` part (installed first by
``megatron_lm.install.install()``, only where ``typing`` lacks the name) supplies it, so the
checkout runs on Python 3.11 unmodified.
"""


def typing_override(original):
    """``typing.override`` for Python < 3.12: ``typing_extensions.override`` (a decorator that only
    marks the method)."""
    from typing_extensions import override

    return override
