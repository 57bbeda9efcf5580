"""tools/failed_tests.py: CI's last lines name each failed test, with the end of its traceback, and
say which failed again on their rerun (CI fails) and which passed then (flaky, CI goes on)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "failed_tests.py"

PORTS = "tests.bench.test_ports"
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>"""
PASSED = f'<testcase classname="{PORTS}" name="test_ok" time="0.1"/>'
FAILED = f"""<testcase classname="{PORTS}" name="test_a_port_in_use_is_skipped" time="0.2">
<failure message="StopIteration">line one
{{body}}
E   StopIteration: the last line</failure></testcase>"""
ERROR = '<testcase classname="tests.cli.test_x.TestY" name="test_setup[a b]" time="0.1"><error message="broke">boom</error></testcase>'


def run(*args):
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, check=True, cwd=ROOT)
    print(done.stdout)
    return done.stdout


def write(path, *cases):
    path.write_text(JUNIT.format(cases="".join(cases)))
    return path


def test_failures_and_errors_are_named_with_the_end_of_the_traceback(tmp_path):
    xml = write(tmp_path / "newest.xml", PASSED, FAILED.format(body="\n".join(f"frame {i}" for i in range(40))), ERROR)
    clean = write(tmp_path / "oldest.xml", PASSED)
    out = run("report", f"newest={xml}", f"oldest={clean}")
    assert ("CI failures [newest]: FAILURE tests/bench/test_ports.py::test_a_port_in_use_is_skipped (not rerun): "
            "StopIteration") in out
    assert "CI failures [newest]: ERROR tests/cli/test_x/TestY.py::test_setup[a b] (not rerun): broke" in out
    assert "E   StopIteration: the last line" in out and "frame 39" in out
    assert "frame 10" not in out  # only the end of a long traceback
    assert "test_ok" not in out and "[oldest]" not in out
    assert out.rstrip().endswith("CI failures: 2 failed, 0 flaky (failed, then passed on its rerun) in 2 tier(s)")


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
    out = run("report", f"newest={first}", "--rerun", f"newest={rerun}")
    assert "test_a_port_in_use_is_skipped (passed on its rerun: FLAKY): StopIteration" in out
    assert "test_a_port_in_use_too_is_skipped (failed again on its rerun): StopIteration" in out
    assert out.rstrip().endswith("CI failures: 1 failed, 1 flaky (failed, then passed on its rerun) in 1 tier(s)")


def test_a_missing_results_file_is_counted_not_hidden(tmp_path):
    out = run("report", f"newest={tmp_path / 'absent.xml'}")
    assert "CI failures [newest]: no readable JUnit file" in out
    assert out.rstrip().endswith("CI failures: 1 failed, 0 flaky (failed, then passed on its rerun) in 1 tier(s)")
