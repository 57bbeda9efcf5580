"""The proof harness: what the tests (on the CPU) and ``megatron-dualpipe selftest`` (on the user's
GPUs) both use to prove DualPipe equal to a reference and free of hangs, so that both prove the
same claims through the same code.

* :mod:`.tiny_gpt` -- the tiny megatron-core GPT (config, model, seeds);
* :mod:`.data` -- its micro-batches, the masked loss, ``forward_step`` (pretrain_gpt's contract);
* :mod:`.names` -- a stage's parameters under the full (pp=1) model's names;
* :mod:`.models` -- the model under 1F1B, DualPipe, DualPipeV from one set of weights, one iteration;
* :mod:`.groups` -- megatron-core's parallel groups and seeds;
* :mod:`.reference` -- the single-process reference (per micro-batch losses and gradients);
* :mod:`.compare` -- the equality check (:class:`.compare.Gap`, one printed line);
* :mod:`.nohang` -- the no-hang check (a failing rank's peers stop, naming a rank, in time).
"""
