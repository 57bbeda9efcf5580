"""Progress on stderr: nothing for quick work, the phase and its fraction for slow work, steps at once."""
import io
import time

from megatron_dualpipe.apps import progress
from megatron_dualpipe.apps.progress import Progress


def test_quick_work_prints_nothing(monkeypatch):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 60.0)
    out = io.StringIO()
    with Progress("simulate x", stream=out) as p:
        p.phase("simulating")
        p.update(1, 2)
    assert out.getvalue() == ""


def test_slow_work_shows_phase_and_fraction(monkeypatch):
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    out = io.StringIO()
    with Progress("simulate x", stream=out, interval=0.01) as p:
        p.phase("simulating")
        p.update(3, 4)
        for _ in range(500):  # wait for the reporter thread (no timing asserted)
            if "75%" in out.getvalue():
                break
            time.sleep(0.01)
    print(f"\n{out.getvalue().splitlines()[-1]}")
    assert "simulate x: simulating 75%" in out.getvalue()
    assert all(line.startswith("simulate x: ") for line in out.getvalue().splitlines())


def test_a_said_step_is_one_line_at_once_and_ends_the_phase(monkeypatch):
    """prepare-data's steps (the one reporter's ``say``): printed at once, quick work or not; the
    phase they end is not reported again."""
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    out = io.StringIO()
    with Progress("prepare-data", stream=out, interval=0.01) as p:
        p.phase("tokenizing documents")
        p.update(1, 2)
        p.say("tokenized 2 documents")
        before = out.getvalue()
        time.sleep(0.1)
    assert "prepare-data: tokenized 2 documents\n" in before
    assert out.getvalue().endswith("prepare-data: tokenized 2 documents\n")
