"""DualPipeV through Megatron-LM's ``pretrain_gpt.py`` in the combinations production runs use (bf16
and fp16, the distributed optimizer with overlapped grad reduce and param gather, tp = 2 with
sequence parallelism, MoE with expert parallel 2, checkpoints across schedules), each equal to
Megatron's own 1F1B; and the stage checks docs/dualpipev-stage-checks.md found no other test for
(untied output layer, per-token loss, evaluation, MoE on some layers only).

DualPipeV's rank i holds V-stages i and 2pp-1-i, each initialised from its own seed, so a fresh
dualpipev run starts from other weights than 1f1b's. Each case therefore starts dualpipev from
1F1B's weights: Megatron's own 1f1b trains 4 iterations and saves at 2 (its curve is the
reference); dualpipev resumes that checkpoint (remapped to its V-stages, optimizer state
included) and trains iterations 3 and 4, whose every printed metric must equal 1f1b's.

Megatron's logging quirk (see test_megatron_lm_dualpipe.py): a resumed run logs its second
iteration's accumulated values (the losses of ``total_loss_dict``) as the mean of its first two,
so the reference's iteration 4 is compared as that mean (for every printed ``... loss``: the MoE
tracker adds its losses to the same dict); per-iteration values (grad norm, params norm, num
zeros, loss scale) are compared as printed.

Before core_v0.19.0's fix (each chunk's Float16Module built with the chunk's own config) every
bf16 / fp16 case here failed at the first forward: V-stage pp-1 on the last rank upcast its
output to fp32 as if it ended the model.
"""

import os
import re

import pytest
import torch

from megatron_lm_runs import (HAVE_MEGATRON_LM, LAST_OUTPUT, MOE_EP2, RTOL, SKIP_MESSAGE, VAL_RE, assert_metrics_close,
                              launch, run_pretrain)

pytestmark = [
    pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests; CPU mode is never active next to a GPU"),
]

PP2 = ("--num-layers", "4", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", "--train-iters", "4")
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--make-vocab-size-divisible-by", "64")


def _set_latest(ckpt, iteration):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _as_resumed_at(ref, at):
    """The reference's metrics from iteration ``at + 1`` on, as a run resumed at ``at`` logs them:
    the accumulated losses of its second iteration are the mean of its first two."""
    first, second = at + 1, at + 2
    got = {i: dict(ref[i]) for i in (first, second)}
    for name in got[second]:
        if name.endswith("loss"):  # Megatron accumulates these in total_loss_dict (MoE's too)
            mean = (float(ref[first][name]) + float(ref[second][name])) / 2
            got[second][name] = f"{mean:.6E}"
    return got


def _validation_losses(out):
    """{"iteration[ on <set> set]": validation lm loss as printed} of a run's output."""
    return {f"{i}{where}": value for i, where, value in VAL_RE.findall(out)}


def _one_f_one_b_then_dualpipev(tmp_path, *flags, fmt="torch_dist", nproc=4, validation=None):
    """Megatron's 1f1b trains 4 iterations saving at 2; dualpipev resumes at 2 and trains on to 4,
    saving at 3 and 4. Returns (1f1b's metrics, dualpipev's metrics, dualpipev's checkpoint); a
    ``validation`` dict gets each schedule's `_validation_losses`."""
    ref_ckpt, dv_ckpt = str(tmp_path / "1f1b"), str(tmp_path / "dualpipev")
    ckpt = ("--ckpt-format", fmt)
    found = validation if validation is not None else {}
    ref = run_pretrain("1f1b", *PP2, *flags, *ckpt, "--save", ref_ckpt, "--save-interval", "2", nproc=nproc,
                       with_metrics=True)
    found["1f1b"] = _validation_losses(LAST_OUTPUT[0])
    _set_latest(ref_ckpt, 2)
    got = run_pretrain("dualpipev", *PP2, *flags, *ckpt, "--load", ref_ckpt, "--save", dv_ckpt,
                       "--save-interval", "1", nproc=nproc, with_metrics=True)
    found["dualpipev"] = _validation_losses(LAST_OUTPUT[0])
    return ref, got, dv_ckpt


def test_dualpipev_bf16_distributed_optimizer_overlap_torch_dist_across_schedules(tmp_path):
    """bf16, the distributed optimizer over dp = 2 with --overlap-grad-reduce --overlap-param-gather,
    torch_dist checkpoints (fully reshardable: the dp_reshardable state is keyed by grad buffer,
    and DualPipeV's buffers hold other stages than 1F1B's; that one is refused in one line,
    tests/megatron_lm/test_checkpoint_strategies.py): 1f1b -> dualpipev (iterations 3, 4) -> 1f1b
    (iteration 4 from dualpipev's checkpoint of 3), each iteration's metrics equal to 1f1b's."""
    flags = ("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
             "--dist-ckpt-optim-fully-reshardable")
    ref, got, dv_ckpt = _one_f_one_b_then_dualpipev(tmp_path, *flags)
    assert_metrics_close(got, _as_resumed_at(ref, 2), "dualpipev from 1f1b's torch_dist checkpoint, bf16, "
                         "distributed optimizer dp=2, overlapped grad reduce and param gather vs 1f1b")
    _set_latest(dv_ckpt, 3)
    back = run_pretrain("1f1b", *PP2, *flags, "--ckpt-format", "torch_dist", "--load", dv_ckpt, with_metrics=True)
    assert_metrics_close(back, {4: ref[4]}, "1f1b from dualpipev's torch_dist checkpoint of iteration 3, bf16, "
                         "distributed optimizer dp=2 vs 1f1b")


def test_dualpipev_refuses_another_layouts_dp_reshardable_state_once(tmp_path):
    """Megatron's default torch_dist optimizer state (dp_reshardable: keyed by grad buffer) of a 1f1b
    run holds 1F1B's stages: every dualpipev rank refuses it (strategies.load_reshardable_state). The
    refusal used to come as a traceback from every rank; it is one line, said once (by the first rank
    that refuses), naming the fix, no traceback, and the job fails."""
    ckpt = str(tmp_path / "1f1b")
    flags = (*PP2, "--use-distributed-optimizer", "--ckpt-format", "torch_dist")
    run_pretrain("1f1b", *flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    rc, out = launch("dualpipev", *flags, "--load", ckpt)
    said = [line for line in out.splitlines() if "--dist-ckpt-optim-fully-reshardable" in line]
    print(f"\ndualpipev --load of 1f1b's dp_reshardable checkpoint: exit {rc}, {said}")
    assert rc != 0 and "Traceback" not in out, out[-5000:]
    assert len(said) == 1 and said[0].startswith("megatron_dualpipe.launch: error: --pipeline-schedule dualpipev: ")
    assert "--no-load-optim" in said[0]


def test_dualpipev_fp16_loss_scaling_tp2_sequence_parallel(tmp_path):
    """fp16 with dynamic loss scaling, tp = 2 with --sequence-parallel, the distributed optimizer,
    torch_dist checkpoints. The initial scale 2^19 overflows: 1f1b skips iteration 2 and saves
    there, so the scaler's state (scale, hysteresis) crosses the checkpoint and iteration 3 is
    skipped again after the resume. Skipped iterations change what Megatron logs next (no loss,
    counts summed), so the reference is 1f1b resumed from the same checkpoint, logging alike.
    (Without the distributed optimizer Megatron's own 1f1b cannot resume its fp16 torch_dist
    checkpoint at core_v0.19.0: "Could not find parameter group with key ...".)"""
    flags = ("--fp16", "--initial-loss-scale", str(2 ** 19), *TP2_SP, "--use-distributed-optimizer",
             "--dist-ckpt-optim-fully-reshardable", "--ckpt-format", "torch_dist")
    ckpt = str(tmp_path / "1f1b")
    run_pretrain("1f1b", *PP2, *flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    resumed = {schedule: run_pretrain(schedule, *PP2, *flags, "--load", ckpt, with_metrics=True)
               for schedule in ("1f1b", "dualpipev")}
    skipped = [int(m["number of skipped iterations"]) for _, m in sorted(resumed["1f1b"].items())]
    print(f"1f1b resumed at 2, skipped iterations per logged line: {skipped}")
    assert any(skipped), "no iteration skipped after the resume: the scaler's state did not cross the checkpoint"
    assert_metrics_close(resumed["dualpipev"], resumed["1f1b"], "dualpipev vs 1f1b, both resumed from 1f1b's "
                         "checkpoint, fp16 with loss scaling, tp=2 + sequence parallel, distributed optimizer")


def test_dualpipev_moe_expert_parallel_bf16(tmp_path):
    """MoE with expert parallel 2 (x pp = 2), aux loss and z-loss, bf16, torch_dist checkpoints."""
    flags = (*MOE_EP2, "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
             "--moe-z-loss-coeff", "1e-3", "--bf16")
    ref, got, _ = _one_f_one_b_then_dualpipev(tmp_path, *flags)
    assert_metrics_close(got, _as_resumed_at(ref, 2), "dualpipev from 1f1b's checkpoint, MoE EP2 aux + z loss, "
                         "bf16 vs 1f1b")


def test_dualpipev_untied_per_token_loss_evaluation(tmp_path):
    """The stage checks DualPipeV's other tests leave out (docs/dualpipev-stage-checks.md): the
    untied output layer (model[1] on rank 0, not ``shared``: counted once in the grad norm, params
    norm and zeros), per-token loss (rank 0 counts the tokens, Megatron's finalize broadcasts them
    from rank pp-1) and evaluation (``evaluate`` reads the loss dicts where
    ``is_pp_last_stage(pp)``: rank pp-1, which the executor gathers them to)."""
    flags = ("--untie-embeddings-and-output-weights", "--calculate-per-token-loss", "--eval-iters", "2",
             "--eval-interval", "2")
    val = {}
    ref, got, _ = _one_f_one_b_then_dualpipev(tmp_path, *flags, validation=val)
    assert_metrics_close(got, _as_resumed_at(ref, 2), "dualpipev from 1f1b's checkpoint, untied, per-token loss "
                         "vs 1f1b")
    after_resume = sorted(k for k in val["dualpipev"] if int(k.split()[0]) > 2)
    print(f"validation lm loss, 1f1b: {val['1f1b']}; dualpipev: {val['dualpipev']}")
    assert after_resume, f"dualpipev printed no validation loss after its resume: {val['dualpipev']}"
    for key in after_resume:
        assert float(val["dualpipev"][key]) == pytest.approx(float(val["1f1b"][key]), rel=RTOL, abs=0), key


def test_dualpipev_moe_layer_freq_builds_each_stage_its_layers(tmp_path):
    """``--moe-layer-freq``: megatron's layer spec (``get_gpt_decoder_block_spec`` without
    ``pp_rank``) picks each layer's MoE or dense spec from ``parallel_state``'s pipeline rank; while
    model[1] is built that rank is pp-1-i (hooks manifest: scoped ``_MPU_PIPELINE_MODEL_PARALLEL_RANK``).
    Layers 1 and 3 MoE, 2 and 4 dense: with rank i's own rank, V-stage 3 (layer 4, model[1] on
    rank 0) would get layer 3's MoE spec and V-stage 2 (layer 3) layer 4's dense one. (Every rank
    holds a MoE layer under both schedules: megatron-core 0.16.1 prints a load_balancing_loss not
    averaged over data parallel when the last pipeline rank holds none; docs/dualpipev-stage-checks.md.)"""
    flags = (*MOE_EP2, "--moe-layer-freq", "([1,0]*2)", "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", "1e-2")
    ref, got, _ = _one_f_one_b_then_dualpipev(tmp_path, *flags)
    assert_metrics_close(got, _as_resumed_at(ref, 2), "dualpipev from 1f1b's checkpoint, MoE EP2 on layers 1 and 3 "
                         "only vs 1f1b")


#: Uneven V-stages (pp = 2, 6 layers) -> (1f1b's flags, dualpipev's flags, the chunks each rank holds).
#: Megatron's own 1f1b runs the same model with stage t = V-stages 2t and 2t+1 (a layout: stage_layout.
#: paired; the embedding and loss counted: the same flags), so its torch checkpoint cuts into the V-stages.
V_CHUNKS_RE = re.compile(r"\[megatron-dualpipe\] dualpipev pipeline rank (\d+): "
                         r"(model\[0\] [^;\n]*; model\[1\] [^\n]*)")
V_SPLITS = {
    # four V-stages of 0, 4, 2 and 0 layers: rank 0 holds only the embedding (V-stage 0) and the output
    # layer with the loss (V-stage 3), as DeepSeek keeps them on one rank; rank 1 V-stages 1 and 2
    "layout E|tttt|tt|L": (
        ("--pipeline-model-parallel-layout", "Et*4|ttL"), ("--pipeline-model-parallel-layout", "E|tttt|tt|L"),
        {0: "model[0] stage 0/4 no layers +embedding; model[1] stage 3/4 no layers +output",
         1: "model[0] stage 1/4 layers 1-4; model[1] stage 2/4 layers 5-6"}),
    # Megatron's interleaved meaning: (6 + 2) / 4 per V-stage, V-stages 0 and 3 one layer fewer
    "embedding and loss counted as layers": (
        ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
        ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
        {0: "model[0] stage 0/4 layers 1-1 +embedding; model[1] stage 3/4 layers 6-6 +output",
         1: "model[0] stage 1/4 layers 2-3; model[1] stage 2/4 layers 4-5"}),
}


@pytest.mark.parametrize("split", [pytest.param(s, marks=pytest.mark.smoke) if s.startswith("layout") else s
                                   for s in sorted(V_SPLITS)])  # the layout also at core_v0.16.1
def test_dualpipev_uneven_v_stages_equal_megatron_1f1b(tmp_path, split):
    """Uneven V-stages: megatron-core gives each chunk the layers of its V-stage (vp_stage, pipeline
    rank); a layout reads vp_stage only while parallel_state says two virtual stages (hooks manifest:
    scoped ``_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE``; without it model[1] takes V-stage
    (0, pp-1-i)'s layers). Both schedules resume 1f1b's torch checkpoint of iteration 2 (cut into the
    V-stages by the sizes built; an optimizer state laid out per stage does not cross schedules, so
    both start it afresh: --no-load-optim); every printed metric of dualpipev equal to 1f1b's, and
    each rank holds the V-stages the split names."""
    ref_flags, v_flags, expected = V_SPLITS[split]
    ckpt = str(tmp_path / "1f1b")
    flags = ("--num-layers", "6", "--ckpt-format", "torch")
    run_pretrain("1f1b", *PP2, *flags, *ref_flags, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2")
    resumed = {schedule: run_pretrain(schedule, *PP2, *flags, *more, "--load", ckpt, "--no-load-optim",
                                      with_metrics=True)
               for schedule, more in (("1f1b", ref_flags), ("dualpipev", v_flags))}
    chunks = {int(r): text for r, text in V_CHUNKS_RE.findall(LAST_OUTPUT[0])}
    print(f"\n1f1b {' '.join(ref_flags)}; dualpipev {' '.join(v_flags)}\n"
          + "\n".join(f"rank {r}: {t}" for r, t in sorted(chunks.items())))
    assert chunks == expected
    assert_metrics_close(resumed["dualpipev"], resumed["1f1b"], f"dualpipev, {split}, vs 1f1b, both from 1f1b's "
                         f"checkpoint of iteration 2")


#: What megatron-core's ``sharded_param_state_fully_reshardable`` logs when it slices a parameter past the
#: gathered (unpadded) state: the parameter is then written shifted, zeros at its end.
SHIFTED_RE = re.compile(r"'([^']+)' param range exceeds unpadded buffer by (\d+) elements")


def test_dualpipev_fully_reshardable_optimizer_state_resumed_by_1f1b(tmp_path):
    """The distributed optimizer (fp32, dp = 2), ``--ckpt-format torch_dist
    --dist-ckpt-optim-fully-reshardable`` (the optimizer state of every parameter under its model key):
    1f1b trains 5 iterations saving at 2; dualpipev resumes it and trains 3 to 5 saving at 3; 1f1b
    resumes dualpipev's checkpoint of 3 and trains 4 and 5. Every metric equal to 1f1b's.

    Under the distributed optimizer the tied word embedding has a grad bucket of its own after the rest
    of the first stage's parameters, which are padded to a multiple of lcm(dp, 128) = 128 elements.
    DualPipeV's V-stage 0 (layer 1: 49,984 elements; the position embedding: 4,096) pads 64, 1F1B's stage
    0 (layers 1-2 and the position embedding: 104,064 = 813 x 128) none. megatron-core's save slices the
    state gathered without that padding at the padded offsets, so dualpipev wrote the embedding's
    ``param``, ``exp_avg`` and ``exp_avg_sq`` shifted by 64 elements, the last 64 zeros, and 1f1b's
    update of iteration 4 moved the embedding from there (its loss of 5 and params norm of 4 and 5
    differed; iteration 4's loss is computed before that update). :func:`exact_offsets` of
    ``megatron_lm.checkpoint.optimizers`` gives the save each parameter's own offsets."""
    flags = (*PP2, "--train-iters", "5", "--use-distributed-optimizer", "--ckpt-format", "torch_dist",
             "--dist-ckpt-optim-fully-reshardable")
    ref_ckpt, dv_ckpt = str(tmp_path / "1f1b"), str(tmp_path / "dualpipev")
    ref = run_pretrain("1f1b", *flags, "--save", ref_ckpt, "--save-interval", "2", with_metrics=True)
    _set_latest(ref_ckpt, 2)
    got = run_pretrain("dualpipev", *flags, "--load", ref_ckpt, "--save", dv_ckpt, "--save-interval", "3",
                       with_metrics=True)
    shifted = sorted(set(SHIFTED_RE.findall(LAST_OUTPUT[0])))
    print(f"dualpipev's load and save, parameters megatron-core sliced past the gathered state: {shifted or 'none'}")
    _set_latest(dv_ckpt, 3)
    back = run_pretrain("1f1b", *flags, "--load", dv_ckpt, with_metrics=True)
    assert_metrics_close(got, {5: ref[5], **_as_resumed_at(ref, 2)}, "dualpipev from 1f1b's checkpoint of 2, "
                         "distributed optimizer dp=2, fully reshardable, vs 1f1b")
    assert_metrics_close(back, _as_resumed_at(ref, 3), "1f1b from dualpipev's checkpoint of 3, distributed "
                         "optimizer dp=2, fully reshardable, vs 1f1b")
    assert not shifted, f"megatron-core wrote these parameters' optimizer state shifted: {shifted}"
