"""A user's mistake never shows a traceback: every subcommand, given bad input, ends with one line
on stderr and a non-zero status; so do Ctrl-C, a closed pipe, overflowing costs, absurd sizes and
files that cannot be written. The launcher and the launch script refuse in one line too.

Every registered subcommand is covered (also those added later): each gets an unknown flag, in
process and through ``python -m megatron_dualpipe``; the known ones get a table of bad inputs.
"""
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from megatron_dualpipe.cli import COMMANDS, main

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
SIM = ["simulate", "--schedule", "dualpipe", "--pp", "4", "-m", "8"]
ADV = ["advise", "--pp", "4", "-m", "8", "--f", "1", "--b", "2", "--w", "1", "--activation-memory", "1",
       "--parameter-memory", "1"]

BAD = [
    (SIM + ["--f", "1e308", "--b", "1e308"], "too large"),
    (SIM + ["--fb", "inf"], "finite"),
    (SIM + ["--png", ""], "--png needs a file name"),
    (SIM + ["--svg", " "], "--svg needs a file name"),
    (SIM + ["--png", "/proc/version/x.png"], "cannot write"),
    (["simulate", "--schedule", "dualpipe", "--pp", "64", "-m", "1030"], "more than the limit of 65536"),
    (["schedule", "--schedule", "dualpipe", "--pp", "8", "-m", "2000000"], "use --microbatches 8192 or fewer"),
    (["schedule", "--schedule", "1f1b", "--pp", "100000", "-m", "1"], "with a smaller --pp"),
    (["schedule", "--schedule", "dualpipe", "--pp", "-4", "-m", "8"], "positive"),
    (["schedule", "--schedule", "dualpipe", "--pp", "4", "-m", "99999999999999999999999"], "more than the limit"),
    (["schedule", "--schedule", "dualpipe", "--pp", "1e3", "-m", "8"], "invalid int value"),
    (ADV[:4] + ["8:4"] + ADV[5:], "--microbatches"),
    (ADV[:4] + ["x"] + ADV[5:], "--microbatches"),
    (ADV[:4] + ["1:1000000:1"] + ADV[5:], "more than 16"),
    (ADV[:4] + ["100000"] + ADV[5:], "more than the limit"),
    (ADV + ["--activation-memory", "-1"], "activation memory"),
    (ADV + ["--memory-limit", "nan"], "memory limit"),
    (ADV + ["--schedules", "gpipe"], "unknown schedule"),
    (ADV + ["--f", "1e308", "--b", "1e308", "--w", "0"], "too large"),
    (ADV[:2] + ["0"] + ADV[3:], "--pp"),
    (["advise", "--pp", "4", "-m", "8"], "required"),
    (["bench", "--f", "1e308", "--b", "1e308"], "at most 60000"),
    (["bench", "--f", "1" * 200, "--b", "1" * 200], "at most 60000"),
    (["bench", "--fb", "0.5"], "--fb 0.5 is cheaper than --f 20 alone"),
    (["bench", "--pp", "64"], "--pp 64 starts 64 processes on this machine"),
    (SIM + ["--fb", "0.5"], "--fb must be at least 1"),
    (SIM + ["--png", "x.jpg"], "name it x.png"),
    (["trace", "/no/such/dir", "--png", "t.jpeg"], "name it t.png"),
    (["trace", "/no/such/dir"], "no rank*.jsonl files"),
    (["patch", "/no/such/checkout"], "no pretrain_gpt.py"),
    (["patch", "/etc/hostname"], "no pretrain_gpt.py"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD])
def test_bad_input_is_one_line(capsys, argv, needle):
    code = main(argv)
    out, err = capsys.readouterr()
    print(f"\n{' '.join(argv)}\n  -> {code}: {err.strip()}")
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("megatron-dualpipe: error: ") and "Traceback" not in err
    assert needle in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_refuses_an_unknown_flag_in_one_line(capsys, command):
    assert main([command, "--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("megatron-dualpipe: error: ")
    assert "unrecognized arguments: --no-such-flag" in err or "the following arguments are required" in err


def _python_m(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "megatron_dualpipe", *argv], capture_output=True, text=True,
                          env=ENV, timeout=120, **kw)


def test_every_subcommand_through_python_m(tmp_path):
    for command in sorted(COMMANDS):
        p = _python_m(command, "--no-such-flag", cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, (command, p.stderr)
    p = _python_m("--version")
    assert p.returncode == 0 and p.stdout.startswith("megatron-dualpipe ")
    from megatron_dualpipe import __version__

    assert p.stdout.split() == ["megatron-dualpipe", __version__]


def test_a_closed_pipe_is_quiet(tmp_path):
    """``schedule ... | head -1``: the reader leaves early; no BrokenPipeError traceback."""
    err = tmp_path / "err.txt"
    cmd = (f"set -o pipefail; {sys.executable} -m megatron_dualpipe schedule --schedule dualpipe --pp 16 -m 1024 "
           f"2>{err} | head -1; echo status ${{PIPESTATUS[0]}}")
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=ENV, timeout=120)
    print(f"\n{p.stdout.strip()}")
    assert p.stdout.startswith("dualpipe: pp=16 M=1024")
    lines = err.read_text().splitlines()  # progress lines only, if the machine was slow
    assert all(line.startswith("schedule dualpipe pp=16 M=1024: ") for line in lines), lines
    assert not any("Error" in line or "Traceback" in line for line in lines)
    assert p.stdout.strip().endswith("status 141")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_is_one_line(sig):
    """SIGINT (or SIGTERM) during a long simulation (sent once its progress line shows it is inside the command)."""
    p = subprocess.Popen([sys.executable, "-m", "megatron_dualpipe", "simulate", "--schedule", "zb-h1", "--pp", "64",
                          "-m", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        first = p.stderr.readline()
        if not first:
            pytest.skip("the simulation ended within a second: nothing to interrupt")
        assert "simulate zb-h1 pp=64 M=1024" in first, first
        p.send_signal(getattr(signal, sig))
        out, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    print(f"\n{first.strip()}\n{rest.strip()}")
    assert p.returncode == 130 and out == ""
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "megatron-dualpipe: interrupted"


def _launch(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_dualpipe.launch", *argv], capture_output=True,
                          text=True, env=ENV, timeout=120)


def test_launcher_refuses_in_one_line(tmp_path):
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 15\nPATCH = 0\n")
    (root / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    for argv, needle in ((["/no/such/pretrain_gpt.py"], "no such script"),
                         ([str(root / "pretrain_gpt.py"), "--help"], "is not a supported Megatron-LM checkout"),
                         (["--check", str(root / "pretrain_gpt.py")], "found megatron-core 0.15.0")):
        p = _launch(*argv)
        print(f"\n{argv}: {p.stderr.strip()}")
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr and "Traceback" not in p.stderr
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    p = _launch("--check", str(root / "pretrain_gpt.py"))
    assert p.returncode == 0 and "can run" in p.stdout, p.stderr


def test_preflight_names_missing_packages_and_the_pip_command(monkeypatch):
    from megatron_dualpipe.megatron_lm import requirements

    assert requirements.problem() is None  # the test environment has the megatron-lm extra
    monkeypatch.setattr(requirements, "PACKAGES", dict(requirements.PACKAGES, no_such_module_xyz="no-such-pkg"))
    msg = requirements.problem()
    print(f"\n{msg}")
    assert "needs no-such-pkg" in msg and f"{sys.executable} -m pip install no-such-pkg" in msg
    assert ".[megatron-lm]" in msg


def test_the_install_extra_is_the_preflight_list():
    import runpy

    from megatron_dualpipe.megatron_lm import requirements

    text = (ROOT / "setup.py").read_text()
    assert "megatron_dualpipe/megatron_lm/requirements.py" in text
    ns = runpy.run_path(str(ROOT / "megatron_dualpipe" / "megatron_lm" / "requirements.py"))
    assert ns["PACKAGES"] == requirements.PACKAGES and ns["EXTRA"] == "megatron-lm"
