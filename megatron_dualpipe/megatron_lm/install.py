"""``install()``: activate megatron-dualpipe inside a Megatron-LM training process.

Call it after the Megatron-LM checkout is importable (its directory on ``sys.path``) and before
``pretrain()`` runs -- ideally before ``pretrain_gpt`` imports ``megatron.training``'s helpers by
name. ``python -m megatron_dualpipe.launch`` does that for an unmodified ``pretrain_gpt.py``; the
optional ``patches/megatron-lm-core_v0.16.1.patch`` calls it from the top of the script.

What it installs, in order (each step idempotent):

1. ``triton_stub.preimport_triton_users()`` -- only if no real ``triton`` is installed: import the
   Megatron modules that ``import triton`` unconditionally, against a scoped placeholder.
2. ``dataset_helpers.install()`` -- build Megatron's dataset C++ helper for the running
   interpreter.
3. ``arguments.install()`` -- ``--pipeline-schedule`` & co. and their validation.
4. ``_guard_unwired_schedules()`` -- until the DualPipe executor and its model / data /
   finalize hooks are wired in, ``--pipeline-schedule dualpipe|dualpipev`` stops at
   ``get_model`` with a clear error instead of silently training with 1F1B.
5. ``cpu_training.enable()`` -- only when ``torch.cuda.is_available()`` is False (or
   ``cpu=True``): the redirections that let Megatron-LM's training loop run on CPU with gloo.
"""

_INSTALLED = {}


def install(cpu=None):
    """Install the plugin's patches. ``cpu=None`` decides from ``torch.cuda.is_available()``."""
    from . import arguments, dataset_helpers, triton_stub

    if "base" not in _INSTALLED:
        _INSTALLED["triton_stub"] = triton_stub.preimport_triton_users()
        dataset_helpers.install()
        arguments.install()
        _guard_unwired_schedules()
        _INSTALLED["base"] = True

    import torch

    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and "cpu" not in _INSTALLED:
        from . import cpu_training

        cpu_training.enable()
        _INSTALLED["cpu"] = True
    return dict(_INSTALLED)


def _guard_unwired_schedules():
    """Wrap ``megatron.training.training.get_model`` (called by ``setup_model_and_optimizer``
    through the module global) to refuse DualPipe schedules while they are not wired in.

    TODO(integration): replace with the real hooks -- ``get_model`` (two chunks),
    ``build_train_valid_test_data_iterators`` (two iterators), ``get_forward_backward_func``
    (``megatron_dualpipe.executor.forward_backward_dualpipe``), and finalize.
    """
    import functools

    import megatron.training.training as mtraining

    orig = mtraining.get_model
    if getattr(orig, "_megatron_dualpipe_guard", False):
        return

    @functools.wraps(orig)
    def get_model(*args, **kwargs):
        from megatron.training import get_args

        schedule = getattr(get_args(), "pipeline_schedule", "1f1b")
        if schedule != "1f1b":
            raise NotImplementedError(
                f"--pipeline-schedule {schedule}: the DualPipe executor is not wired into "
                "Megatron-LM's training loop yet (megatron_dualpipe.megatron_lm); use "
                "--pipeline-schedule 1f1b"
            )
        return orig(*args, **kwargs)

    get_model._megatron_dualpipe_guard = True
    mtraining.get_model = get_model
