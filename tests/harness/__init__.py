"""Test helpers (not part of the package): multi-process runs and a megatron-core environment.

* :mod:`.workers` -- :func:`~.workers.run_workers`: run a function on N local processes and
  collect what each returns (torch only; the executor's toy tests use it as it is), through the
  package's one spawner, :mod:`megatron_dualpipe.launch.spawn`;
* :mod:`.preloaded_launch` (the server) and :mod:`.preloaded_client` -- a torchrun stand-in for the
  pretrain_gpt.py runs: ranks forked (:func:`megatron_dualpipe.launch.spawn.fork`) from a process
  that has imported Megatron-LM once;
* :mod:`.megatron_env` -- gloo + megatron-core parallel groups, seeds, and ``run_workers`` with
  megatron-core preloaded. The tiny GPT, its data, the references and the equality and no-hang
  checks are the package's :mod:`megatron_dualpipe.proof`, shared with the selftest.
"""
