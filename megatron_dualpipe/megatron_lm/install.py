"""``install()``: activate megatron-dualpipe inside a Megatron-LM training process, before
``pretrain_gpt`` imports ``megatron.training``'s helpers by name (the launcher and the optional
``patches/`` hook call it). The CPU mode's stand-ins come first: megatron decides at import whether
the GPU libraries exist."""

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
