""".ci/run end to end on stand-in tiers: its exit status and its last lines for a green run, a failed
test, a flaky one and a crashed tier (issue 39).

The real script runs in a copy of its folder next to the real tools/failed_tests.py and
tools/equality_matrix.py; the tiers' ``scripts/run_tests.sh`` and ``scripts/setup_venv.sh`` and the
environments' ``python`` (which CI's rerun of failed tests calls) are stand-ins whose outcome each
test chooses. Every green run of the last unlanded submission exited 1 with no test named: the
clean-up trap's ``kill`` of a finished set-up ended the shell under ``set -e``.
"""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

JUNIT = '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{}</testsuite></testsuites>'
OK = '<testcase classname="tests.test_stub" name="test_ok" time="0.1"/>'
BROKEN = ('<testcase classname="tests.test_stub" name="test_broken" time="0.1"><failure message="AssertionError: broken '
          'on purpose">tests/test_stub.py:3: AssertionError</failure></testcase>')

RUN_TESTS = f"""#!/usr/bin/env bash
# stand-in for the README's test command: STUB_NEWEST / STUB_OLDEST = pass | fail | crash
which=oldest; [ -n "${{MEGATRON_CORE:-}}" ] && which=newest
mode=$(eval echo "\\${{STUB_${{which^^}}:-pass}}")
while [ $# -gt 0 ]; do [ "$1" = --junitxml ] && junit=$2; shift; done
echo "[$which] stand-in tier: $mode"
case $mode in
  pass) echo '{JUNIT.format(OK + OK.replace("test_ok", "test_ok2"))}' > "$junit"; echo "2 passed"; exit 0;;
  fail) echo '{JUNIT.format(OK + BROKEN)}' > "$junit"; echo "1 failed, 1 passed"; exit 1;;
  crash) for i in $(seq 1 15); do echo "collecting line $i"; done; echo "INTERNALERROR> boom on purpose"; exit 3;;
esac
"""
RERUN_PYTHON = f"""#!/usr/bin/env bash
# stand-in for a tier's python, as CI's rerun calls it: STUB_RERUN = pass | fail
while [ $# -gt 0 ]; do [ "$1" = --junitxml ] && junit=$2; shift; done
if [ "${{STUB_RERUN:-fail}}" = pass ]; then
  echo '{JUNIT.format(OK.replace("test_ok", "test_broken"))}' > "$junit"; exit 0
fi
echo '{JUNIT.format(BROKEN)}' > "$junit"; exit 1
"""


def _repo(tmp_path):
    repo = tmp_path / "repo"
    for path in (".ci/run", "tools/failed_tests.py", "tools/equality_matrix.py"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, repo / path)
    stubs = {"scripts/run_tests.sh": RUN_TESTS, "scripts/setup_venv.sh": "#!/usr/bin/env bash\nexit 0\n",
             ".venv/bin/python": RERUN_PYTHON, ".venv-mcore0.19.2/bin/python": RERUN_PYTHON}
    for path, text in stubs.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
        (repo / path).chmod(0o755)
    return repo


def ci(tmp_path, **stub):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_PATH", "CI_RESULTS_DIR")}
    env.update(stub, CI="true")
    done = subprocess.run(["bash", ".ci/run"], cwd=_repo(tmp_path), env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    lines = done.stdout.rstrip().splitlines()
    print(f"\n.ci/run with {stub}: exit {done.returncode}; its last lines:\n" + "\n".join(lines[-14:]))
    return done.returncode, lines


def test_a_green_run_exits_0_and_says_so_last(tmp_path):
    code, lines = ci(tmp_path)
    assert code == 0
    assert lines[-1] == "CI green: newest 2 passed, 0 skipped; oldest 2 passed, 0 skipped"


def test_a_failed_test_is_named_last_and_fails_ci(tmp_path):
    code, lines = ci(tmp_path, STUB_NEWEST="fail", STUB_RERUN="fail")
    assert code == 1
    assert lines[-2] == ("FAILED [newest] tests/test_stub.py::test_broken: AssertionError: broken on purpose "
                         "(failed again on its rerun alone)")
    assert lines[-1] == "CI failed: newest 1 passed, 0 skipped, 1 failed; oldest 2 passed, 0 skipped"


def test_a_test_that_passes_on_its_rerun_is_flaky_and_ci_stays_green(tmp_path):
    code, lines = ci(tmp_path, STUB_NEWEST="fail", STUB_RERUN="pass")
    assert code == 0
    assert lines[-2].startswith("FLAKY [newest] tests/test_stub.py::test_broken: AssertionError: broken on purpose")
    assert lines[-1] == "CI green: newest 2 passed, 0 skipped, 1 flaky; oldest 2 passed, 0 skipped"


def test_a_crashed_tier_shows_its_last_lines(tmp_path):
    code, lines = ci(tmp_path, STUB_OLDEST="crash")
    assert code == 3  # the tier's own status
    crash = next(i for i, line in enumerate(lines) if line.startswith("CRASHED [oldest]"))
    assert "pytest exited with status 3 and left no readable JUnit file" in lines[crash]
    assert lines[crash + 1:crash + 11] == [f"    collecting line {i}" for i in range(7, 16)] + \
        ["    INTERNALERROR> boom on purpose"]
    assert lines[-1] == "CI failed: newest 2 passed, 0 skipped; oldest crashed"
