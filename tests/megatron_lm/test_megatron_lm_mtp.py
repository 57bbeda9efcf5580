"""Multi-token prediction (``--mtp-num-layers``) through Megatron-LM's ``pretrain_gpt.py``, equal to
Megatron's own 1F1B on every printed metric, ``mtp_1 loss`` included.

Where MTP runs: DualPipe computes it on both copies of stage pp-1 (rank pp-1's ``model[0]`` for
direction 0, rank 0's ``model[1]`` for direction 1), each for its own micro-batches; the copies'
gradients are summed like every other parameter of the pair, and the MTP stage's embedding copy is
folded with stage 0's embedding on the ranks holding both (``mcore.finalize.embedding_copy``), as
Megatron's embedding-group all-reduce does. The tracker behind ``mtp_1 loss`` is moved to the
printing rank after the schedule (``mcore.loss_gather.move_mtp_tracker_to_last_rank``).
"""

import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, SKIP_MESSAGE, assert_metrics_close, run_pretrain

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

#: Megatron-LM refuses MTP with learned absolute positions.
ROPE = ("--position-embedding-type", "rope")
MTP1 = ("--mtp-num-layers", "1", *ROPE)
MTP2_UNTIED = ("--mtp-num-layers", "2", *ROPE, "--untie-embeddings-and-output-weights")


def _equal_to_1f1b(schedule, *flags):
    ref = run_pretrain("1f1b", *flags, with_metrics=True)
    got = run_pretrain(schedule, *flags, with_metrics=True)
    layers = int(flags[flags.index("--mtp-num-layers") + 1])
    for name in (f"mtp_{k + 1} loss" for k in range(layers)):
        assert all(name in ref[it] for it in ref), f"1f1b printed no {name}: {ref}"
    return assert_metrics_close(got, ref, f"{schedule} {' '.join(flags)} vs 1f1b")


def test_dualpipe_mtp_equal_megatron_1f1b():
    """One MTP layer, tied embeddings, pp=4: every printed metric equal to 1f1b's."""
    _equal_to_1f1b("dualpipe", *MTP1)


def test_dualpipe_two_mtp_layers_untied_equal_megatron_1f1b():
    """Two MTP layers, untied output weights (the MTP stage's embedding still kept equal to stage 0's)."""
    _equal_to_1f1b("dualpipe", *MTP2_UNTIED)
