"""Megatron-LM's own ``pretrain_gpt.py`` trained with ``--pipeline-schedule dualpipe`` on CPU.

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` in ``MEGATRON_LM_PATH`` (skipped otherwise;
CI has none). Every case is a ``torchrun`` of 4 gloo processes (pp=4, the tiny GPT of
docs/megatron-lm-cpu.md, mock data, dropout off so that the micro-batch order cannot change the
dropout masks), ~15-25 s each.

What is shown (losses are printed; run with ``-s`` to see them):

* per-iteration ``lm loss`` of ``dualpipe`` (zero bubble on), ``executor-1f1b`` (our executor,
  1F1B order) and Megatron's own ``1f1b`` agree to 1e-5 relative, and Megatron's parameter-count
  line gives 1F1B's count plus, separately, the physical one with the mirror;
* a ``--ckpt-format torch`` checkpoint written at iteration 3 by ``dualpipe`` resumes under
  ``1f1b`` and one written by ``1f1b`` resumes under ``dualpipe``; iterations 4-5 after resume
  equal the uninterrupted run's; ``dualpipev`` starts from such a checkpoint (remapped to its
  V-stages) with 1F1B's losses, and 1f1b reads the checkpoint dualpipev writes.

More options (recompute, per-token loss, untied embeddings, MoE with aux losses or expert bias, ...) are in
``test_megatron_lm_options.py``.

Megatron's logging quirk: ``training_log`` does not reset its loss accumulator after the first
iteration a run executes (``should_reset = not is_first_iteration``), so the line logged for the
*second* iteration of a run is the mean of the first two. In the uninterrupted run that is
iteration 2; in a resumed run it is iteration 5, logged as (L4 + L5) / 2. The comparison
therefore recovers L5 = 2 * logged5 - logged4 for resumed runs (and compares the resumed
runs with each other as logged).
"""

import re

import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, LAST_OUTPUT, SKIP_MESSAGE, assert_close, assert_metrics_close, run_pretrain

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)


_CHUNK = r"model\[\d\] stage \d/\d layers \d+-\d+(?: \+embedding)?(?: \+output)?(?: \+mtp)?"
CHUNKS_RE = re.compile(rf"\[megatron-dualpipe\] (\w+) pipeline rank (\d+): ({_CHUNK}; {_CHUNK})")


# One pattern for the whole line: four processes print at once, and print() writes the text and
# its newline separately, so another rank's line can land between them.
# core_v0.16.1: "(tensor, pipeline) ... rank (0, p)"; core_v0.19.0: "(tensor, gtp_remat, pipeline) ... rank (0, 0, p)".
PARAMS_RE = re.compile(r" > number of parameters on \(tensor, (?:gtp_remat, )?pipeline\) model parallel rank "
                       r"\(0, (?:0, )?(\d)\): (\d+)"
                       r"(?: \(logical: stage (\d); physical on this rank, with the mirrored copy of stage (\d): (\d+)\))?")


def test_executor_1f1b_and_zb_h1_losses_equal_megatron_1f1b():
    """The executor's other schedules (1F1B's order, ZB-H1's zero bubble) through pretrain_gpt.py."""
    ref = run_pretrain("1f1b")
    assert_close(run_pretrain("executor-1f1b"), ref, "executor-1f1b vs 1f1b")
    assert_close(run_pretrain("zb-h1"), ref, "zb-h1 (executor, zero bubble) vs 1f1b")


#: The architecture the shipped configs (and DeepSeek, Llama, Qwen) use instead of the tiny GPT's
#: learned absolute positions, LayerNorm, GeLU and tied embeddings.
USERS_ARCHITECTURE = ("--position-embedding-type", "rope", "--rotary-base", "10000", "--rotary-percent", "0.5",
                      "--swiglu", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
                      "--disable-bias-linear")


@pytest.mark.smoke
def test_dualpipe_and_megatron_1f1b_equal_on_the_users_architecture():
    """DualPipe (zero bubble) against Megatron's own 1f1b on RoPE (partial rotary), SwiGLU, RMSNorm
    and untied embeddings: every printed metric, the model list it built, and Megatron's
    parameter-count line (the smoke case of every tag; the executor's other schedules are the test
    above)."""
    ref = run_pretrain("1f1b", *USERS_ARCHITECTURE, with_metrics=True)
    ref_params = {int(r): int(n) for r, n, *_ in PARAMS_RE.findall(LAST_OUTPUT[0])}
    assert_metrics_close(run_pretrain("dualpipe", *USERS_ARCHITECTURE, with_metrics=True), ref,
                         "dualpipe (zero bubble) vs 1f1b, RoPE + SwiGLU + RMSNorm + untied")
    # The hooked get_model built stage i and stage pp-1-i on every rank (8 layers, pp=4).
    chunks = {int(r): text for s, r, text in CHUNKS_RE.findall(LAST_OUTPUT[0]) if s == "dualpipe"}
    print("\n" + "\n".join(f"rank {r}: {t}" for r, t in sorted(chunks.items())))
    assert chunks == {
        0: "model[0] stage 0/4 layers 1-2 +embedding; model[1] stage 3/4 layers 7-8 +output",
        1: "model[0] stage 1/4 layers 3-4; model[1] stage 2/4 layers 5-6",
        2: "model[0] stage 2/4 layers 5-6; model[1] stage 1/4 layers 3-4",
        3: "model[0] stage 3/4 layers 7-8 +output; model[1] stage 0/4 layers 1-2 +embedding",
    }
    # Megatron's parameter-count line: the logical count is 1F1B's (each stage once), the
    # physical one adds the mirrored copy of stage pp-1-i.
    lines = {int(r): (int(n), stage, mirror, physical) for r, n, stage, mirror, physical
             in PARAMS_RE.findall(LAST_OUTPUT[0])}
    print("\n".join(f"rank {r}: 1f1b {ref_params[r]}, dualpipe logical {n}, physical {p or '(missing)'}"
                    for r, (n, _, _, p) in sorted(lines.items())))
    assert sorted(lines) == sorted(ref_params) == [0, 1, 2, 3]
    for r, (n, stage, mirror, physical) in lines.items():
        assert n == ref_params[r] and stage == str(r) and mirror == str(3 - r)
        assert int(physical) == ref_params[r] + ref_params[3 - r]


#: Uneven stages (pp = 4), the three ways Megatron-LM splits them: name -> arguments.
UNEVEN_SPLITS = {
    "first and last stage 1 layer of 10": ("--num-layers", "10", "--decoder-first-pipeline-num-layers", "1",
                                           "--decoder-last-pipeline-num-layers", "1"),
    "embedding and loss counted as layers": ("--num-layers", "6", "--account-for-embedding-in-pipeline-split",
                                             "--account-for-loss-in-pipeline-split"),
    "layout Et|tt|tt|tL": ("--num-layers", "6", "--pipeline-model-parallel-layout", "Et|tt|tt|tL"),
}


@pytest.mark.parametrize("split", sorted(UNEVEN_SPLITS))
def test_uneven_stages_equal_megatron_1f1b(split):
    """DualPipe with stages of different sizes (DeepSeek-V3's 61 layers split over 8 or 16 ranks):
    megatron-core builds stage i and its mirror pp-1-i with its own offsets from each chunk's
    pipeline group; every printed metric equal to 1f1b's, and the layers each rank holds are
    1f1b's stage i and pp-1-i."""
    flags = (*UNEVEN_SPLITS[split], "--train-iters", "3")
    ref = run_pretrain("1f1b", *flags, with_metrics=True)
    got = run_pretrain("dualpipe", *flags, with_metrics=True)
    chunks = {int(r): text for s, r, text in CHUNKS_RE.findall(LAST_OUTPUT[0]) if s == "dualpipe"}
    print("\n" + "\n".join(f"rank {r}: {t}" for r, t in sorted(chunks.items())))
    assert_metrics_close(got, ref, f"dualpipe vs 1f1b, uneven stages ({split})")
    held = {r: re.findall(r"stage (\d)/4 layers (\d+-\d+)", text) for r, text in chunks.items()}
    stages = {int(stage): layers for pairs in held.values() for stage, layers in pairs}
    assert sorted(held) == [0, 1, 2, 3] and all(int(p[0][0]) == r and int(p[1][0]) == 3 - r for r, p in held.items())
    assert stages[0] == "1-1" and stages[0] != stages[1], f"not an uneven split: {stages}"


def test_evaluation_losses_equal_and_advice_logged_once():
    """Evaluation runs the schedule forward-only (8 micro-batches, both directions). With
    --dualpipe-advise (warm-up 1) training iterations 2-4 are measured and the advice logged
    once, saying which, without changing the losses. Both runs end through the interpreter's
    whole exit (``fast_exit=False``; the other runs skip its module teardown), so that a hang or
    an error there, under 1f1b or dualpipe, would show. With Megatron's default data-loader
    workers (2 per loader; the other runs read the mock data in the rank's process): the
    direction-aware iterator and the exit with persistent workers alive."""
    args = ("--train-iters", "4", "--eval-iters", "2", "--eval-interval", "2", "--num-workers", "2")
    ref_train, ref_val = run_pretrain("1f1b", *args, evaluation=True, fast_exit=False)
    train, val = run_pretrain("dualpipe", *args, "--dualpipe-advise", "--dualpipe-advise-warmup", "1",
                              evaluation=True, fast_exit=False)
    assert_close(train, ref_train, "dualpipe vs 1f1b training")
    assert_close(val, ref_val, "dualpipe vs 1f1b validation/test")
    out = LAST_OUTPUT[0]
    measured = "training iterations 2-4 of dualpipe, the first 1 skipped as warm-up"
    start = out.find(f"advice for pp=4, M=8 from {measured}")
    # On a loaded machine the measured medians can be impossible (a fused F&B unit cheaper than its
    # forward or backward alone): then the advice is withheld, once, saying why; never made up.
    withheld = out.find(f"no advice from {measured} (--dualpipe-advise-warmup): the fused F&B units measured")
    print(out[max(start, withheld):max(start, withheld) + 1500])
    assert (start >= 0) != (withheld >= 0), "one advice or one refusal, naming the measured iterations"
    assert out.count("advice for pp=4") + out.count("no advice from") == 1
    if start >= 0:
        assert re.search(r"\nM=8: use [a-z0-9-]+: ", out[start:])  # any schedule the advice knows


def _resumed_true_losses(logged):
    """{4: L4, 5: L5} from a resumed run's log (see the module docstring)."""
    return {4: logged[4], 5: 2 * logged[5] - logged[4]}


SAVE_AT_3 = ("--ckpt-format", "torch", "--save-interval", "3", "--exit-interval", "3")


@pytest.fixture(scope="module")
def dualpipe_checkpoint_at_3(tmp_path_factory):
    """(folder, {iteration: lm loss}): dualpipe's ``--ckpt-format torch`` checkpoint of iteration
    3 (it stops there), written once for the two tests that resume it (they only read it)."""
    folder = str(tmp_path_factory.mktemp("dualpipe_at_3") / "ck")
    return folder, run_pretrain("dualpipe", *SAVE_AT_3, "--save", folder)


def test_torch_checkpoint_switches_schedules(tmp_path, dualpipe_checkpoint_at_3):
    full = run_pretrain("1f1b")
    f1_ckpt = str(tmp_path / "1f1b")
    dp_ckpt, saved_dp = dualpipe_checkpoint_at_3
    saved_f1 = run_pretrain("1f1b", *SAVE_AT_3, "--save", f1_ckpt)
    assert sorted(saved_dp) == sorted(saved_f1) == [1, 2, 3]
    assert_close(saved_dp, {i: full[i] for i in (1, 2, 3)}, "dualpipe before save")

    # Both crossings, as logged against each other, and their true losses against the
    # uninterrupted 1f1b run. (1f1b resuming its own checkpoint is Megatron's feature: CI ran it as
    # a third crossing until the CI-time cut; its logged losses equalled these two.)
    resumed = {
        "dualpipe -> 1f1b": run_pretrain("1f1b", "--ckpt-format", "torch", "--load", dp_ckpt),
        "1f1b -> dualpipe": run_pretrain("dualpipe", "--ckpt-format", "torch", "--load", f1_ckpt),
    }
    assert_close(resumed["1f1b -> dualpipe"], resumed["dualpipe -> 1f1b"], "1f1b -> dualpipe vs dualpipe -> 1f1b (as logged)")
    for what, logged in resumed.items():
        assert sorted(logged) == [4, 5], (what, logged)
        assert_close(_resumed_true_losses(logged), {4: full[4], 5: full[5]}, f"{what} vs uninterrupted")


def test_resume_without_optimizer_state_and_dualpipev_across_1f1b(tmp_path, dualpipe_checkpoint_at_3):
    """--no-load-optim: fresh Adam state on both copies; must match 1f1b doing the same, both with
    the distributed optimizer (its loads used to fail under DualPipe: the mirror sync did not know
    it). The same checkpoint (1F1B's layout, written by dualpipe) starts dualpipev from 1F1B's
    weights, remapped to its V-stages (with --overlap-grad-reduce and the tied embedding folded on
    rank 0); dualpipev's own checkpoint (written at iteration 5) is read by 1f1b, whose loss at
    iteration 6 (computed on the weights it loaded) is the one 1f1b reaches by training on."""
    dv_ckpt = str(tmp_path / "dv")
    ckpt, _ = dualpipe_checkpoint_at_3
    resume = ("--ckpt-format", "torch", "--load", ckpt, "--no-load-optim")
    dist_opt = ("--use-distributed-optimizer",)
    a = run_pretrain("dualpipe", *resume, *dist_opt)
    b = run_pretrain("1f1b", *resume, *dist_opt, "--train-iters", "6")  # logs 4, (4 + 5) / 2, 6
    # --overlap-grad-reduce: rank 0 folds the tied embedding of its two chunks before their data-
    # parallel reductions start (the fold used to edit main_grad under an in-flight reduction).
    # Megatron-LM requires --save-interval with --save; 5 saves at the last iteration only.
    v = run_pretrain("dualpipev", *resume, "--save", dv_ckpt, "--save-interval", "5", "--overlap-grad-reduce")
    upto5 = {i: b[i] for i in (4, 5)}
    assert_close(a, upto5, "dualpipe vs 1f1b after --no-load-optim resume, distributed optimizer")
    assert_close(v, upto5, "dualpipev (--overlap-grad-reduce) from 1f1b's weights (remapped to V-stages) vs 1f1b")
    onward = run_pretrain("1f1b", "--ckpt-format", "torch", "--no-load-optim", "--train-iters", "6", "--load", dv_ckpt)
    assert_close(onward, {6: b[6]}, "1f1b from dualpipev's checkpoint of iteration 5 vs 1f1b trained on to 6")
