"""Multi-token prediction (``--mtp-num-layers``) through Megatron-LM's ``pretrain_gpt.py``, equal to
Megatron's own 1F1B on every printed metric, ``mtp_N loss`` included.

Where MTP runs: DualPipe computes it on both copies of stage pp-1 (rank pp-1's ``model[0]`` for
direction 0, rank 0's ``model[1]`` for direction 1), each for its own micro-batches; the copies'
gradients are summed like every other parameter of the pair. DualPipeV computes it on rank 0's
second chunk (V-stage 2pp-1), beside the embedding, as DeepSeek placed it. The MTP stage's copy of
the word embedding is folded with stage 0's on the ranks holding both (``mcore.model.embedding_copy``),
as Megatron's embedding-group all-reduce keeps them equal (tied or untied output weights). The
tracker behind ``mtp_N loss`` is moved to the printing rank after the schedule
(``mcore.loss_gather.move_mtp_tracker_to_last_rank``). Refused before training (test_megatron_lm.py):
MTP with context parallelism, with ``--pipeline-model-parallel-layout``, and more than one MTP layer in
the fused F&B units.

The checkpoint case is untied: at core_v0.19.0 Megatron's own 1f1b cannot save tied embeddings with
MTP in torch_dist (the MTP stage's unused output weight trips ``tie_embeddings_and_output_weights_
state_dict``'s assertion), so there is no 1f1b checkpoint of that model to start dualpipev from.
"""

import pytest

from megatron_lm_runs import (HAVE_MEGATRON_LM, LAST_OUTPUT, MOE_EP2_AUX_LOSS, SKIP_MESSAGE, assert_metrics_close,
                              run_pretrain)
from test_megatron_lm_dualpipe import CHUNKS_RE
from test_megatron_lm_dualpipev import PP2, _as_resumed_at, _one_f_one_b_then_dualpipev, _set_latest

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

#: Megatron-LM refuses MTP with learned absolute positions.
ROPE = ("--position-embedding-type", "rope")
MTP1 = ("--mtp-num-layers", "1", *ROPE)
MTP2_UNTIED = ("--mtp-num-layers", "2", *ROPE, "--untie-embeddings-and-output-weights")


def _equal_to_1f1b(schedule, *flags, own=()):
    """1f1b's metrics, after checking that ``schedule``'s (run with its ``own`` flags added) equal them."""
    ref = run_pretrain("1f1b", *flags, with_metrics=True)
    got = run_pretrain(schedule, *flags, *own, with_metrics=True)
    layers = int(flags[flags.index("--mtp-num-layers") + 1])
    for name in (f"mtp_{k + 1} loss" for k in range(layers)):
        assert all(name in ref[it] for it in ref), f"1f1b printed no {name}: {ref}"
    assert_metrics_close(got, ref, f"{schedule} {' '.join((*flags, *own))} vs 1f1b")
    return ref


@pytest.mark.parametrize("sharding", ["--dualpipe-shared-shard-group", "--dualpipe-dp-first"])
def test_dualpipe_mtp_with_sharded_copies_equal_megatron_1f1b(sharding):
    """One MTP layer, tied embeddings, pp=4, the distributed optimizer with either way of sharding the
    two copies' gradients (their sum then happens in the shards, the fold of stage 0's embedding with
    the MTP stage's copy before it): every printed metric equal to 1f1b's (one 1f1b run for both)."""
    _equal_to_1f1b("dualpipe", *MTP1, "--use-distributed-optimizer", own=(sharding,))


@pytest.mark.parametrize("schedule", ["executor-1f1b", "zb-h1"])
def test_one_chunk_executor_schedules_mtp_equal_megatron_1f1b(schedule):
    """The executor's one-chunk orders compute MTP on the last stage, as 1f1b does (the same 1f1b run)."""
    _equal_to_1f1b(schedule, *MTP1, "--use-distributed-optimizer")


#: DeepSeek-V3's uneven split in small: first and last stage 1 layer of 10 (1+4+4+1, MTP after the last).
UNEVEN = ("--num-layers", "10", "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1")


# core_v0.19.0 only in CI (the oldest tier keeps MTP through the dualpipev test below)
def test_dualpipe_two_mtp_layers_untied_uneven_equal_megatron_1f1b_and_its_checkpoint_resumed_by_1f1b(tmp_path):
    """Two MTP layers, untied output weights (the MTP stage's embedding still kept equal to stage 0's),
    uneven stages; dualpipe's torch_dist checkpoint of iteration 3 (1f1b's keys: the mirror, MTP copy
    included, is not written) resumed by 1f1b: iterations 4-5 equal the uninterrupted 1f1b run's."""
    ckpt = str(tmp_path / "dualpipe")
    saving = ("--ckpt-format", "torch_dist", "--save", ckpt, "--save-interval", "3")
    ref = _equal_to_1f1b("dualpipe", *MTP2_UNTIED, *UNEVEN, own=saving)
    _set_latest(ckpt, 3)
    back = run_pretrain("1f1b", *MTP2_UNTIED, *UNEVEN, "--ckpt-format", "torch_dist", "--load", ckpt,
                        with_metrics=True)
    assert_metrics_close(back, _as_resumed_at(ref, 3), "1f1b from dualpipe's checkpoint of iteration 3 vs 1f1b")


def test_dualpipev_mtp_from_and_to_1f1b_checkpoints_equal_megatron_1f1b(tmp_path):
    """DualPipeV computes MTP on rank 0's second chunk (V-stage 2pp-1, beside the embedding, as
    DeepSeek placed it). Its V-stages start from other weights than 1f1b's stages, so it resumes
    1f1b's torch_dist checkpoint of iteration 2 (the MTP block and its embedding copy under 1f1b's
    keys): every printed metric of iterations 3-4 equals 1f1b's. Then 1f1b resumes dualpipev's
    checkpoint of iteration 3 and its iteration 4 equals its own uninterrupted run's."""
    ref, got, dv_ckpt = _one_f_one_b_then_dualpipev(tmp_path, *MTP2_UNTIED)
    chunks = {int(r): text for s, r, text in CHUNKS_RE.findall(LAST_OUTPUT[0]) if s == "dualpipev"}
    print("\n" + "\n".join(f"rank {r}: {t}" for r, t in sorted(chunks.items())))
    assert chunks[0].endswith("model[1] stage 3/4 layers 4-4 +output +mtp") and "+mtp" not in chunks[1], chunks
    assert_metrics_close(got, _as_resumed_at(ref, 2), "dualpipev from 1f1b's checkpoint, two MTP layers, untied, "
                         "vs 1f1b")
    _set_latest(dv_ckpt, 3)
    back = run_pretrain("1f1b", *PP2, *MTP2_UNTIED, "--ckpt-format", "torch_dist", "--load", dv_ckpt,
                        with_metrics=True)
    assert_metrics_close(back, {4: ref[4]}, "1f1b from dualpipev's checkpoint of iteration 3 vs 1f1b")


def test_dualpipe_mtp_in_fused_units_equal_megatron_1f1b():
    """--overlap-moe-expert-parallel-comm with one MTP layer (megatron-core's limit; two are refused):
    every F/B through megatron-core's combined step, MTP as its post-process node, on the tiny MoE
    with expert parallel 2 x pp = 2; every printed metric equal to 1f1b's without the flag."""
    flags = (*MOE_EP2_AUX_LOSS, *MTP1, "--train-iters", "3")
    ref = run_pretrain("1f1b", *flags, with_metrics=True)
    got = run_pretrain("dualpipe", *flags, "--overlap-moe-expert-parallel-comm", with_metrics=True)
    assert LAST_OUTPUT[0].count("fused F&B units run through megatron-core's combined step") == 4
    worst = assert_metrics_close(got, ref, "dualpipe --overlap-moe-expert-parallel-comm, one MTP layer, vs 1f1b")
    assert {"lm loss", "mtp_1 loss", "load_balancing_loss"} <= set(worst)


def test_dualpipev_tied_mtp_from_1f1b_torch_checkpoint_equal_megatron_1f1b(tmp_path):
    """Tied output weights under dualpipev: V-stage 2pp-1's MTP embedding is its output weight too.
    Both schedules resume 1f1b's torch checkpoint of iteration 2 (cut into V-stages: the MTP block
    and its embedding copy go with V-stage 2pp-1; an optimizer state laid out per stage does not
    cross schedules, so both start it afresh: --no-load-optim); every printed metric equal. (With
    the embedding copy sent to V-stage 2pp-2, as before, lm loss was 4.391836 for 4.346659.)"""
    ckpt, flags = str(tmp_path / "1f1b"), (*PP2, *MTP1, "--ckpt-format", "torch")
    run_pretrain("1f1b", *flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    resumed = {s: run_pretrain(s, *flags, "--load", ckpt, "--no-load-optim", with_metrics=True)
               for s in ("1f1b", "dualpipev")}
    assert_metrics_close(resumed["dualpipev"], resumed["1f1b"], "dualpipev, one MTP layer, tied, vs 1f1b, both from "
                         "1f1b's torch checkpoint of iteration 2")
