"""tools/failed_tests.py, the end of CI's log: one line per failed, errored or hung test with its tier
and first error line, a crashed tier's last lines, flaky tests named, and a last line that says green
or failed with each tier's counts. The hangs come from real timeouts (pytest-timeout, and a process
whose stacks faulthandler dumps as the preloaded launch's ranks do), not from made-up text."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "failed_tests.py"

PORTS = "tests.bench.test_ports"
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>"""
PASSED = f'<testcase classname="{PORTS}" name="test_ok" time="0.1"/>'
SKIPPED = f'<testcase classname="{PORTS}" name="test_skip" time="0.1"><skipped message="no"/></testcase>'
FAILED = f"""<testcase classname="{PORTS}" name="test_a_port_in_use_is_skipped" time="0.2">
<failure message="StopIteration: the first line&#10;the second line">line one
{{body}}
E   StopIteration: the last line</failure></testcase>"""
ERROR = ('<testcase classname="tests.cli.test_x.TestY" name="test_setup[a b]" time="0.1">'
         '<error message="failed on setup with &quot;OSError: broke&quot;">boom</error></testcase>')


def run(*args, code=None):
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=ROOT)
    print(done.stdout, done.stderr)
    assert done.stderr == "" and (code is None or done.returncode == code), done.returncode
    return done.stdout


def write(path, *cases):
    path.write_text(JUNIT.format(cases="".join(cases)))
    return path


def tier(name, xml, log="", status=1):
    return ["--tier", name, str(xml), str(log), str(status)]


def test_a_failure_an_error_and_a_crash_end_the_log_one_line_each(tmp_path):
    xml = write(tmp_path / "newest.xml", PASSED, SKIPPED,
                FAILED.format(body="\n".join(f"frame {i}" for i in range(40))), ERROR)
    log = tmp_path / "oldest.log"
    log.write_text("\n".join(f"collecting {i}" for i in range(30)) + "\nINTERNALERROR> the crash's own line\n")
    out = run("report", *tier("newest", xml), *tier("oldest", tmp_path / "absent.xml", log, 3), code=1)
    lines = out.rstrip().splitlines()
    summary = lines[lines.index("CI summary: 3 test(s) or tier(s) to look at") + 1:]
    assert summary[0] == ("FAILED [newest] tests/bench/test_ports.py::test_a_port_in_use_is_skipped: "
                          "StopIteration: the first line")
    assert summary[1] == 'ERROR [newest] tests/cli/test_x/TestY.py::test_setup[a b]: failed on setup with "OSError: broke"'
    assert summary[2].startswith("CRASHED [oldest]: pytest exited with status 3 and left no readable JUnit file")
    assert summary[3:-1] == ["    " + line for line in log.read_text().splitlines()[-10:]]
    assert summary[-1] == "CI failed: newest 1 passed, 1 skipped, 1 failed, 1 error; oldest crashed"
    head = "\n".join(lines[:lines.index("CI summary: 3 test(s) or tier(s) to look at")])
    assert "E   StopIteration: the last line" in head and "frame 39" in head and "frame 10" not in head


def test_a_tier_that_failed_with_no_failed_test_is_a_crash(tmp_path):
    """pytest interrupted (status 2) after writing its JUnit file: nothing in the file says why; the log does."""
    xml = write(tmp_path / "newest.xml", PASSED)
    log = tmp_path / "newest.log"
    log.write_text("...\n!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n")
    out = run("report", *tier("newest", xml, log, 2), code=1)
    assert "CRASHED [newest]: pytest exited with status 2 and its JUnit file names no failed test" in out
    assert "    !!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!" in out
    assert out.rstrip().splitlines()[-1] == "CI failed: newest 1 passed, 0 skipped, crashed (status 2)"


def test_a_green_run_ends_with_one_line_and_each_tiers_counts(tmp_path):
    newest, oldest = write(tmp_path / "n.xml", PASSED, SKIPPED), write(tmp_path / "o.xml", PASSED)
    out = run("report", *tier("newest", newest, status=0), *tier("oldest", oldest, status=0), code=0)
    assert out == "CI green: newest 1 passed, 1 skipped; oldest 1 passed, 0 skipped\n"
    out = run("report", *tier("newest", newest, status=0), "--over-budget", "1250 s of 1200 s", code=1)
    assert out == "CI failed: over the time budget (1250 s of 1200 s); newest 1 passed, 1 skipped\n"


def test_past_twenty_only_a_count(tmp_path):
    cases = [FAILED.replace("skipped\"", f"skipped{i}\"").format(body="") for i in range(23)]
    out = run("report", *tier("newest", write(tmp_path / "n.xml", *cases)), code=1)
    assert sum(line.startswith("FAILED [newest]") for line in out.splitlines()) == 20
    assert "... and 3 more (pytest's summary of each tier, above, names them)" in out
    assert out.rstrip().endswith("CI failed: newest 0 passed, 0 skipped, 23 failed")


def test_the_ids_to_rerun_are_pytests_and_none_when_many_failed(tmp_path):
    xml = write(tmp_path / "newest.xml", PASSED, FAILED.format(body=""))
    assert run("ids", str(xml)).splitlines() == ["tests/bench/test_ports.py::test_a_port_in_use_is_skipped"]
    many = write(tmp_path / "many.xml", *[FAILED.replace("skipped\"", f"skipped{i}\"").format(body="")
                                         for i in range(6)])
    assert run("ids", str(many)) == ""  # six failures: a breakage, nothing rerun
    assert run("ids", str(tmp_path / "absent.xml")) == ""
    in_class = write(tmp_path / "class.xml", FAILED.replace(PORTS, PORTS + ".TestK").format(body=""))
    assert run("ids", str(in_class)).split() == ["tests/bench/test_ports.py::TestK::test_a_port_in_use_is_skipped"]


def test_a_rerun_that_passes_is_flaky_and_one_that_fails_is_not(tmp_path):
    first = write(tmp_path / "newest.xml", FAILED.format(body=""), FAILED.replace("in_use", "in_use_too").format(body=""))
    rerun = write(tmp_path / "rerun.xml", f'<testcase classname="{PORTS}" name="test_a_port_in_use_is_skipped"/>',
                  FAILED.replace("in_use", "in_use_too").format(body=""))
    out = run("report", *tier("newest", first), "--rerun", f"newest={rerun}", code=1)
    assert ("FLAKY [newest] tests/bench/test_ports.py::test_a_port_in_use_is_skipped: StopIteration: the first line "
            "(passed on its rerun alone)") in out
    assert "FAILED [newest] tests/bench/test_ports.py::test_a_port_in_use_too_is_skipped: StopIteration: the first " \
           "line (failed again on its rerun alone)" in out
    assert out.rstrip().endswith("CI failed: newest 1 passed, 0 skipped, 1 failed, 1 flaky")
    only_flaky = write(tmp_path / "flaky.xml", FAILED.format(body=""))
    out = run("report", *tier("newest", only_flaky), "--rerun", f"newest={rerun}", code=0)
    assert out.rstrip().endswith("CI green: newest 1 passed, 0 skipped, 1 flaky")


HUNG_TEST = """
import threading

def blocked_in_the_test():
    threading.Event().wait(60)

def test_stuck():
    blocked_in_the_test()
"""


def test_a_test_stopped_by_pytest_timeout_is_hung_with_its_innermost_frames(tmp_path):
    (tmp_path / "test_stuck.py").write_text(HUNG_TEST)
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "1",
                    "--junitxml", str(xml), "test_stuck.py"], cwd=tmp_path, capture_output=True, timeout=120)
    out = run("report", *tier("newest", xml), code=1)
    lines = out.splitlines()
    hung = next(i for i, line in enumerate(lines) if line.startswith("HUNG [newest]"))
    assert "test_stuck.py::test_stuck: Failed: Timeout (>1.0s) from pytest-timeout." in lines[hung]
    wait = lines[hung + 1]
    assert wait.startswith("    the test: threading.py:") and "< wait (threading.py:" in wait
    assert "blocked_in_the_test (test_stuck.py:5)" in wait  # the innermost of the test's own frames


STUCK_RANK = """
import sys, threading, time
from megatron_dualpipe.launch import spawn

def a_helper_thread():
    time.sleep(60)

def stuck_in_the_main_thread():
    threading.Event().wait(60)

spawn.stacks_to(sys.argv[1])
threading.Thread(target=a_helper_thread, daemon=True).start()
print("ready", flush=True)
stuck_in_the_main_thread()
"""


def test_a_job_past_its_timeout_names_where_each_ranks_main_thread_waited(tmp_path):
    """Two 'ranks' stopped as the spawner stops a job past its timeout (SIGABRT, faulthandler into each
    rank's file), labelled as the preloaded launch's client labels them; the summary shows each rank's
    main thread, not its helper thread."""
    from megatron_dualpipe.launch import spawn

    output = tmp_path / "job.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ranks = [subprocess.Popen([sys.executable, "-c", STUCK_RANK, spawn.stacks_path(str(output), r)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    for p in ranks:
        assert p.stdout.readline() == "ready\n"
    time.sleep(0.2)
    for p in ranks:
        p.send_signal(signal.SIGABRT)
        p.wait(timeout=30)
    stacks = spawn.labelled_stacks(str(output), 2)
    text = f"AssertionError: job\n{stacks}preloaded_launch: the job ran past its 240 s timeout: every rank's stacks"
    xml = write(tmp_path / "r.xml", f'<testcase classname="tests.megatron_lm.test_x" name="test_nan">'
                f'<failure message="AssertionError: job">{_escape(text)}</failure></testcase>')
    out = run("report", *tier("newest", xml), code=1)
    lines = out.splitlines()
    hung = next(i for i, line in enumerate(lines) if line.startswith("HUNG [newest]"))
    waits = lines[hung + 1:hung + 3]
    assert [w.split(":")[0] for w in waits] == ["    rank 0", "    rank 1"]
    for w in waits:
        assert "< wait (threading.py:" in w and "stuck_in_the_main_thread (<string>:" in w and "helper" not in w
    assert not list(tmp_path.glob("job.log.stacks*"))  # the ranks' files are removed once read


def stuck_rank(rank, world, port):
    """Rank 1 waits for ever; rank 0 returns."""
    if rank == 1:
        stuck_in_the_main_thread()


def stuck_in_the_main_thread():
    threading.Event().wait(120)


def test_spawned_ranks_past_their_timeout_show_where_they_waited(tmp_path):
    """The package's spawner (bench, the selftest and the tests' workers start their ranks through it):
    past the timeout every rank still running writes its stacks, the error names the ranks without a
    result, and the summary shows where rank 1 waited."""
    from megatron_dualpipe.launch import spawn

    with pytest.raises(RuntimeError) as raised:
        spawn.run(stuck_rank, 2, timeout_s=3)
    text = str(raised.value)
    print(text[-1500:])
    assert "ranks [1] gave no result within 3 s" in text.splitlines()[-1]
    xml = write(tmp_path / "r.xml", f'<testcase classname="tests.bench.test_x" name="test_hang">'
                f'<failure message="RuntimeError">{_escape(text)}</failure></testcase>')
    out = run("report", *tier("newest", xml), code=1)
    lines = out.splitlines()
    hung = next(i for i, line in enumerate(lines) if line.startswith("HUNG [newest]"))
    assert lines[hung + 1].startswith("    rank 1: ") and "stuck_in_the_main_thread (test_ci_failures_tool.py:" \
        in lines[hung + 1], lines[hung + 1]


def _escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
