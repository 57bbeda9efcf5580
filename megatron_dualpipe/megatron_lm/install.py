"""``install()``: activate megatron-dualpipe inside a Megatron-LM training process.

Call it once the checkout is importable and before ``pretrain_gpt`` imports ``megatron.training``'s
helpers by name (the launcher and the optional ``patches/`` hook do). Each step is idempotent: the
CPU mode's stand-ins for missing GPU libraries (before anything imports megatron, which decides at
import whether they exist), the triton placeholder, the Megatron-LM parts of the hooks manifest as
one set (``megatron-dualpipe hooks`` lists them), then the CPU mode where there is no CUDA
(``cpu=True`` requires it, ``cpu=False`` skips it).
"""

_INSTALLED = {}


def install(cpu=None):
    """Install the plugin's patches. ``cpu=None``: CPU mode exactly when CUDA is not available."""
    from .. import hooks
    from ..hooks.manifest import MEGATRON_LM_PARTS
    from . import triton_stub

    if cpu is not False and "stand_ins" not in _INSTALLED:
        _INSTALLED["stand_ins"] = _stand_ins_first()
    if "base" not in _INSTALLED:
        _INSTALLED["triton_stub"] = triton_stub.preimport_triton_users()
        hooks.install(MEGATRON_LM_PARTS)
        _INSTALLED["base"] = True

    if cpu is not False and "cpu" not in _INSTALLED:
        from .. import cpu as cpu_mode

        if cpu_mode.enable(megatron_lm=True, force=cpu is True):
            _INSTALLED["cpu"] = True
    return dict(_INSTALLED)


def _stand_ins_first():
    """The CPU mode's stand-ins for the GPU libraries that are not installed (only without CUDA)."""
    import torch

    if torch.cuda.is_available():
        return []
    from ..cpu import stand_ins

    return stand_ins.install()
