"""The end of CI's log: what failed, in which tier, and why, read from the tiers' JUnit files.

CI's record keeps only the last lines of the log, and pytest's own summary of failures scrolls away
behind the slowest durations, the equality matrix and the next tier: a landing failed after 690 s
with no test named on record (issue 39). ``.ci/run`` calls ``report`` last, after the budget line,
with each tier's JUnit file, its log and pytest's exit status. It prints the end of the first
tracebacks, then one line per failed test::

    FAILED [newest] tests/x.py::test_y: AssertionError: first line of the error
    ERROR [oldest] tests/x.py::test_z: first line of the error
    HUNG [newest] tests/x.py::test_w: Failed: Timeout (>600.0s) from pytest-timeout.
        rank 0: wait (p2p.py:88) < receive (p2p.py:120) < run (runner.py:51)
    FLAKY [newest] tests/x.py::test_v: first line (failed, then passed on its rerun alone)
    CRASHED [oldest]: pytest exited with status 2 and its JUnit file names no failed test; its last lines:

at most :data:`MOST_LINES` of them, then a count; and last, one line with each tier's counts, which
says ``CI green`` when nothing failed. A tier with a few failures reruns them once, alone (``ids``
gives their pytest node ids): one that passes then is flaky and does not fail CI; one that fails
again does.

    python tools/failed_tests.py ids RESULTS.xml
    python tools/failed_tests.py report --tier NAME RESULTS.xml LOG STATUS [--tier ...]
                                        [--rerun NAME=RERUN.xml ...] [--over-budget TEXT]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import List, Optional

#: The end of a traceback shown for the first failures (before the summary lines).
LINES_PER_FAILURE = 14
FAILURES_IN_FULL = 4
#: Summary lines (one per failed test) before the rest is only counted.
MOST_LINES = 20
#: The last lines of a tier's log shown when it crashed (no JUnit file, or no failure in it).
CRASH_LINES = 10
#: Frames shown per rank of a hung test: the innermost ones, where it waited.
FRAMES = 3
#: More failures than this in a tier is a breakage, not a flake: nothing is rerun.
MOST_RERUN = 5

#: What a test stopped by a timeout says: pytest-timeout's failure, the preloaded launch's job
#: (tests/harness/preloaded_client.py), subprocess.TimeoutExpired (a torchrun past its timeout), launch.spawn.run's.
HANG_RE = re.compile(r"Timeout \(>[\d.]+s\) from pytest-timeout|ran past its [\d.]+ s timeout|"
                     r"TimeoutExpired|timed out after [\d.]+ seconds|gave no result within [\d.]+ s")
#: A rank's labelled stack line, as the preloaded launch and the selftest's watchdog print them
#: (faulthandler's dump, each line prefixed with the rank), anywhere in a line.
RANK_LINE_RE = re.compile(r"\[rank (\d+)\] (.*)$")
THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
MAIN_RE = re.compile(r"^main thread (0x[0-9a-f]+)")
FRAME_RE = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
#: pytest's frame locations in a long traceback: "path.py:12: in func", and the innermost "path.py:12: Error".
PYTEST_FRAME_RE = re.compile(r"^(\S+\.py):(\d+): (?:in (\S+)|\w+)?\s*$")


@dataclass
class Failure:
    test: str
    kind: str      # "failure" or "error"
    message: str
    text: str

    @property
    def first_line(self) -> str:
        lines = [line.strip() for line in (self.message or self.text).splitlines() if line.strip()]
        return lines[0][:200] if lines else "(no message)"

    @property
    def hung(self) -> bool:
        return bool(HANG_RE.search(self.message) or HANG_RE.search(self.text))


@dataclass
class Tier:
    name: str
    status: int
    log: Optional[str]
    failures: List[Failure] = field(default_factory=list)
    counts: dict = field(default_factory=dict)   # passed / skipped / failed / errors
    unreadable: Optional[str] = None             # why its JUnit file could not be read


def node_id(classname: str, name: str, root: str = ".") -> str:
    """pytest's node id of a JUnit test case: the module's file, then any classes, then the name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if os.path.isfile(os.path.join(root, path)):
            return "::".join([path, *parts[cut:], name])
    return f"{'/'.join(parts)}.py::{name}"


def _cases(path: str):
    return ET.parse(path).getroot().iter("testcase")


def read(path: str):
    """(failures, counts) of one JUnit file; raises OSError or ParseError when it cannot be read."""
    failures, counts = [], dict(passed=0, skipped=0, failed=0, errors=0)
    for case in _cases(path):
        test = node_id(case.get("classname", ""), case.get("name", ""))
        found = [(k, case.find(k)) for k in ("failure", "error") if case.find(k) is not None]
        for kind, element in found:
            failures.append(Failure(test, kind, element.get("message", ""), element.text or ""))
            counts["failed" if kind == "failure" else "errors"] += 1
        if not found:
            counts["skipped" if case.find("skipped") is not None else "passed"] += 1
    return failures, counts


def ids(path: str) -> List[str]:
    """The node ids to rerun: none where the file is unreadable or the failures are many."""
    try:
        found = sorted({f.test for f in read(path)[0]})
    except (OSError, ET.ParseError):
        return []
    return found if len(found) <= MOST_RERUN else []


def passed_on_rerun(path: Optional[str]) -> Optional[set]:
    """The tests that passed when rerun alone (None: no rerun; empty: the rerun left nothing readable)."""
    if path is None:
        return None
    try:
        return {node_id(c.get("classname", ""), c.get("name", "")) for c in _cases(path)
                if not any(c.find(k) is not None for k in ("failure", "error", "skipped"))}
    except (OSError, ET.ParseError):
        return set()


def _short(path: str) -> str:
    return os.path.basename(path)


def rank_waits(text: str) -> List[str]:
    """'rank R: innermost < ... ' for each rank whose labelled stacks ``text`` holds: the frames of its
    main thread (named by a 'main thread 0x...' line; else faulthandler's current thread)."""
    threads: dict = {}   # rank -> {thread id: [frames]}
    main: dict = {}
    current: dict = {}   # rank -> the thread whose frames follow
    for line in text.splitlines():
        m = RANK_LINE_RE.search(line)
        if not m:
            continue
        rank, rest = int(m.group(1)), m.group(2).strip()
        if MAIN_RE.match(rest):
            main[rank] = MAIN_RE.match(rest).group(1)
        elif THREAD_RE.match(rest):
            current[rank] = THREAD_RE.match(rest).group(1)
            threads.setdefault(rank, {})[current[rank]] = []
            if rest.startswith("Current thread"):
                main.setdefault(rank, current[rank])
        elif FRAME_RE.match(rest) and rank in current:
            path, line_no, func = FRAME_RE.match(rest).groups()
            threads[rank][current[rank]].append(f"{func} ({_short(path)}:{line_no})")
    waits = []
    for rank in sorted(threads):
        frames = threads[rank].get(main.get(rank, ""), [])
        if frames:
            waits.append(f"rank {rank}: " + " < ".join(frames[:FRAMES]))
    return waits


def pytest_wait(text: str) -> Optional[str]:
    """The innermost frames of pytest's own traceback (an in-process test stopped by pytest-timeout)."""
    frames = []
    for line in text.splitlines():
        m = PYTEST_FRAME_RE.match(line)
        if m:
            path, line_no, func = m.groups()
            frames.append(f"{func} ({_short(path)}:{line_no})" if func else f"{_short(path)}:{line_no}")
    return "the test: " + " < ".join(frames[::-1][:FRAMES]) if frames else None


def wait_lines(failure: Failure) -> List[str]:
    """Where a hung test waited: each rank's main thread, else the test's own frames."""
    return rank_waits(failure.text) or [w for w in [pytest_wait(failure.text)] if w]


def load(name: str, path: str, log: Optional[str], status: int) -> Tier:
    tier = Tier(name, status, log)
    try:
        tier.failures, tier.counts = read(path)
    except (OSError, ET.ParseError) as e:
        tier.unreadable = f"{type(e).__name__}: {e}"
    return tier


def crashed(tier: Tier) -> Optional[str]:
    """Why the tier counts as crashed: pytest failed without naming a failed test (or wrote nothing)."""
    if tier.unreadable is not None:
        return f"pytest exited with status {tier.status} and left no readable JUnit file ({tier.unreadable})"
    if tier.status != 0 and not tier.failures:
        return f"pytest exited with status {tier.status} and its JUnit file names no failed test"
    return None


def last_lines(log: Optional[str], count: int = CRASH_LINES) -> List[str]:
    if not log:
        return ["(no log kept)"]
    try:
        with open(log, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError as e:
        return [f"(its log cannot be read: {e})"]
    return [line[:300] for line in lines[-count:]] or ["(its log is empty)"]


def _outcome(failure: Failure, passed: Optional[set]) -> str:
    if passed is None:
        return ""
    return " (passed on its rerun alone)" if failure.test in passed else " (failed again on its rerun alone)"


def entries(tier: Tier, passed: Optional[set]) -> List[List[str]]:
    """The tier's summary entries: a headline each, then any indented lines (a hang's waits, a crash's log)."""
    found = []
    for f in tier.failures:
        flaky = passed is not None and f.test in passed
        word = "FLAKY" if flaky else "HUNG" if f.hung else "FAILED" if f.kind == "failure" else "ERROR"
        head = f"{word} [{tier.name}] {f.test}: {f.first_line}{_outcome(f, passed)}"
        found.append([head] + [f"    {w}" for w in (wait_lines(f) if f.hung else [])])
    why = crashed(tier)
    if why:
        found.append([f"CRASHED [{tier.name}]: {why}; its last lines:"]
                     + [f"    {line}" for line in last_lines(tier.log)])
    return found


def tracebacks(tiers: List[Tier]) -> None:
    """The end of the first failures' tracebacks, before the summary lines."""
    shown = 0
    for tier in tiers:
        for f in tier.failures:
            if shown == FAILURES_IN_FULL:
                return
            shown += 1
            print(f"--- [{tier.name}] {f.test}: the end of its {'traceback' if f.kind == 'failure' else 'error'}")
            for line in f.text.rstrip().splitlines()[-LINES_PER_FAILURE:]:
                print(f"    {line[:200]}")


def verdict(tiers: List[Tier], reruns: dict, over_budget: Optional[str]) -> str:
    """The last line: each tier's counts, and green only if nothing failed for good."""
    parts, bad = [], over_budget is not None
    for tier in tiers:
        passed = passed_on_rerun(reruns.get(tier.name))
        kinds = {"failed": 0, "error": 0, "hung": 0, "flaky": 0}
        for f in tier.failures:
            kinds["flaky" if passed is not None and f.test in passed else
                  "hung" if f.hung else "failed" if f.kind == "failure" else "error"] += 1
        c = tier.counts
        words = [f"{c.get('passed', 0) + kinds['flaky']} passed", f"{c.get('skipped', 0)} skipped"]
        words += [f"{n} {kind}" for kind, n in kinds.items() if n]
        words += [f"crashed (status {tier.status})"] if crashed(tier) else []
        bad = bad or len(tier.failures) > kinds["flaky"] or crashed(tier) is not None
        parts.append(f"{tier.name} " + ", ".join(words) if tier.unreadable is None else f"{tier.name} crashed")
    counts = "; ".join(parts)
    if over_budget:
        return f"CI failed: over the time budget ({over_budget}); {counts}"
    return f"CI {'failed' if bad else 'green'}: {counts}"


def report(tiers: List[Tier], reruns: dict, over_budget: Optional[str] = None) -> bool:
    """Print the tracebacks, the summary lines and the verdict; True when CI is green."""
    tracebacks(tiers)
    found = [e for tier in tiers for e in entries(tier, passed_on_rerun(reruns.get(tier.name)))]
    if found:
        print(f"CI summary: {len(found)} test(s) or tier(s) to look at")
    for entry in found[:MOST_LINES]:
        print("\n".join(entry))
    if len(found) > MOST_LINES:
        print(f"... and {len(found) - MOST_LINES} more (pytest's summary of each tier, above, names them)")
    last = verdict(tiers, reruns, over_budget)
    print(last)
    return last.startswith("CI green")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ids", help="node ids of a JUnit file's failures, to rerun").add_argument("xml")
    rep = sub.add_parser("report", help="each tier's failures, hangs and crashes, and the verdict, last")
    rep.add_argument("--tier", nargs=4, action="append", required=True, metavar=("NAME", "RESULTS", "LOG", "STATUS"))
    rep.add_argument("--rerun", action="append", default=[], metavar="NAME=RERUN.xml")
    rep.add_argument("--over-budget", default=None, metavar="TEXT")
    args = p.parse_args(argv)
    if args.command == "ids":
        for test in ids(args.xml):
            print(test)
        return 0
    reruns = dict(arg.partition("=")[::2] for arg in args.rerun)
    tiers = [load(name, path, log or None, int(status)) for name, path, log, status in args.tier]
    return 0 if report(tiers, reruns, args.over_budget) else 1


if __name__ == "__main__":
    sys.exit(main())
