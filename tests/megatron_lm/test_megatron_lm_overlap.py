"""Megatron-LM's ``pretrain_gpt.py`` with ``--overlap-moe-expert-parallel-comm`` and DualPipe(V), on CPU.

Needs ``MEGATRON_LM_PATH`` (see ``test_megatron_lm_dualpipe.py``; the runner is ``megatron_lm_runs``). The
tiny MoE (4 experts, top-2, alltoall) with expert parallel 2 and pp 2 on 4 gloo processes:
megatron-core's ``TransformerConfig`` alone refuses the flag with pp > 1 and no virtual pipeline,
and ``pretrain_gpt.py`` builds a config on every ``get_batch``; the plugin's config adapter lets
it through, every F/B runs through megatron-core's combined step (the log says so on every rank),
and the per-iteration losses equal Megatron's own 1F1B without the flag. (DualPipeV through
Megatron-LM gave the same losses with and without the flag, 0.0 difference, when run by hand:
left out to keep the suite short; ``tests/mcore/test_overlap.py`` covers it on megatron-core.)
"""
import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, LAST_OUTPUT, MOE, SKIP_MESSAGE, assert_close, run_pretrain

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

EP2 = [*MOE, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--train-iters", "3"]
OVERLAP = "--overlap-moe-expert-parallel-comm"
COMBINED = "fused F&B units run through megatron-core's combined step"


def test_overlap_moe_expert_parallel_comm_equals_megatron_1f1b(schedule="dualpipe", reference="1f1b"):
    ref = run_pretrain(reference, *EP2)
    got = run_pretrain(schedule, *EP2, OVERLAP)
    announced = LAST_OUTPUT[0].count(COMBINED)
    print(f"{schedule} {OVERLAP}: combined step announced by {announced} processes; "
          f"max |loss diff| vs {reference}: {max(abs(got[i] - ref[i]) for i in ref):.2e}")
    assert announced == 4
    assert_close(got, ref, f"{schedule} {OVERLAP} vs {reference}")
