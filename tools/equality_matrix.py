"""Print the pretrain_gpt.py equality matrix of a test run: per test case, the largest difference
each comparison printed against Megatron's own 1F1B.

The equality tests print one ``<what>: max |difference| <x>`` line per comparison (see
``tests/megatron_lm_runs.py``); under pytest-xdist that output only survives in a JUnit XML file
written with ``-o junit_logging=system-out``. ``.ci/run`` passes both and calls this after each
tier, so that CI's log carries the matrix of each Megatron-LM tag, not only "passed".

    python tools/equality_matrix.py RESULTS.xml [--folder tests/megatron_lm]
"""
from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET

DIFF_RE = re.compile(r"^(.*): max \|difference\| ([0-9.eE+-]+|nan|inf)", re.M)


def rows(path: str, folder: str):
    """(test id, outcome, [(comparison, value)]) for each test case under ``folder``."""
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        if not classname.replace(".", "/").startswith(folder.rstrip("/").replace(".", "/")):
            continue
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        out = "".join(e.text or "" for e in case.iter("system-out"))
        found = [(what.strip(), float(value)) for what, value in DIFF_RE.findall(out)]
        yield f"{classname.rsplit('.', 1)[-1]}::{case.get('name')}", outcome, found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("xml", help="a JUnit XML file written by pytest --junitxml with -o junit_logging=system-out")
    p.add_argument("--folder", default="tests.megatron_lm", help="test folder (dotted or slashed) to report")
    args = p.parse_args(argv)
    try:
        cases = list(rows(args.xml, args.folder))
    except (OSError, ET.ParseError) as e:  # a crashed tier: the summary at the end of CI's log says so
        print(f"equality matrix: no readable JUnit file ({type(e).__name__}: {e})")
        return 0
    if not cases:
        print(f"equality matrix: no test cases of {args.folder} in {args.xml}")
        return 0
    compared = 0
    print(f"equality matrix ({args.folder}): test case | outcome | largest difference vs the reference")
    for test, outcome, found in cases:
        if not found:
            continue
        compared += 1
        what, worst = max(found, key=lambda f: f[1])
        print(f"  {test[:100]:100s} {outcome:7s} {worst:.2e}  ({what[-70:]}; {len(found)} comparisons)")
    print(f"equality matrix: {compared} of {len(cases)} test cases printed comparisons; "
          f"{sum(1 for _, o, _ in cases if o == 'failed')} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
