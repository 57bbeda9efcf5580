"""Regenerate every generated table and figure under docs/, or check that they are current.

    PYTHONPATH=. python tools/gen_docs.py           # write them
    PYTHONPATH=. python tools/gen_docs.py --check   # exit 1 naming the stale files (tests/cli/test_docs.py)

Generated: docs/bubbles.md (tools/bubble_report.py) and its figure docs/dualpipe_pp8_m20.svg /
.png; docs/megatron-options.md (tools/megatron_options_doc.py, from megatron_dualpipe/mcore/options.py). The check compares the markdown and the SVG (both made by this project's code alone); the
PNG depends on the installed matplotlib and is rewritten, not compared. docs/benchmarks.md
holds measured times and is not generated.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bubble_report  # noqa: E402
import megatron_options_doc  # noqa: E402

from megatron_dualpipe.pictures.draw import to_svg  # noqa: E402
from megatron_dualpipe.pictures.figure import to_png  # noqa: E402


def generated() -> dict:
    """docs-relative path -> text, for every compared generated file."""
    s, res = bubble_report.figure()
    return {"bubbles.md": bubble_report.report() + "\n", f"{bubble_report.FIGURE}.svg": to_svg(s, res),
            "megatron-options.md": megatron_options_doc.report()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated file is stale")
    args = ap.parse_args(argv)
    docs = os.path.join(ROOT, "docs")
    stale = []
    for name, text in generated().items():
        path = os.path.join(docs, name)
        try:
            with open(path, encoding="utf-8") as fh:
                current = fh.read()
        except OSError:
            current = None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
    if args.check:
        if stale:
            print(f"stale: {', '.join(stale)}; run: PYTHONPATH=. python tools/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    s, res = bubble_report.figure()
    to_png(s, res, os.path.join(docs, f"{bubble_report.FIGURE}.png"))
    print(f"wrote {', '.join(stale) or 'nothing new'} (and {bubble_report.FIGURE}.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
