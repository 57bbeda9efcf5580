"""Megatron-LM (``megatron.training`` / ``pretrain_gpt.py``) integration of megatron-dualpipe.

Import-light on purpose: nothing here imports torch or megatron. The pieces are

* :mod:`.install` -- ``install()``: the one call that activates the plugin inside a Megatron-LM
  process (used by ``python -m megatron_dualpipe.launch`` and by the optional
  ``patches/megatron-lm-core_v0.16.1.patch``);
* :mod:`.arguments` -- the ``--pipeline-schedule`` family of flags and their validation (the
  options themselves: ``mcore/options.py``);
* :mod:`.training_hooks` -- ``get_model`` / ``get_forward_backward_func`` & co. for the schedules;
* :mod:`.checkpoint` -- checkpoints in 1F1B's layout, a (schedule, format) -> strategy table;
* :mod:`.triton_stub` and :mod:`.dataset_helpers` -- environment fixes for a missing ``triton``
  package and for building Megatron's dataset C++ helper with the running interpreter.

Running the training loop without a GPU is :mod:`megatron_dualpipe.cpu`'s job (``install()``
switches it on when ``torch.cuda.is_available()`` is False).
"""
