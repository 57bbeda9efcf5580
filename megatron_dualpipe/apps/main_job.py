"""The main job: train a small megatron-core GPT on text with DualPipe, then with 1F1B.

Started plainly, the module is the *launcher*: it checks every argument before anything starts,
prepares the data and starts ``torchrun`` with this module as the *workers*, which train the same
initial weights on the same batches with both schedules (docs/main-job.md). Embeddings are untied:
megatron-core's 1F1B needs megatron DDP for the tied-embedding all-reduce.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import shlex
import shutil
import sys
import time
from typing import Dict, Iterator, List, Optional

from .data_prep import DataError, PreparedData, add_data_arguments, check_split, default_cache_dir
from .data_prep import describe_indexed, documents_per_split, prepare_from_args, split_counts, split_weights
from ..launch import interrupts, processes
from ..schedule import registry
from ..schedule.layout import V_SHAPE
from .progress import Progress

#: The schedules the main job compares with 1F1B: those holding two model chunks per rank.
SCHEDULES = registry.names(chunks_per_rank=2)
HEADS = 4
#: Training iterations at the end of the DualPipe run whose timelines the executor records; the
#: least disturbed (fastest) one is drawn, as benchmarks take the minimum of repeated runs.
RECORDED_ITERATIONS = 5


def _int_at_least(least: int, what: str):
    """An argparse type: an integer >= ``least``, named ``what`` in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "an integer >= 0")


def build_parser() -> argparse.ArgumentParser:
    prog = os.environ.get("MEGATRON_DUALPIPE_PROG", "python -m megatron_dualpipe.apps.main_job")
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                usage=f"{prog} [--schedule {'|'.join(SCHEDULES)}] [--iters N] [--text PATH ...] "
                                      f"[more options: --help]")
    p.add_argument("--schedule", default=registry.DUALPIPE, choices=SCHEDULES)
    p.add_argument("--nproc", type=_positive_int, default=4, help="processes = pipeline stages (default 4)")
    p.add_argument("--iters", type=_positive_int, default=30, help="training iterations per schedule (default 30)")
    p.add_argument("--microbatches", type=_positive_int, default=16, help="micro-batches per iteration (default 16)")
    p.add_argument("--micro-batch-size", type=_positive_int, default=2)
    p.add_argument("--seq-length", type=_positive_int, default=64)
    p.add_argument("--num-layers", type=_positive_int, default=8)
    p.add_argument("--hidden-size", type=_positive_int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-iters", type=_count, default=2,
                   help="validation batches (of --microbatches micro-batches) after training (default 2)")
    p.add_argument("--no-compare", action="store_true", help="skip the 1F1B run")
    p.add_argument("--out", default="out", metavar="DIR", help="where the pictures and summary go (default out)")
    p.add_argument("--master-port", type=_positive_int, default=None, help="default: a free port")
    g = p.add_argument_group("data (default: Python's help texts, tokenized on the first run and cached)")
    add_data_arguments(g, text_flag="--text")
    g.add_argument("--data-path", metavar="PREFIX", help="a Megatron indexed dataset (PREFIX.bin/.idx) instead of "
                   "--text; needs --tokenizer unless prepare-data wrote it")
    return p


def check_args(args) -> Optional[str]:
    """The first problem with the arguments, as one sentence naming the fix; None if none."""
    n, spec = args.nproc, registry.get(args.schedule)
    if n < 2:
        return f"--nproc {n}: a pipeline needs at least 2 processes"
    if problem := spec.pp_problem(n, flag="--nproc"):
        return problem
    stages = spec.model_stages(n)
    if args.num_layers % stages:
        return (f"{spec.name} with --nproc {n} cuts the model into {stages} stages, so --num-layers must be a "
                f"multiple of {stages}, got {args.num_layers}: use --num-layers {math.ceil(args.num_layers / stages) * stages}")
    least = spec.min_real_microbatches(n)
    if args.microbatches < least:
        return (f"{spec.name} with --nproc {n} needs at least {least} micro-batches per iteration: use "
                f"--microbatches {least} or more")
    if args.hidden_size % HEADS:
        return (f"--hidden-size {args.hidden_size} is not divisible by the {HEADS} attention heads: "
                f"use --hidden-size {math.ceil(args.hidden_size / HEADS) * HEADS}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a positive number, got {args.lr}"
    if args.text and args.data_path:
        return "give --text (to prepare) or --data-path (already prepared), not both"
    try:
        no_validation = split_weights(args.split)[1] == 0
    except DataError as e:
        return str(e)
    if args.eval_iters and no_validation:
        return (f"--split {args.split} has no validation split for --eval-iters {args.eval_iters}: give it a "
                f"weight (e.g. --split 90,10,0) or use --eval-iters 0")
    return None


#: Launcher-only options, not passed to the workers (torchrun would also take ``--nproc`` for an
#: abbreviation of its ``--nproc-per-node``, and ``--master-port`` as its own).
LAUNCHER_ONLY = ("help", "nproc", "master_port")


def to_argv(parser: argparse.ArgumentParser, args) -> List[str]:
    """Arguments that parse back to ``args``, launcher-only options left out (the workers' brief)."""
    out: List[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in LAUNCHER_ONLY:
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[-1]
        if action.nargs == 0:
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [flag, *map(str, value)] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out


# --- Launcher ---------------------------------------------------------------------------------

def resolve_data(args) -> PreparedData:
    """The prepared data the workers will read (built now on a cache miss), split checked."""
    if args.data_path:
        from ..launch.checks import largest_token_id

        data = describe_indexed(args.data_path, args.tokenizer, args.eod_token)
        check_split(args.split, data.documents)
        top = largest_token_id(args.data_path)
        if top is not None and top >= data.vocab_size:  # the embedding would fail with an IndexError
            raise DataError(f"--data-path {args.data_path} holds token id {top} but the tokenizer "
                            f"{data.tokenizer_dir} has only {data.vocab_size} entries: pass the --tokenizer the "
                            f"data was tokenized with")
    else:
        with Progress("prepare-data") as progress:
            data, _ = prepare_from_args(args, progress)
    return data


def draw_schedule(args) -> None:
    """The simulated timeline of the workers' schedule, and it above 1F1B's at the same scale."""
    from ..pictures.figure import to_png
    from .report import write_schedule_comparison
    from ..schedule.simulate import Costs, simulate

    m = registry.get(args.schedule).padded_microbatches(args.nproc, args.microbatches)
    schedule = registry.build_schedule(args.schedule, args.nproc, m)
    to_png(schedule, simulate(schedule.layout, schedule.ranks, Costs()),
           os.path.join(args.out, f"{args.schedule}_pp{args.nproc}_m{m}.png"))
    write_schedule_comparison(args.out, args.schedule, args.nproc, args.microbatches)


def written_since(directories: List[str], started: float) -> List[str]:
    """Files under ``directories`` modified at or after ``started``."""
    found = (os.path.join(folder, f) for root in directories for folder, _, files in os.walk(root) for f in files)
    return sorted(path for path in found if os.path.getmtime(path) >= started - 1)


def launch(parser: argparse.ArgumentParser, args) -> int:
    problem = check_args(args)
    if problem:
        parser.error(problem)
    started = time.time()
    try:
        data = resolve_data(args)
    except DataError as e:
        parser.error(str(e))
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create --out {args.out}: {e.strerror or e}")
    draw_schedule(args)
    worker = argparse.Namespace(**vars(args))
    worker.text, worker.data_path = [], data.prefix
    worker.tokenizer = args.tokenizer if args.data_path else None
    worker.cache_dir = args.cache_dir or default_cache_dir()
    rendezvous = ["--master-port", str(args.master_port)] if args.master_port else ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), *rendezvous,
           "-m", "megatron_dualpipe.apps.main_job", *to_argv(parser, worker)]
    # unless set: torchrun warns when it has to set the threads, tokenizers about forking after use
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **os.environ}
    print(f"starting {args.nproc} processes: torchrun {shlex.join(cmd[3:])}", flush=True)
    # torchrun and its ranks in a session of their own, all stopped (and silenced) on Ctrl-C,
    # SIGTERM or a closed stdout before KeyboardInterrupt / BrokenPipeError reaches main().
    code = processes.run(cmd, env=env)
    if code != 0:
        print(f"{parser.prog}: error: the training processes failed (exit status {code}); the failing "
              f"rank's message is above", file=sys.stderr)
        return code
    roots = [args.out] + ([] if data.cached else [os.path.dirname(data.prefix)])
    print("\nfiles written:")
    for path in written_since(roots, started):
        print(f"  {path} ({_size(os.path.getsize(path))})")
    return 0


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:,.0f} KB" if n < 1024 ** 2 else f"{n / 1024 ** 2:,.1f} MB"


# --- Workers ----------------------------------------------------------------------------------

def model_spec(args, vocab_size: int):
    """The proofs' tiny GPT at the job's size, made on the CPU everywhere (the same weights with a GPU)."""
    from ..proof.models import ModelSpec

    return ModelSpec(layers=args.num_layers, hidden=args.hidden_size, heads=HEADS, seq=args.seq_length,
                     vocab=vocab_size, config=(("use_cpu_initialization", True),))


def gather_full_state(model):
    """Every rank's copy of the whole model's weights, keyed by global layer numbers (tiny
    model: all_gather_object is fine), so the 1F1B run can start from the same weights."""
    import torch
    import torch.distributed as dist

    from ..proof.names import layer_offset, stage_layer_key

    mine = {stage_layer_key(k, layer_offset(chunk)): v.detach().cpu().clone()
            for chunk in model for k, v in chunk.state_dict().items() if isinstance(v, torch.Tensor)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


class Trainer:
    """Trains and evaluates one model with one ``forward_backward_func`` on the shared batches."""

    def __init__(self, args, train_ds, valid_ds, log):
        self.args, self.train_ds, self.valid_ds, self.log = args, train_ds, valid_ds, log
        self.samples_per_iteration = args.microbatches * args.micro_batch_size
        self.tokens_per_iteration = self.samples_per_iteration * args.seq_length

    def batches(self, dataset, iteration: int, device) -> Iterator[Dict]:
        """The iteration's micro-batches on ``device``, read lazily (middle stages read none)."""
        from .gpt_data import micro_batch

        for g in range(self.args.microbatches):
            first = iteration * self.samples_per_iteration + g * self.args.micro_batch_size
            yield {k: v.to(device) for k, v in micro_batch(dataset, first, self.args.micro_batch_size).items()}

    def _run(self, fb_func, model, dataset, iteration, forward_only):
        """pretrain_gpt's ``forward_step`` (:func:`..proof.data.forward_step`) over the shared batches."""
        from ..proof.data import forward_step

        a, device = self.args, next(model[0].parameters()).device
        return fb_func(forward_step_func=forward_step, data_iterator=self.batches(dataset, iteration, device),
                       model=model, num_microbatches=a.microbatches, seq_length=a.seq_length,
                       micro_batch_size=a.micro_batch_size, forward_only=forward_only)

    def train(self, name, model, fb_func, record_into: Optional[str] = None):
        """``args.iters`` iterations with Adam; the :class:`RunResult` (losses on the last rank), the
        last :data:`RECORDED_ITERATIONS` iterations' timelines recorded into ``record_into``."""
        import torch

        from .report import RunResult

        a = self.args
        opt = torch.optim.Adam([p for chunk in model for p in chunk.parameters()], lr=a.lr)
        result = RunResult(name, [])
        t_start = time.perf_counter()
        for it in range(a.iters):
            t0 = time.perf_counter()
            opt.zero_grad()
            with _recording(record_into if it >= a.iters - RECORDED_ITERATIONS else None):
                out = self._run(fb_func, model, self.train_ds, it, forward_only=False)
            opt.step()
            ms = (time.perf_counter() - t0) * 1000
            if out:
                loss = torch.stack([d["lm loss"] for d in out]).mean().item()
                result.losses.append(loss)
                self.log(f" [{name}] iteration {it + 1:>5}/{a.iters:>5} | consumed samples: "
                         f"{(it + 1) * self.samples_per_iteration:>7} | elapsed time per iteration (ms): {ms:7.1f} | "
                         f"tokens per second: {self.tokens_per_iteration / ms * 1000:8.0f} | learning rate: "
                         f"{a.lr:.3E} | lm loss: {loss:.6E} |")
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_second = a.iters * self.tokens_per_iteration / result.seconds
        result.valid_loss = self.validate(name, model, fb_func)
        return result

    def validate(self, name, model, fb_func) -> Optional[float]:
        """Mean lm loss over ``args.eval_iters`` held-out batches (forward only; last rank)."""
        import torch

        if not self.args.eval_iters or self.valid_ds is None:
            return None
        with torch.no_grad():
            losses = [d["lm loss"] for k in range(self.args.eval_iters)
                      for d in self._run(fb_func, model, self.valid_ds, k, forward_only=True) or []]
        if not losses:
            return None
        loss = torch.stack(losses).mean().item()
        self.log(f" [{name}] validation loss at iteration {self.args.iters} on {len(losses)} held-out micro-batches "
                 f"| lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(loss, 50)):.6E} |")
        return loss


def _home(path: str) -> str:
    """``path`` with the home directory written as ``~`` (summaries get committed as examples)."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + os.sep) else path


@contextlib.contextmanager
def _recording(directory: Optional[str]):
    """The executor's timeline recorder (``MEGATRON_DUALPIPE_TRACE``) on inside, when ``directory`` is given."""
    from ..executor.trace import ENV_DIR

    before = os.environ.get(ENV_DIR)
    if directory is not None:
        os.environ[ENV_DIR] = directory
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_DIR, None)
        else:
            os.environ[ENV_DIR] = before


def write_reports(args, data: PreparedData, pp: int, device: str, dual, one) -> None:
    """loss.png and summary.md in ``args.out`` (last rank)."""
    from .report import compare_file, simulated_pair, summary_markdown, write_loss_png

    title = (f"{dual.name} vs 1f1b, pp={pp}, {args.num_layers} layers, hidden {args.hidden_size}, "
             f"{args.microbatches}x{args.micro_batch_size}x{args.seq_length} tokens per iteration")
    write_loss_png(os.path.join(args.out, "loss.png"), dual, one, title)
    counts = documents_per_split(args.split, data.documents)
    settings = [f"{dual.name} against megatron-core's 1F1B from the same initial weights, pp={pp} ({device})",
                f"GPT: {args.num_layers} layers, hidden {args.hidden_size}, {HEADS} heads, vocabulary "
                f"{data.vocab_size}, local layer spec, fp32, dropout off, untied embeddings",
                f"{args.iters} iterations of {args.microbatches} micro-batches x {args.micro_batch_size} x "
                f"{args.seq_length} tokens, Adam lr {args.lr:g}, seed {args.seed}",
                f"validation: {args.eval_iters} batches of {args.microbatches} micro-batches after training"]
    data_lines = [f"{data.source}: {data.documents} documents, {data.tokens:,} tokens",
                  f"split {args.split}: {split_counts(counts)} documents",
                  f"megatron-core GPTDataset over `{_home(data.prefix)}`, tokenizer `{_home(data.tokenizer_dir)}`"]
    picture = f"{args.schedule}_pp{pp}_m"
    pictures = ["loss.png"] + [f for f in ("timeline.png",) if os.path.isfile(os.path.join(args.out, f))]
    pictures += sorted(f for f in os.listdir(args.out) if f.startswith(picture) and f.endswith(".png"))
    compared = compare_file(args.schedule, pp, args.microbatches)
    pictures += [compared] if os.path.isfile(os.path.join(args.out, compared)) else []
    _, makespans = simulated_pair(args.schedule, pp, args.microbatches)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(summary_markdown(dual, one, settings, data_lines, pictures, makespans))


def worker(args) -> int:
    from .quiet import SUMMARY, silence_known_warnings

    silence_known_warnings()
    import torch
    import torch.distributed as dist

    from megatron_dualpipe import cpu as cpu_mode

    cpu = cpu_mode.enable()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(minutes=5))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb_func

    from megatron_dualpipe.apps.gpt_data import build_datasets
    from megatron_dualpipe.mcore.forward_backward import get_forward_backward_func
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model
    from megatron_dualpipe.apps.report import print_comparison, write_measured_timeline
    from megatron_dualpipe.proof.models import build, provider
    from megatron_dualpipe.proof.tiny_gpt import seed_all

    args.nproc = world
    last = rank == world - 1

    def log(msg):
        if last:
            print(msg, flush=True)

    data = describe_indexed(args.data_path, args.tokenizer, args.eod_token)
    samples = args.microbatches * args.micro_batch_size
    train_ds, valid_ds = build_datasets(data, args.seq_length, args.split, args.iters * samples,
                                        args.eval_iters * samples, args.seed,
                                        os.path.join(args.cache_dir or default_cache_dir(), "gpt_dataset_indices"))
    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    build_bd_groups()
    seed_all(args.seed)
    device = "CPU/gloo" if cpu else "GPU/NCCL"
    log(f"megatron-dualpipe main job: {args.schedule} vs megatron-core 1F1B, pp={world}, {args.num_layers} layers, "
        f"hidden {args.hidden_size}, vocabulary {data.vocab_size}, {args.microbatches} micro-batches x "
        f"{args.micro_batch_size} x {args.seq_length} tokens per iteration, {device}")
    log(f" data: {data.source}, {data.documents} documents, {data.tokens:,} tokens, through megatron-core's GPTDataset")
    if cpu:
        log(f" {SUMMARY}")

    kind, spec = registry.get(args.schedule).layout_kind, model_spec(args, data.vocab_size)
    model = build_two_direction_model(provider(spec, v_layout=kind == V_SHAPE), layout_kind=kind)
    if kind != V_SHAPE:
        broadcast_mirrors(model)
    for chunk in model:
        chunk.config.finalize_model_grads_func = lambda *a, **k: None  # pp only, untied: nothing else to reduce
    initial = gather_full_state(model)
    trainer = Trainer(args, train_ds, valid_ds, log)
    records = os.path.join(args.out, "trace_records")
    if rank == 0:
        shutil.rmtree(records, ignore_errors=True)  # the recorder appends: start from nothing
    dist.barrier()
    dual = trainer.train(args.schedule, model, get_forward_backward_func(args.schedule), record_into=records)
    dist.barrier()  # every rank's recording is written
    if last:
        write_measured_timeline(records, args.out)
    if not args.no_compare:
        # 1F1B over the same initial weights: stage i of pp holds layers [i*L/pp, (i+1)*L/pp).
        one = trainer.train(registry.ONE_F_ONE_B, build(spec, registry.ONE_F_ONE_B, initial), megatron_fb_func())
        if last:
            print_comparison(dual, one, args.schedule, world, args.microbatches)
            write_reports(args, data, world, device, dual, one)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        if not args.data_path:
            parser.error("the workers need --data-path: start the job with python -m megatron_dualpipe.apps.main_job "
                         "(it prepares the data and starts torchrun)")
        return worker(args)  # the launcher stops the workers and drops their output on an interruption
    return interrupts.guarded(lambda: launch(parser, args), parser.prog)


if __name__ == "__main__":
    sys.exit(main())
