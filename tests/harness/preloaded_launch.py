"""A torchrun stand-in for the tests' pretrain_gpt.py runs: ranks forked from a process that has
already imported torch and Megatron-LM.

Why: a 4-rank pretrain_gpt.py run of the tiny GPT trains in about 1.5 s on this 2-core machine, but
each rank first spends about 4 s of CPU importing torch, megatron-core, Megatron-LM and triton (the
four ranks share two cores: about 9 s of wall time per run, for some 150 runs of a CI tier). A server
per pytest worker imports them once, and reads Megatron-LM's argument help texts once
(:mod:`.argument_help`: ~1 s per rank otherwise); each run forks its ranks from it. What a rank executes after
the fork is what torchrun's worker executes: the same environment (torchrun's rank variables), the
same ``python -m megatron_dualpipe.launch pretrain_gpt.py ...``, the test hooks of its PYTHONPATH
(``tests/child_hooks/sitecustomize.py``) imported as the interpreter would import them, stdout block
buffered and stderr line buffered as for a pipe, and the exit that the fast-exit hook makes
(non-daemon threads joined, atexit handlers run, no module teardown), or, for a run that asks for
the normal exit, the interpreter's whole exit (its module teardown included). The job's exit code is
torchrun's: 0 when every rank succeeded, 1 otherwise (the other ranks are sent SIGTERM, then
SIGKILL 30 s later, as torchrun's agent does).

What differs, and therefore stays with torchrun (``tests/megatron_lm_runs.py`` decides): torchrun's
restarts and options, and one string hash seed for every rank (forked, where torchrun's ranks each
draw one).
"""
import ast
import faulthandler
import importlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback

from megatron_dualpipe.launch.ports import free_port

try:
    from . import argument_help
except ImportError:  # run as a script (the server)
    import argument_help

#: torchrun's agent: SIGTERM to the surviving ranks once one fails, SIGKILL after this many seconds.
GRACE_S = 30.0
#: A job past its timeout: SIGABRT (each rank prints every thread's Python stack), SIGKILL this much later.
STACKS_S = 5.0


#: Imported by a run after pretrain_gpt.py's own imports, and heavy: the tokenizers (transformers,
#: 4 s of CPU), checkpointing, the plugin's executor, the multimodal model class that
#: get_megatron_optimizer checks for.
LATER_IMPORTS = ("megatron.core.tokenizers.text", "megatron.training.checkpointing", "megatron.core.dist_checkpointing",
                 "megatron_dualpipe.mcore.forward_backward", "megatron_dualpipe.executor.runner",
                 "megatron.core.models.mimo.model.base")


def preload(script):
    """Install the plugin as the launcher does before it runs the script (install() is idempotent and
    reads nothing of the run), then import every module ``script`` (pretrain_gpt.py) imports at its
    top level and :data:`LATER_IMPORTS`. What fails to import here is imported (and reported) by the
    ranks themselves."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from megatron_dualpipe.megatron_lm.install import install

    install()
    with open(script) as fh:
        tree = ast.parse(fh.read())
    names = [name for node in tree.body for name in (
        [a.name for a in node.names] if isinstance(node, ast.Import) else
        [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])]
    for name in (*names, *LATER_IMPORTS):
        try:
            importlib.import_module(name)
        except Exception as e:
            print(f"preloaded_launch: not preloaded: {name}: {e!r}", file=sys.stderr)
    argument_help.read_once(prefill=True)  # the same texts, read before the forks
    sys.path.pop(0)


#: In a job's environment: rank 0 hosts the TCPStore (a launch without torchrun's agent, e.g. srun),
#: instead of the job process as torchrun's agent does.
RANK0_STORE_ENV = "MEGATRON_DUALPIPE_TEST_RANK0_STORE"


def _rank_environment(env, rank, nproc, port):
    env = dict(env)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
               ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="preloaded",
               TORCHELASTIC_USE_AGENT_STORE=str(env.get(RANK0_STORE_ENV) != "1"))
    return env


def _streams(unbuffered):
    """stdout and stderr on fds 1 and 2 as a fresh interpreter sets them up for a pipe."""
    out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=unbuffered,
                           line_buffering=False)
    err = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), write_through=unbuffered,
                           line_buffering=True, errors="backslashreplace")
    sys.stdout = sys.__stdout__ = out
    sys.stderr = sys.__stderr__ = err


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


#: The server's own files (its answers), closed in the ranks through their file objects: an
#: ``os.close`` of the descriptor alone left the object to close it again at the interpreter's exit,
#: by then a number reused by a TCPStore socket ("Bad file descriptor", then an abort).
_SERVER_FILES = []


def stacks_path(output, rank):
    """Where a rank's faulthandler writes (a crash, or the SIGABRT of a job past its timeout): its own
    file, not the job's output, where the ranks' dumps would interleave mid-line; the client appends
    each line to the output marked with the rank (``[rank R] ...``)."""
    return f"{output}.stacks{rank}"


def _stacks_to(path):
    """Every thread's stack on a fatal signal, into ``path``, after a line naming the main thread as
    faulthandler names threads (``tools/failed_tests.py`` shows that thread's innermost frames)."""
    global _STACKS
    _STACKS = open(path, "w")
    _STACKS.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    _STACKS.flush()
    faulthandler.enable(file=_STACKS, all_threads=True)


_STACKS = None


def rank_main(argv, env, output, teardown):
    """In the forked rank: become torchrun's worker and run ``python ARGV``; never returns (with
    ``teardown``, it raises SystemExit through the server's frames: the interpreter's own exit)."""
    for server_file in _SERVER_FILES:
        server_file.close()
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    _streams(bool(env.get("PYTHONUNBUFFERED")))
    for path in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    _stacks_to(stacks_path(output, env["RANK"]))
    code = 0
    try:
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p):
            sys.modules.pop("sitecustomize", None)
            importlib.import_module("sitecustomize")
        assert argv[0] == "-m", argv
        import runpy

        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    if teardown:
        raise SystemExit(code)
    _leave(code)


def _leave(code):
    """What the interpreter does at exit up to its module teardown, then leave."""
    import atexit
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def run_job(request):
    """Fork the ranks of one job, host their TCPStore and wait for them as torchrun's agent does
    (the store outlives every rank: rank 0's exit does not take it from the others); returns the
    exit code (None: the job ran past ``timeout`` and was killed)."""
    nproc, port = request["nproc"], free_port()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank_main(request["argv"], _rank_environment(request["env"], rank, nproc, port), request["output"],
                      request.get("teardown", False))
        pids[pid] = rank
    from datetime import timedelta

    from torch.distributed import TCPStore  # after the forks: its server threads stay in this process

    if request["env"].get(RANK0_STORE_ENV) != "1":
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841 (kept alive)
                         timeout=timedelta(seconds=request["timeout"]))
    deadline, failed_at, code = time.monotonic() + request["timeout"], None, 0
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline and code is not None:  # the stacks first (faulthandler), then the end
                _signal_all(pids, signal.SIGABRT)
                code, deadline = None, now + STACKS_S
            elif now > deadline:
                _signal_all(pids, signal.SIGKILL)
            elif failed_at is not None and now > failed_at + GRACE_S:
                _signal_all(pids, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rank = pids.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and failed_at is None:
            failed_at, code = time.monotonic(), (1 if code is not None else None)
            _signal_all(pids, signal.SIGTERM)
            _say_first_failure(request["output"], rank, os.waitstatus_to_exitcode(status))
    return code


def _say_first_failure(output, rank, code):
    """One line in the job's output naming the rank that failed first, as torchrun's summary does:
    the others' errors (a closed connection, a failed barrier) follow from it."""
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    with open(output, "a") as fh:
        fh.write(f"\npreloaded_launch: rank {rank} failed first ({how}); the other ranks were sent SIGTERM\n")


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def serve(script):
    """Preload, then run one job per line of stdin (a JSON request), answering each on stdout with
    a JSON line; the server ends with its stdin (the pytest worker that started it)."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print must not mix with the answers
    _SERVER_FILES.append(answer)
    preload(script)
    print(json.dumps({"ready": os.getpid()}), file=answer, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        leader = os.fork()
        if leader == 0:  # the job's own process: the server itself never runs a rank's code
            code = run_job(request)
            os._exit(255 if code is None else code)
        _, status, usage = os.wait4(leader, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"returncode": None if code == 255 else code, "cpu_s": usage.ru_utime + usage.ru_stime}),
              file=answer, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
