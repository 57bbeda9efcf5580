"""Megatron-LM (``megatron.training`` / ``pretrain_gpt.py``) integration of megatron-dualpipe.

Import-light on purpose: nothing here imports torch or megatron. The pieces are

* :mod:`.install` -- ``install()``: the one call that activates the plugin inside a Megatron-LM
  process (used by ``python -m megatron_dualpipe.launch`` and by the optional
  ``patches/megatron-lm-core_v0.16.1.patch``);
* :mod:`.arguments` -- the ``--pipeline-schedule`` family of flags and their validation;
* :mod:`.cpu_training` -- redirections that let Megatron-LM's training loop run without a GPU
  (active only when ``torch.cuda.is_available()`` is False);
* :mod:`.triton_stub` and :mod:`.dataset_helpers` -- environment fixes for a missing ``triton``
  package and for building Megatron's dataset C++ helper with the running interpreter.
"""
