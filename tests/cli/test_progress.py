"""Progress on stderr: nothing for quick work, the phase and its fraction for slow work."""
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
