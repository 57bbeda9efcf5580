"""The tests' torchrun stand-in (tests/harness/preloaded_launch.py: ranks forked from a process with
torch and Megatron-LM imported) runs pretrain_gpt.py as torchrun does: the same printed metrics at
every iteration, a failing job fails with torchrun's exit code, and a rank can leave through the
interpreter's whole exit."""
import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, SKIP_MESSAGE, TORCHRUN_ENV, assert_metrics_close, launch, metrics

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)


def _both(monkeypatch, *args):
    outs = {}
    for launcher in ("1", "0"):
        monkeypatch.setenv(TORCHRUN_ENV, launcher)
        outs["torchrun" if launcher == "1" else "preloaded"] = launch("dualpipe", *args)
    return outs


def test_preloaded_ranks_print_what_torchruns_print(monkeypatch):
    outs = _both(monkeypatch, "--train-iters", "3")
    assert [rc for rc, _ in outs.values()] == [0, 0], outs["preloaded"][1][-3000:]
    got, want = metrics(outs["preloaded"][1]), metrics(outs["torchrun"][1])
    worst = assert_metrics_close(got, want, "dualpipe: preloaded ranks vs torchrun", slack={"num zeros": 0.0})
    assert "lm loss" in worst and all(v == 0.0 for v in worst.values()), worst


def test_a_refused_run_fails_with_torchruns_exit_code_and_one_line(monkeypatch):
    """A job whose ranks exit 2 (Megatron-LM refuses the arguments inside them) ends with torchrun's
    exit code for a failed worker, 1, and the refusal printed once (rank 0)."""
    monkeypatch.setenv(TORCHRUN_ENV, "0")
    rc, out = launch("dualpipe", "--train-iters", "3", "--context-parallel-size", "3")
    # (the four ranks print at once: another rank's text can precede the line on its row)
    refusals = [line[line.index("megatron_dualpipe.launch: error:"):] for line in out.splitlines()
                if "megatron_dualpipe.launch: error:" in line]
    print(f"preloaded: exit code {rc}; {refusals}")
    assert rc == 1 and len(refusals) == 1 and "divisible" in refusals[0], out[-3000:]


def test_the_interpreters_whole_exit_when_asked(monkeypatch):
    """fast_exit=False: every rank leaves through the interpreter's own exit (its module teardown:
    what a hang there would show), with the same metrics as the fast exit's run."""
    monkeypatch.setenv(TORCHRUN_ENV, "0")
    fast = metrics(launch("dualpipe", "--train-iters", "2")[1])
    rc, out = launch("dualpipe", "--train-iters", "2", fast_exit=False)
    assert rc == 0, out[-3000:]
    assert_metrics_close(metrics(out), fast, "dualpipe: whole exit vs fast exit", slack={"num zeros": 0.0})


def test_rank_0_hosting_the_store_ends_with_the_whole_exit(monkeypatch):
    """Launched without torchrun's agent (srun and the like: rank 0 hosts the TCPStore), every rank
    still ends cleanly through the interpreter's whole exit although rank 0, and its store, may be
    gone while the others tear down: no thread of the plugin may be left waiting on the store then."""
    monkeypatch.setenv(TORCHRUN_ENV, "0")
    rc, out = launch("dualpipe", "--train-iters", "2", fast_exit=False,
                     env_extra={"MEGATRON_DUALPIPE_TEST_RANK0_STORE": "1"})
    print(f"rank 0 hosting the store, whole exit: exit code {rc}")
    assert rc == 0 and "terminate called" not in out, out[-4000:]
