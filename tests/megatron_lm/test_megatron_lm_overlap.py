"""Megatron-LM's ``pretrain_gpt.py`` with ``--overlap-moe-expert-parallel-comm`` and DualPipe(V), on CPU.

Needs ``MEGATRON_LM_PATH`` (see ``test_megatron_lm_dualpipe.py``; the runner is ``megatron_lm_runs``). The
tiny MoE (4 experts, top-2, alltoall, aux loss and z-loss) with expert parallel 2 and pp 2 on 4 gloo
processes, the arguments of test_megatron_lm_options.py's "MoE EP2 x pp=2, aux loss, z-loss" case,
whose 1f1b run is the reference here too (one run per session):
megatron-core's ``TransformerConfig`` alone refuses the flag with pp > 1 and no virtual pipeline,
and ``pretrain_gpt.py`` builds a config on every ``get_batch``; the plugin's config adapter lets
it through, every F/B runs through megatron-core's combined step (the log says so on every rank),
and every printed metric (lm loss, the aux losses, grad norm, params norm) equals Megatron's own
1F1B without the flag. (DualPipeV through Megatron-LM gave the same losses with and without the
flag, 0.0 difference, when run by hand: left out to keep the suite short;
``tests/mcore/test_overlap.py`` covers it on megatron-core.)
"""
import pytest

from megatron_lm_runs import (HAVE_MEGATRON_LM, LAST_OUTPUT, MOE_EP2_AUX_LOSS, PRINT_EXPERT_BIAS, SKIP_MESSAGE,
                              assert_metrics_close, run_pretrain)

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

ITERS = ("--train-iters", "3")
OVERLAP = "--overlap-moe-expert-parallel-comm"
COMBINED = "fused F&B units run through megatron-core's combined step"


def test_overlap_moe_expert_parallel_comm_equals_megatron_1f1b(schedule="dualpipe", reference="1f1b"):
    ref = run_pretrain(reference, *MOE_EP2_AUX_LOSS, *ITERS, with_metrics=True, **PRINT_EXPERT_BIAS)
    got = run_pretrain(schedule, *MOE_EP2_AUX_LOSS, OVERLAP, *ITERS, with_metrics=True, **PRINT_EXPERT_BIAS)
    announced = LAST_OUTPUT[0].count(COMBINED)
    print(f"{schedule} {OVERLAP}: combined step announced by {announced} processes")
    assert announced == 4
    worst = assert_metrics_close(got, ref, f"{schedule} {OVERLAP} vs {reference}")
    assert {"lm loss", "load_balancing_loss", "z_loss"} <= set(worst)
