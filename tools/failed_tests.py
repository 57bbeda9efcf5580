"""Name the failed tests of CI's tiers, last, and the ones CI reruns once.

CI's record keeps only the end of the log, and pytest's own summary of failures comes before the
slowest durations and the equality matrix: twice a landing failed with no test named on record.
``.ci/run`` calls ``report`` after the budget line with each tier's JUnit file. A tier with a few
failures reruns them once, alone (``ids`` gives their pytest node ids): one that passes then is
reported here as flaky, by name and with its first traceback, and does not fail CI; one that fails
again does.

    python tools/failed_tests.py ids RESULTS.xml
    python tools/failed_tests.py report NAME=RESULTS.xml [NAME=RESULTS.xml ...] [--rerun NAME=RERUN.xml ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET

LINES_PER_FAILURE = 14
FAILURES_IN_FULL = 4
#: More failures than this in a tier is a breakage, not a flake: nothing is rerun.
MOST_RERUN = 5


def failures(path: str):
    """(classname, name, kind, message, text) for each failed or erroring test case of one JUnit file."""
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                yield case.get("classname", ""), case.get("name", ""), kind, found.get("message", ""), found.text or ""


def node_id(classname: str, name: str, root: str = ".") -> str:
    """pytest's node id of a JUnit test case: the module's file, then any classes, then the name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if os.path.isfile(os.path.join(root, path)):
            return "::".join([path, *parts[cut:], name])
    return f"{'/'.join(parts)}.py::{name}"


def ids(path: str) -> list[str]:
    """The node ids to rerun: none where the file is unreadable or the failures are many."""
    try:
        found = [node_id(c, n) for c, n, *_ in failures(path)]
    except (OSError, ET.ParseError):
        return []
    return sorted(set(found)) if len(found) <= MOST_RERUN else []


def _passed_on_rerun(path: str | None) -> set[str] | None:
    if path is None:
        return None
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return set()
    return {node_id(c.get("classname", ""), c.get("name", "")) for c in root.iter("testcase")
            if not any(c.find(k) is not None for k in ("failure", "error", "skipped"))}


def report(tier: str, path: str, rerun: str | None, shown: int) -> tuple[int, int, int]:
    """Print one tier's failures; the first ones with the end of their traceback.
    (failed for good, flaky, tracebacks shown so far)."""
    try:
        found = list(failures(path))
    except (OSError, ET.ParseError) as e:
        print(f"CI failures [{tier}]: no readable JUnit file ({e}): see pytest's summary above")
        return 1, 0, shown
    passed = _passed_on_rerun(rerun)
    failed = flaky = 0
    for classname, name, kind, message, text in found:
        test = node_id(classname, name)
        if passed is not None and test in passed:
            flaky += 1
            outcome = "passed on its rerun: FLAKY"
        else:
            failed += 1
            outcome = "failed again on its rerun" if passed is not None else "not rerun"
        first = message.splitlines()[0][:200] if message else ""
        print(f"CI failures [{tier}]: {kind.upper()} {test} ({outcome}): {first}")
        if shown < FAILURES_IN_FULL:
            shown += 1
            for line in text.rstrip().splitlines()[-LINES_PER_FAILURE:]:
                print(f"    {line[:200]}")
    return failed, flaky, shown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ids", help="node ids of a JUnit file's failures, to rerun").add_argument("xml")
    rep = sub.add_parser("report", help="each tier's failures, and how their rerun went")
    rep.add_argument("tiers", nargs="+", metavar="NAME=RESULTS.xml")
    rep.add_argument("--rerun", action="append", default=[], metavar="NAME=RERUN.xml")
    args = p.parse_args(argv)
    if args.command == "ids":
        for test in ids(args.xml):
            print(test)
        return 0
    reruns = dict(arg.partition("=")[::2] for arg in args.rerun)
    failed = flaky = shown = 0
    for arg in args.tiers:
        tier, _, path = arg.partition("=")
        more_failed, more_flaky, shown = report(tier, path, reruns.get(tier), shown)
        failed, flaky = failed + more_failed, flaky + more_flaky
    print(f"CI failures: {failed} failed, {flaky} flaky (failed, then passed on its rerun) "
          f"in {len(args.tiers)} tier(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
