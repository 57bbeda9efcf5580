"""docs/megatron-options.md: the options table of ``megatron_dualpipe/mcore/options.py`` as markdown.

The prose around the tables is here; the rows are the table's (``tools/gen_docs.py`` writes the
file, ``tests/cli/test_docs.py`` checks it is current).
"""
from __future__ import annotations

from megatron_dualpipe.mcore import options
from megatron_dualpipe.schedule import registry

INTRO = "# Megatron-LM options under `--pipeline-schedule dualpipe` / `dualpipev`\n\n<!-- Generated from megatron_dualpipe/mcore/options.py by tools/gen_docs.py: edit the table there. -->\n\nMegatron-LM `core_v0.16.1` (megatron-core 0.16.1) and `core_v0.19.0` (megatron-core 0.19.x), `megatron/training/arguments.py`\nand `megatron/core/transformer/transformer_config.py`, read for every option that changes\nwhat happens per micro-batch or per pipeline stage (0.19's new ones: fine-grained activation offloading,\nCUDA graphs with `full_iteration`, the MoE paged stash and expert-rank capacity factor, MTP loss scaling\nthrough `mtp_grad_scale_func`, which `forward_step` applies as under 1F1B; rules marked megatron-core 0.19\nread as off at 0.16.1, where the option does not exist). Each is handled (and then compared with\nMegatron's own `1f1b` through `pretrain_gpt.py`), or refused by `validate_args` with a message\nthat names the flag to change. Every option lives in one table, `megatron_dualpipe/mcore/options.py`\n(`REFUSED`, `HANDLED`), read by Megatron-LM's argument check (`megatron_lm/arguments.py`, from\n`args`) and by megatron-core's call-time check (`mcore/validation.py`, from the model's\n`TransformerConfig`); `tests/megatron_lm/test_megatron_lm.py` checks every refusal on `args`.\nOptions that act on whole iterations (optimizer, learning rate, logging, data) run Megatron's\nown code unchanged and are not listed.\n\nStatus:\n- **equal on CPU**: `pretrain_gpt.py` on CPU (4 gloo ranks, tiny GPT, dropout off, same seed),\n  every metric `training_log` prints (lm loss, grad norm, params norm, zeros, loss scale,\n  skipped and NaN iterations, MoE aux losses; every run logs them all) equal to `1f1b`'s to what the print resolves (lm loss: 1e-5 relative; observed\n  differences 0 or a few 1e-7);\n- **refused**: `validate_args` stops before training with the message quoted (shortened);\n- **GPU, not verified**: handled in code, but no CPU path exists to run it here;\n- **CPU mode, not verified yet**: Megatron's own `1f1b` does not run it on CPU yet; the test\n  skips until the CPU mode (`megatron_dualpipe/cpu/`) runs it. Verified by hand with a local\n  stand-in where said.\n\nTest files: `A` = `tests/megatron_lm/test_megatron_lm.py` (argument cases), `D` = `tests/megatron_lm/test_megatron_lm_dualpipe.py`,\n`O` = `tests/megatron_lm/test_megatron_lm_options.py`, `C` = `tests/megatron_lm/test_megatron_lm_cpu.py`, `M` = `tests/mcore/test_dualpipe_megatron.py` (megatron-core\nlevel, against a single-process reference), `E` = `tests/mcore/test_errors.py`, `T` = `tests/megatron_lm/test_megatron_lm_te.py`\n(Transformer Engine, grouped GEMM, DeepEP and FP8 through the CPU mode's stand-ins, `megatron_dualpipe/cpu/stand_ins`).\n\n"

#: Refusals that are not one option of the table: the schedule's structure (registry rules,
#: checked in megatron_lm/arguments.py and mcore/validation.py) and what Megatron refuses itself.
NOT_OPTIONS = (
    ("`--cpu-offloading-num-layers`", "(Megatron itself refuses it with pp > 1)", "—", "—"),
    ("odd pp (dualpipe), `--num-layers` not divisible by pp (dualpipev: 2pp; an uneven split: Megatron-LM's check), fewer than pp micro-batches (also at "
     "the start of `--rampup-batch-size`), non-positive `--dualpipe-p2p-timeout`", "as named",
     "the schedule's structure (`schedule/registry.py`)", "A; E"),
    ("`--pipeline-model-parallel-layout` of another stage count than pp (dualpipe) or 2 * pp (dualpipev); "
     "`--decoder-first/last-pipeline-num-layers` under dualpipev; the embedding and loss counted as layers when "
     "(layers + counted) does not divide by 2 * pp (dualpipev)", "as named, with a layout that works",
     "the stages each rank holds (`schedule/stage_layout.py`, `megatron_lm/arguments.py`)",
     "A `dualpipev_layout_of_pp_stages`, `dualpipe_layout_of_2pp_stages`, `dualpipev_first_last_stage`, "
     "`dualpipev_embedding_and_loss_as_layers_uneven`"),
)

GRADIENTS = "## How the gradient reduction overlaps the schedule\n\n`mcore/grad_reduction.py: GradReduction`. Each chunk's reduction starts as soon as the chunk's last\nreal weight gradient (`W`, or `B`/`BW` without zero bubble) is done on the rank: the deferred\noutput-layer weight gradients if any, then the bd sum with the partner's copy (asynchronous\nall-reduce of each Megatron DDP grad buffer in place; the two copies have the same layout\nbecause Megatron-LM's `get_model` builds every DualPipe chunk unbucketed, checked once).\nNo sum is waited before the end of the schedule, on a GPU as on gloo (a stream wait there stalled\nevery later send, and with odd M the partner needed one of them: issue 17). Both partners issue\ntheir two sums in the same order, at the points the program gives\n(`schedule/lowering/reductions.py`, checked under NCCL stream semantics before the run): the order\ntheir chunks finish, which DualPipe's symmetry makes equal unless uneven padding breaks it; then\nthe lower rank's order. Megatron's `grad_sync_func` for a chunk (`--overlap-grad-reduce`) starts\nwhere the same program puts it (`lowering.reductions.dp_start_points`), the same point on every\ndata-parallel replica: with bd sums at the end of the schedule, after every sum is waited and\ntied embeddings folded; without (dualpipev, zb-h1, executor-1f1b, `--dualpipe-dp-first`) right\nafter the chunk's last gradient, except on a rank holding both ends of the model (the fold comes\nfirst). It once started where a poll saw the chunk's sum complete: a point that differs between\nthe replicas, and on one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`) a possible deadlock.\n"


def _schedules(names) -> str:
    if tuple(names) == registry.names(runs_on=registry.EXECUTOR):
        return "all executor schedules"
    return ", ".join(names)


def _sides(rule) -> str:
    return " and ".join(side for side in (options.ARGS, options.CONFIG, options.DDP) if rule.applies(side))


def _test(rule) -> str:
    return f"A `refused {rule.flag}`" if rule.test == "A" else rule.test


def report() -> str:
    lines = [INTRO.rstrip("\n"), "", "## Handled", "", "| option | status | test |", "|---|---|---|"]
    lines += [f"| {h.option} | {h.status} | {h.test} |" for h in options.HANDLED]
    lines += ["", "## Refused", "",
              "Checked on: `args` by Megatron-LM's argument check, `config` by megatron-core's call-time check (`ddp`: from the "
              "chunks' DistributedDataParallelConfig, at the same call).",
              "", "| option | schedules | why (the message names the fix) | checked on | test |", "|---|---|---|---|---|"]
    for rule in options.REFUSED:
        option = f"`{rule.flag}`" + (f" (what `{rule.needs}` needs)" if rule.needs else "")
        why = rule.message() if rule.needs else f"{rule.why}; {rule.fix or 'remove ' + rule.flag}"
        lines.append(f"| {option} | {_schedules(rule.schedules)} | {why} | {_sides(rule)} | {_test(rule)} |")
    lines += [f"| {a} | {b} | {c} | | {d} |" for a, b, c, d in NOT_OPTIONS]
    return "\n".join(lines) + "\n\n" + GRADIENTS
