"""Ctrl-C, SIGTERM and a closed pipe stop every process a command started, in one line.

``torchrun`` starts each rank in a session of its own, so a Ctrl-C used to leave the main job's
four ranks training (re-parented to PID 1, still writing ``timeline.png`` into ``--out``) and
print a traceback per process. Each test here starts a command in its own session with a unique
environment token, sends the signal to the whole process group as a terminal does (or to the
top process only, as ``kill PID`` does) at a chosen point, then checks that the command ended
with status 130 (141 for a closed pipe) and one line, that no process carrying the token
survives, and that nothing is written afterwards.
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "MEGATRON_DUALPIPE_TEST_TOKEN"


def survivors(token: str):
    """Processes whose environment carries ``token`` (ours: the test started them)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"{TOKEN}={token}".encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def survivors_after(token: str, grace_s: float = 30.0):
    """The survivors once every process carrying ``token`` has had ``grace_s`` to exit: a rank
    that is still unwinding on a loaded machine is not one left behind (that one never exits)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = survivors(token)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def _kill_leftovers(token):
    for pid in survivors(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def interrupt_at(cmd, marker, sig=signal.SIGINT, group=True, cwd=ROOT, env=None, timeout=600, after_s=0.0,
                 until=None):
    """Run ``cmd`` (its own session); when a line containing ``marker`` shows (stdout and stderr
    merged), wait ``after_s`` (and until ``until()`` holds, when given) and send ``sig`` to its
    process group (``group``) or to it alone.
    Returns (lines before, lines after the signal, exit status, survivors after a grace)."""
    token = uuid.uuid4().hex
    full = dict(os.environ if env is None else env, **{TOKEN: token})
    full.setdefault("PYTHONPATH", ROOT)
    p = subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    before = []
    try:
        deadline = time.monotonic() + timeout
        for line in p.stdout:
            before.append(line.rstrip("\n"))
            if marker in line:
                break
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout} s"
        else:
            pytest.fail(f"the command ended before {marker!r}:\n" + "\n".join(before[-30:]))
        time.sleep(after_s)
        while until is not None and not until():
            assert time.monotonic() < deadline, f"{until.__doc__} not within {timeout} s"
            time.sleep(0.05)
        (os.killpg if group else os.kill)(p.pid, sig)
        after = [line.rstrip("\n") for line in p.stdout]
        status = p.wait(timeout=120)
        return before, after, status, survivors_after(token)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        _kill_leftovers(token)


def assert_one_line(after, status, left, prog, expected_status=130):
    print("\n--- after the signal ---\n" + "\n".join(after) + f"\n--- exit {status}, survivors {left}")
    assert left == [] and status == expected_status
    assert not any("Traceback" in line or "Error" in line for line in after)
    assert after and after[-1] == f"{prog}: interrupted" and sum("interrupted" in line for line in after) == 1
    assert len(after) <= 3  # the line itself, and at most a progress line already on its way


def snapshot(folder):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
            for d, _, files in os.walk(folder) for f in files}


# ---------------------------------------------------------------------------------------------
# The shared helper (megatron_dualpipe/launch/interrupts.py)
# ---------------------------------------------------------------------------------------------

ESCAPING = ("setsid sleep 300 & sleep 300 & "  # one child leaves the group, as torchrun's ranks do
            "python3 -c 'import time\nfor i in range(10**6): print(i, flush=True); time.sleep(0.05)'")


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)],
                         ids=["ctrl-c to the group", "SIGTERM to the pid", "SIGHUP to the pid"])
def test_helper_stops_every_descendant_even_in_another_session(sig, group):
    cmd = [sys.executable, "-m", "megatron_dualpipe.launch.interrupts", "--prog", "job", "--", "bash", "-c", ESCAPING]
    _, after, status, left = interrupt_at(cmd, "3", sig=sig, group=group, timeout=60)
    assert_one_line(after[-1:], status, left, "job")  # numbers printed before the signal arrived are fine
    assert all(line.isdigit() for line in after[:-1])


def test_helper_closed_pipe_is_silent_and_stops_everything():
    token = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=ROOT, **{TOKEN: token})
    shell = (f"{sys.executable} -m megatron_dualpipe.launch.interrupts --prog job -- bash -c \"{ESCAPING}\" 2>err.txt "
             f"| head -3; echo status ${{PIPESTATUS[0]}}")
    try:
        r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, timeout=120,
                           cwd=os.environ.get("TMPDIR", "/tmp"))
        left = survivors_after(token)
    finally:
        _kill_leftovers(token)
    print(r.stdout)
    assert r.stdout.splitlines() == ["0", "1", "2", "status 141"] and left == []


# ---------------------------------------------------------------------------------------------
# setup_venv.sh and the launch script
# ---------------------------------------------------------------------------------------------

def test_setup_venv_interrupted_during_a_step(tmp_path):
    env = dict(os.environ, VENV=str(tmp_path / "venv"))
    before, after, status, left = interrupt_at(["bash", os.path.join(ROOT, "scripts", "setup_venv.sh")],
                                               "setup 1/3", env=env, after_s=1.0, timeout=60)
    print("\n".join(before))
    assert_one_line(after, status, left, "setup_venv.sh")


FAKE_TORCHRUN = """#!/bin/bash
# Stand-in for torchrun: two "ranks" in sessions of their own (as torchrun starts them), writing.
for r in 0 1; do setsid bash -c "while true; do date >> $OUT/rank$r.txt; sleep 0.1; done" & done
echo "ranks started"
wait
"""


@pytest.mark.parametrize("sig,group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c to the group", "SIGTERM to the pid"])
def test_launch_script_stops_torchrun_and_its_ranks(tmp_path, sig, group):
    fake = tmp_path / "Megatron-LM"  # a stand-in checkout at core_v0.16.1 (the launch script only inspects it)
    (fake / "megatron" / "core").mkdir(parents=True)
    (fake / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    (fake / "pretrain_gpt.py").write_text("")
    # The preflight refuses empty files: an .idx header (magic, version 1, uint16) and a few token ids below 8.
    (tmp_path / "text_document.idx").write_bytes(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + b"\x08" + b"\x00" * 16)
    (tmp_path / "text_document.bin").write_bytes(bytes([1, 0, 2, 0, 3, 0]))
    out = tmp_path / "out"
    out.mkdir()
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(FAKE_TORCHRUN.replace("$OUT", str(out)))
    torchrun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "MASTER_ADDR", "PP", "TP", "EP")}
    env.update(MEGATRON_LM_PATH=str(fake), DATA_PATH=str(tmp_path / "text_document"), CONFIG="gpt_tiny_cpu",
               GPUS_PER_NODE="4", TORCHRUN=str(torchrun), PYTHON=sys.executable)
    script = os.path.join(ROOT, "scripts", "pretrain_gpt_dualpipe.sh")

    def both_ranks_wrote():
        """both ranks' first lines"""
        return all((out / f"rank{r}.txt").is_file() and (out / f"rank{r}.txt").stat().st_size for r in (0, 1))

    _, after, status, left = interrupt_at(["bash", script, "--tokenizer-type", "NullTokenizer", "--vocab-size", "8"],
                                          "ranks started", sig=sig, group=group, env=env, until=both_ranks_wrote,
                                          timeout=120)
    assert_one_line(after, status, left, "pretrain_gpt_dualpipe.sh")
    written = snapshot(out)
    time.sleep(1.0)
    assert snapshot(out) == written and written  # the ranks wrote before, and nothing since


# ---------------------------------------------------------------------------------------------
# The main job
# ---------------------------------------------------------------------------------------------

# a small job (2 processes, a tiny model): what is proven is how it stops, not what it trains
DEMO = [sys.executable, "-m", "megatron_dualpipe.apps.main_job", "--iters", "3", "--no-compare", "--eval-iters", "0",
        "--nproc", "2", "--num-layers", "2", "--hidden-size", "16", "--seq-length", "16", "--microbatches", "4",
        "--micro-batch-size", "1"]
PROG = "python -m megatron_dualpipe.apps.main_job"


@pytest.mark.parametrize("point,marker,cache", [
    ("setup: preparing the data", "prepare-data: ", "fresh"),
    ("training", "[dualpipe] iteration     1/", "shared"),
    ("drawing the measured timeline", "measured timeline: the fastest", "shared"),
], ids=["setup", "training", "drawing"])
def test_main_job_interrupted_stops_every_rank_in_one_line(tmp_path, point, marker, cache):
    out = tmp_path / "out"
    cache_dir = tmp_path / "cache" if cache == "fresh" else None
    env = dict(os.environ)
    env.pop("MEGATRON_DUALPIPE_PROG", None)
    argv = DEMO + ["--out", str(out)] + (["--cache-dir", str(cache_dir)] if cache_dir else [])
    before, after, status, left = interrupt_at(argv, marker, env=env, cwd=str(tmp_path))
    print(f"\n{point}: interrupted after {before[-1]!r}")
    assert_one_line(after, status, left, PROG)
    written = snapshot(out) if out.exists() else {}
    time.sleep(2.0)
    assert (snapshot(out) if out.exists() else {}) == written  # nothing written afterwards
    if cache_dir is not None and (cache_dir / "data").exists():  # no half-written cache entry
        for entry in (cache_dir / "data").iterdir():
            assert entry.name.startswith(".") or (entry / "manifest.json").is_file(), entry


def test_main_job_into_head_closes_cleanly(tmp_path):
    """`run_main.sh --iters 3 --no-compare | head -3`: three lines, status 141, no traceback, no rank left.
    The third line comes from the last rank once every rank has joined the process group, so the pipe
    closes while the ranks run; two of them (NPROC, as run_main.sh documents) prove it as four would."""
    token = uuid.uuid4().hex
    # run_main.sh takes MASTER_PORT as --master-port; in-process tests of this pytest worker set it
    # for their own gloo groups (and their port may be taken again by now): a user's shell has none
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env[TOKEN] = token
    env["NPROC"] = "2"
    shell = (f"bash {ROOT}/scripts/run_main.sh --iters 3 --no-compare --eval-iters 0 --num-layers 2 --hidden-size 16 "
             f"--seq-length 16 --microbatches 4 --micro-batch-size 1 --out out 2>err.txt | head -3; "
             f"echo status ${{PIPESTATUS[0]}}")
    try:
        r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        left = survivors_after(token)
    finally:
        _kill_leftovers(token)
    err = (tmp_path / "err.txt").read_text()
    print(f"\n{r.stdout}--- stderr ---\n{err}")
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "status 141" and left == []
    assert "Traceback" not in err and "Error" not in err
    assert "starting 2 processes" in lines[0]  # NPROC reached the job
    assert (tmp_path / "out" / "dualpipe_pp2_m4.png").is_file()  # --out relative to the caller's directory
