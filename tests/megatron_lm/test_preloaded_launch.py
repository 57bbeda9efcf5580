"""The tests' torchrun stand-in (tests/harness/preloaded_launch.py: ranks forked from a process with
torch and Megatron-LM imported) runs pretrain_gpt.py as torchrun does: the same printed metrics at
every iteration, and a failing job fails with torchrun's exit code."""
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


def test_a_refused_run_fails_as_under_torchrun(monkeypatch):
    outs = _both(monkeypatch, "--train-iters", "3", "--mtp-num-layers", "1", "--context-parallel-size", "3")
    for launcher, (rc, out) in outs.items():
        print(f"{launcher}: exit code {rc}; last line: {out.strip().splitlines()[-1][:200]}")
        assert rc == 1, (launcher, out[-3000:])
