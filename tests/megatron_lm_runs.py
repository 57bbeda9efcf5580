"""Run Megatron-LM's own ``pretrain_gpt.py`` (torchrun, 4 gloo processes, through the launcher) and
read what ``training_log`` prints: shared by the ``test_megatron_lm_*`` files.

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` in ``MEGATRON_LM_PATH`` (the test files skip
without it). The tiny GPT of docs/megatron-lm-cpu.md, mock data, dropout off (the order in which a
schedule runs micro-batches must not change the dropout masks).
"""
import contextlib
import fcntl
import hashlib
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

from megatron_dualpipe.launch import processes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
SKIP_MESSAGE = "set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 (pretrain_gpt.py runs)"
HAVE_MEGATRON_LM = bool(MEGATRON_LM_PATH) and os.path.isfile(os.path.join(MEGATRON_LM_PATH or "", "pretrain_gpt.py"))

TINY = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--pipeline-model-parallel-size", "4",
    "--train-iters", "5", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    # every run prints every metric training_log has, and every comparison checks them all
    "--log-params-norm", "--log-num-zeros-in-grad",
    # A stuck rank is named (the executor's P2P deadline defaults to this) well before the test's
    # 600 s subprocess timeout would end the run without saying who waited for what.
    "--distributed-timeout-minutes", "5",
    # The mock data are read in each rank's own process, not by data-loader workers: Megatron's
    # default (2 workers per loader, 3 loaders) forks 6 copies of ranks 0 and pp-1 (1 GB each, gloo's
    # threads running) for batches of 64 tokens: ~2.4 s of CPU per run on 2 cores, and the one wait
    # of a rank that has no timeout (a worker that never answers; see issue 27's hang in
    # test_megatron_lm_options.py; not reproduced by tools/dataloader_fork_stress.py). The batches are
    # the same; the evaluation test keeps the workers.
    "--num-workers", "0",
]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]
#: The tiny MoE with expert parallel 2 x pp = 2 on the 4 ranks, aux loss and z-loss on: an
#: option case of test_megatron_lm_options.py and the runs of test_megatron_lm_overlap.py, which
#: therefore share one 1f1b reference run (with PRINT_EXPERT_BIAS, as every option case runs).
MOE_EP2 = (*MOE, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2")
MOE_EP2_AUX_LOSS = (*MOE_EP2, "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                    "--moe-z-loss-coeff", "1e-3")
RTOL = 1e-5
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
ITERATION_LINE_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
METRIC_RE = re.compile(r"\s*([a-z_][a-z0-9_ ]*[a-z_]):\s+([-+0-9.Ee]+|nan|inf)\s*$", re.I)
#: A field of training_log's line ("name: value"; the name may hold "(ms)", "(TFLOP/s/GPU)").
FIELD_RE = re.compile(r"\s*[^\[\]:|]+:\s*\S+\s*$")
#: Per-iteration values that are not the training's numerics (the time) or that every schedule
#: prints alike (the data counters, the learning rate of the last pipeline rank's parameters).
NOT_NUMERICS = ("elapsed time per iteration (ms)", "learning rate", "consumed samples", "global batch size")
VAL_RE = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: ([0-9.E+-]+)")

LAST_OUTPUT = [""]  # the most recent run's output, for checks beyond the losses


def require_deps():
    missing = [p for m, p in (("six", "six"), ("regex", "regex"), ("yaml", "pyyaml"), ("pydantic", "pydantic"),
                              ("pybind11", "pybind11")) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code needs: pip install {' '.join(missing)}")


#: Test-only hooks of the children (tests/child_hooks/sitecustomize.py).
CHILD_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_hooks")
#: Every rank prints each router's expert_bias after its update (launch options of run_pretrain).
PRINT_EXPERT_BIAS = {"env_extra": {"MEGATRON_DUALPIPE_TEST_EXPERT_BIAS": "1"}, "pythonpath": (CHILD_HOOKS,)}


def command(schedule, *extra, env_extra=None, pythonpath=(), torchrun_args=(), nproc=4, fast_exit=True, without=()):
    """(argv, environment) of a torchrun of pretrain_gpt.py (``nproc`` ranks) through the launcher;
    ``without``: flags of :data:`TINY` (those without a value) left out.
    ``fast_exit``: once pretrain_gpt.py has returned, each rank runs its atexit handlers and leaves
    without the interpreter's module teardown (3-5 s per rank: MEGATRON_DUALPIPE_TEST_FAST_EXIT of
    tests/child_hooks)."""
    require_deps()
    env = dict(os.environ)
    if fast_exit:
        pythonpath = (*pythonpath, CHILD_HOOKS) if CHILD_HOOKS not in pythonpath else pythonpath
        env["MEGATRON_DUALPIPE_TEST_FAST_EXIT"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, *pythonpath, env.get("PYTHONPATH")) if p)
    env.update(env_extra or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", "--nproc-per-node", str(nproc),
           *torchrun_args, "-m", "megatron_dualpipe.launch", os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"),
           *[a for a in TINY if a not in without], "--pipeline-schedule", schedule, *extra]
    return cmd, env


#: Successful runs of this test session without checkpoints, by command and environment: a reference
#: run (Megatron's 1f1b on the same arguments) that several tests compare against runs once.
_RUNS = {}
#: The folder (set by tests/conftest.py for the session) where those runs are shared by pytest-xdist's
#: workers: a worker that needs a run another one is doing waits for it instead of repeating it.
SHARED_RUNS_ENV = "MEGATRON_DUALPIPE_TEST_RUNS"


def launch(schedule, *extra, timeout=600, env_extra=None, pythonpath=(), nproc=4, fast_exit=True, without=()):
    """torchrun pretrain_gpt.py (``nproc`` ranks) through the launcher; returns (returncode, output).
    A run identical to an earlier successful one of the session (same command and environment, no
    ``--save`` / ``--load``) is not run again: its output is returned."""
    cmd, env = command(schedule, *extra, env_extra=env_extra, pythonpath=pythonpath, nproc=nproc,
                       fast_exit=fast_exit, without=without)
    if "--save" in cmd or "--load" in cmd:  # a checkpoint changes between runs
        proc = _run(cmd, env, timeout, fast_exit)
        LAST_OUTPUT[0] = proc.stdout + proc.stderr
        return proc.returncode, LAST_OUTPUT[0]
    key = (tuple(cmd), tuple(sorted((k, v) for k, v in env.items()
                                    if not k.startswith("PYTEST_") and k != SHARED_RUNS_ENV)))
    if key not in _RUNS:
        with _shared_run(key) as shared:
            if shared.output is None:
                proc = _run(cmd, env, timeout, fast_exit)
                if proc.returncode:
                    LAST_OUTPUT[0] = proc.stdout + proc.stderr
                    return proc.returncode, LAST_OUTPUT[0]
                shared.output = proc.stdout + proc.stderr
            _RUNS[key] = shared.output
    LAST_OUTPUT[0] = _RUNS[key]
    return 0, _RUNS[key]


#: Set to 1 to run every pretrain_gpt.py run under torchrun itself (no preloaded ranks).
TORCHRUN_ENV = "MEGATRON_DUALPIPE_TEST_TORCHRUN"


def _run(cmd, env, timeout, fast_exit):
    """A torchrun command's (returncode, stdout, stderr); the ranks are forked from a preloaded server
    (tests/harness/preloaded_launch.py) unless torchrun's own options are asked for; without
    ``fast_exit`` each rank ends with the interpreter's whole exit there too."""
    if os.environ.get(TORCHRUN_ENV) == "1" or cmd[2] != "--nproc-per-node" or cmd[4] != "-m":
        return _torchrun(cmd, env, timeout)
    from harness import preloaded_client

    return preloaded_client.run(cmd[4:], env, int(cmd[3]), timeout, teardown=not fast_exit)


def _torchrun(cmd, env, timeout):
    """torchrun itself, through the package's one way to run a command (its ranks, in sessions of their
    own, stopped with it past ``timeout``: subprocess.TimeoutExpired)."""
    out, err = io.BytesIO(), io.BytesIO()
    code = processes.run(cmd, env=env, stdout=out, stderr=err, timeout_s=timeout)
    return subprocess.CompletedProcess(cmd, code, out.getvalue().decode(errors="replace"),
                                       err.getvalue().decode(errors="replace"))


class _Shared:
    output = None


@contextlib.contextmanager
def _shared_run(key):
    """The output of a successful run with this key from another worker of the session, or the
    right to make it (holding a lock on it meanwhile): ``shared.output`` is None then, and what
    the caller puts there is saved for the others."""
    shared = _Shared()
    folder = os.environ.get(SHARED_RUNS_ENV)
    if not folder or not os.path.isdir(folder):
        yield shared
        return
    path = os.path.join(folder, hashlib.sha256(repr(key).encode()).hexdigest()[:32])
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(path):
                with open(path) as fh:
                    shared.output = fh.read()
            yield shared
            if shared.output is not None and not os.path.exists(path):
                with open(path + ".tmp", "w") as fh:
                    fh.write(shared.output)
                os.replace(path + ".tmp", path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def metrics(out):
    """``{iteration: {name: printed value}}`` of every numeric field of the iteration lines.

    Four ranks print at once, and ``print`` writes a line's text and its newline separately, so
    another rank's line can land on the end of an iteration line ("... |Number of parameters in
    most loaded shard in billions: 0.0001", "... |[Rank 0] (after 1 iterations) memory (MB) |
    allocated: ..."). ``training_log`` ends every field with "|": what follows the last "|" is
    such a stray, and so is everything from the first part that is not a "name: value" field on.
    Nothing else is dropped: a metric one run prints and another does not fails the comparison."""
    result = {}
    for it, rest in ITERATION_LINE_RE.findall(out):
        fields = {}
        for part in rest.split("|")[:-1]:
            if not FIELD_RE.match(part):
                break
            m = METRIC_RE.match(part)
            if m and m.group(1).strip() not in NOT_NUMERICS:
                fields[m.group(1).strip()] = m.group(2)
        result[int(it)] = fields
    return result


def failure_excerpt(out, first_lines=60, tail_chars=5000):
    """What a failed run printed that tells why: the first traceback (the rank that failed first;
    the others' errors follow from it), the launcher's line naming that rank, and the end."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    first = [] if start is None else lines[start:start + first_lines]
    named = [line for line in lines if line.startswith("preloaded_launch: rank ")]
    if start is not None and len(out) > tail_chars:
        return "\n".join(["--- the first traceback ---", *first, *named, "--- the end ---", out[-tail_chars:]])
    return "\n".join([*named, out[-tail_chars:]])


def run_pretrain(schedule, *extra, timeout=600, evaluation=False, with_metrics=False, nproc=4, **launch_options):
    """Run and return {iteration: lm loss} (with ``evaluation``, {"iteration (set)": validation
    lm loss} as well; with ``with_metrics``, {iteration: {metric: printed value}} instead).
    ``launch_options``: ``env_extra`` / ``pythonpath`` / ``fast_exit`` of :func:`launch`."""
    rc, out = launch(schedule, *extra, timeout=timeout, nproc=nproc, **launch_options)
    assert rc == 0, f"{schedule} {' '.join(extra)} failed:\n{failure_excerpt(out)}"
    losses = {int(i): float(v) for i, v in LOSS_RE.findall(out)}
    assert losses, f"no 'lm loss' lines in the output:\n{out[-3000:]}"
    print(f"\n{schedule:14s} {' '.join(extra)[:100]}: " + ", ".join(f"{i}: {v:.6f}" for i, v in sorted(losses.items())))
    if with_metrics:
        return metrics(out)
    if evaluation:
        val = {f"{i}{where}": float(v) for i, where, v in VAL_RE.findall(out)}
        assert val, f"no validation loss lines in the output:\n{out[-3000:]}"
        print(f"{schedule:14s} evaluation: " + ", ".join(f"{k}: {v:.6f}" for k, v in val.items()))
        return losses, val
    return losses


def assert_close(a, b, what):
    """Per-iteration losses equal to RTOL; prints the largest difference."""
    assert sorted(a) == sorted(b), (what, a, b)
    worst = max((abs(a[i] - b[i]) for i in a), default=0.0)
    print(f"{what}: max |difference| {worst:.3e} over iterations {sorted(a)}")
    for i in a:
        assert abs(a[i] - b[i]) <= RTOL * abs(b[i]), f"{what}: iteration {i}: {a[i]} vs {b[i]}"


def _tolerance(printed: str, ref: float) -> float:
    """What the print can resolve: the last printed digit for fixed-point values (``1.973``),
    RTOL relative for E-notation values (``5.568256E+00``)."""
    if "e" in printed.lower() or "." not in printed:
        return RTOL * abs(ref)
    return 1.01 * 10.0 ** -len(printed.split(".")[1])


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))


#: 'num zeros' counts gradient elements that are exactly 0.0: the key bias's gradient is mathematically
#: 0 (softmax ignores what is added to every key; 4 layers x 64 elements in the tiny GPT) and its
#: rounding residue lands on 0.0 or next to it depending on the summation order (evidence in
#: docs/megatron-lm-cpu.md; observed up to 5 elements apart, core_v0.16.1, bf16, tp=2, against
#: counts of 0 to 8158). Eight elements are let through, printed; loss, grad norm and params norm
#: stay exact to their print.
SLACK = {"num zeros": 8.0}


def assert_metrics_close(got, ref, what, *, slack=None, not_compared=None):
    """Every metric printed by both runs at every iteration (one that a run prints and the other
    does not fails) and equal within what its print resolves (`_tolerance`) plus ``slack``
    ({metric: allowed difference}, default `SLACK`); prints one line per metric with the largest
    absolute and relative difference. ``not_compared``: {metric: why}, printed (a metric both runs
    print that is not the same quantity in both). Returns {metric: max |difference|}."""
    slack = {**SLACK, **(slack or {})}
    not_compared = not_compared or {}
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for it in sorted(ref):
        only_ref, only_got = sorted(set(ref[it]) - set(got[it])), sorted(set(got[it]) - set(ref[it]))
        assert not only_ref and not only_got, (f"{what}: iteration {it}: printed by the reference only: {only_ref}; "
                                               f"by the run only: {only_got}")
    worst = {}
    for name in sorted({n for it in ref for n in ref[it]}):
        its = [it for it in sorted(ref) if name in ref[it]]
        if name in not_compared:
            print(f"{what}: {name}: not compared ({not_compared[name]}): "
                  f"{', '.join(got[it][name] for it in its)} vs {', '.join(ref[it][name] for it in its)}")
            continue
        diffs = [abs(float(got[it][name]) - float(ref[it][name])) for it in its]
        rels = [_relative(float(got[it][name]), float(ref[it][name])) for it in its]
        for it, diff in zip(its, diffs):
            allowed = _tolerance(ref[it][name], float(ref[it][name])) + slack.get(name, 0.0)
            assert diff <= allowed, f"{what}: iteration {it}: {name} {got[it][name]} vs {ref[it][name]}"
        worst[name] = max(diffs)
        print(f"{what}: {name}: max |difference| {worst[name]:.3e}, relative {max(rels):.3e} "
              f"({', '.join(ref[it][name] for it in its)})")
    return worst
