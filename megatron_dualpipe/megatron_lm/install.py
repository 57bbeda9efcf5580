"""``install()``: activate megatron-dualpipe inside a Megatron-LM training process.

Call it after the Megatron-LM checkout is importable (its directory on ``sys.path``) and before
``pretrain()`` runs -- ideally before ``pretrain_gpt`` imports ``megatron.training``'s helpers by
name. ``python -m megatron_dualpipe.launch`` does that for an unmodified ``pretrain_gpt.py``; the
optional ``patches/megatron-lm-core_v0.16.1.patch`` calls it from the top of the script.

What it installs, in order (each step idempotent):

0. ``cpu.stand_ins.install()`` -- only where the CPU mode will be on: the stand-ins for the GPU
   libraries that are not installed (Transformer Engine, grouped_gemm, DeepEP, apex's wgrad GEMM),
   before the next steps import megatron.
1. ``triton_stub.preimport_triton_users()`` -- only if no real ``triton`` is installed: import the
   Megatron modules that ``import triton`` unconditionally, against a scoped placeholder.
2. the Megatron-LM parts of the hooks manifest (``megatron_dualpipe.hooks``, listed by
   ``megatron-dualpipe hooks``), as one set:

   * ``megatron-lm arguments`` -- ``--pipeline-schedule`` & co. and their validation
     (:mod:`.arguments`);
   * ``megatron-lm training`` -- the schedule wiring (:mod:`.training_hooks`): ``get_model`` builds the two chunks
   for ``dualpipe`` / ``dualpipev``, ``get_forward_backward_func`` returns the executor for
   every schedule but ``1f1b``, and ``save_checkpoint`` / ``load_checkpoint`` keep DualPipe
     checkpoints interchangeable with 1F1B ones (:mod:`.checkpoint`). ``1f1b`` passes
     straight through to Megatron;
   * ``megatron-lm dataset helper`` -- build Megatron's dataset C++ helper for the running
     interpreter (:mod:`.dataset_helpers`).
3. ``megatron_dualpipe.cpu.enable(megatron_lm=True)`` -- only when ``torch.cuda.is_available()``
   is False: the redirections that let megatron-core and Megatron-LM's training loop run on CPU
   with gloo (``megatron-dualpipe cpu-mode`` lists them). ``cpu=True`` requires it (an error on a
   machine with CUDA), ``cpu=False`` skips it.
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
    """The CPU mode's stand-ins for the GPU libraries that are not installed, before anything imports
    megatron (the next steps do): Megatron decides at import whether Transformer Engine exists, and
    its TE classes subclass TE's. Only where the CPU mode will be on (no CUDA)."""
    import torch

    if torch.cuda.is_available():
        return []
    from ..cpu import stand_ins

    return stand_ins.install()


def uninstall():
    """Undo :func:`install` (CPU mode first, then the hooks): every patched attribute gets back
    the very object it had. The triton placeholder modules stay imported."""
    from .. import cpu as cpu_mode, hooks
    from ..hooks.manifest import MEGATRON_LM_PARTS

    if _INSTALLED.pop("cpu", False):
        cpu_mode.disable()
    if _INSTALLED.pop("base", False):
        hooks.uninstall(MEGATRON_LM_PARTS)
