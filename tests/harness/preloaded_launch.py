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
import importlib
import io
import json
import os
import signal
import sys
import traceback

from megatron_dualpipe.launch import spawn
from megatron_dualpipe.launch.ports import free_port

try:
    from . import argument_help
except ImportError:  # run as a script (the server)
    import argument_help

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
    """torchrun's variables: the rendezvous (:func:`spawn.rank_environment`) and its agent's."""
    env = {**env, **spawn.rank_environment(rank, nproc, port)}
    env.update(GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
               ROLE_NAME="default", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="preloaded",
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
    """Fork the ranks of one job (:func:`spawn.fork`), host their TCPStore and wait for them as
    torchrun's agent does (:func:`spawn.wait`; the store outlives every rank: rank 0's exit does not
    take it from the others); returns the exit code (None: the job ran past ``timeout`` and was killed,
    after each rank wrote its stacks next to the output: :func:`spawn.stacks_path`)."""
    nproc, port, output = request["nproc"], free_port(), request["output"]

    def rank(r):
        rank_main(request["argv"], _rank_environment(request["env"], r, nproc, port), output,
                  request.get("teardown", False))

    ranks = spawn.fork(nproc, rank, output)
    from datetime import timedelta

    from torch.distributed import TCPStore  # after the forks: its server threads stay in this process

    if request["env"].get(RANK0_STORE_ENV) != "1":
        store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841 (kept alive)
                         timeout=timedelta(seconds=request["timeout"]))
    return spawn.wait(ranks, request["timeout"], on_failure=lambda rank, code: _say_first_failure(output, rank, code))


def _say_first_failure(output, rank, code):
    """One line in the job's output naming the rank that failed first, as torchrun's summary does:
    the others' errors (a closed connection, a failed barrier) follow from it."""
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    with open(output, "a") as fh:
        fh.write(f"\npreloaded_launch: rank {rank} failed first ({how}); the other ranks were sent SIGTERM\n")


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
