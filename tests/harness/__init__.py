"""Test helpers (not part of the package): multi-process runs and a megatron-core environment.

* :mod:`.workers` -- :func:`~.workers.run_workers`: run a function on N local processes and
  collect what each returns (torch only; the executor's toy tests use it as it is);
* :mod:`.megatron_env` -- gloo + megatron-core parallel groups, seeds, a tiny GPT, reference
  helpers, and ``run_workers`` with megatron-core preloaded.
"""
