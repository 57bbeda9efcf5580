"""The pytest side of :mod:`.preloaded_launch`: one preloading server per script and pytest worker,
started on first use, asked to run each job; returns what ``subprocess.run(..., capture_output=True,
text=True)`` of the torchrun command would; a job past its timeout returns 124 and every rank's Python
stacks (where subprocess.run would raise TimeoutExpired without them)."""
import json
import os
import subprocess
import sys
import tempfile

from megatron_dualpipe.launch import spawn

_SERVERS = {}
#: CPU seconds (user + system) of the last job's ranks, for benchmarks.
LAST_CPU_S = [0.0]
_HERE = os.path.dirname(os.path.abspath(__file__))


def _server(script, env):
    server = _SERVERS.get(script)
    if server is None or server.poll() is not None:
        base = {k: v for k, v in env.items() if not k.startswith("MEGATRON_DUALPIPE_TEST_")}
        base["PYTHONPATH"] = os.pathsep.join([os.path.dirname(_HERE)] + [p for p in base.get("PYTHONPATH", "").split(
            os.pathsep) if p and not os.path.isfile(os.path.join(p, "sitecustomize.py"))])
        server = subprocess.Popen([sys.executable, os.path.join(_HERE, "preloaded_launch.py"), script],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=base, text=True)
        ready = server.stdout.readline()
        assert ready.startswith('{"ready"'), f"the preloading server for {script} did not start: {ready!r}"
        _SERVERS[script] = server
    return server


def run(argv, env, nproc, timeout, teardown=False):
    """Run ``python ARGV`` on ``nproc`` ranks forked from the server (argv: ["-m", module, script, ...]);
    ``teardown``: each rank ends with the interpreter's whole exit."""
    script = next(a for a in argv if a.endswith(".py"))
    server = _server(script, env)
    with tempfile.NamedTemporaryFile("r", suffix=".log", delete=True) as out:
        request = {"argv": argv, "env": env, "nproc": nproc, "timeout": timeout, "output": out.name,
                   "teardown": teardown}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, f"the preloading server for {script} ended"
        answer = json.loads(answer)
        LAST_CPU_S[0] = answer["cpu_s"]
        code = answer["returncode"]
        output = out.read() + spawn.labelled_stacks(out.name, nproc)  # a crash, or past the timeout
    if code is None:  # the ranks printed their stacks (SIGABRT, faulthandler) before they were killed
        return subprocess.CompletedProcess(argv, 124, output + f"\npreloaded_launch: the job ran past its {timeout} s "
                                           "timeout: every rank's Python stacks are above\n", "")
    return subprocess.CompletedProcess(argv, code, output, "")
