"""Generated docs are current: the test regenerates them and compares (tools/gen_docs.py)."""
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_docs_are_current():
    stale = []
    for name, text in _gen_docs().generated().items():
        path = ROOT / "docs" / name
        print(f"\n{path.relative_to(ROOT)}: {len(text)} characters regenerated")
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    assert not stale, f"docs/{', docs/'.join(stale)} out of date: run PYTHONPATH=. python tools/gen_docs.py"


def test_same_model_table_doubles_1f1b_against_dualpipev_chunks():
    """The case the issue names: chunk costs f=1 b=2 w=1 fb=2.5 at pp=4 -> DualPipeV 4.5, same-model 1F1B 18."""
    from megatron_dualpipe.costs.compare import compare
    from megatron_dualpipe.schedule.registry import DUALPIPEV, ONE_F_ONE_B
    from megatron_dualpipe.schedule.simulate import Costs

    rows = {r.name: r for r in compare(4, 16, Costs(f=2, b=4, w=2, fb=5))}
    print(f"\n1f1b bubble {rows[ONE_F_ONE_B].bubble}, dualpipev bubble {rows[DUALPIPEV].bubble}")
    assert rows[ONE_F_ONE_B].bubble == (4 - 1) * (2 + 4) == 18
    assert rows[DUALPIPEV].bubble == 4.5 and rows[DUALPIPEV].costs == Costs(1, 2, 1, 2.5)


def test_every_dualpipe_flag_is_documented():
    """Each flag megatron-dualpipe adds to Megatron-LM's parser (megatron_lm/arguments.py) has a row
    in docs/megatron-lm.md's flag table (--dualpipe-drift-check-interval was documented nowhere)."""
    import argparse

    from megatron_dualpipe.megatron_lm.arguments import add_dualpipe_arguments

    doc = (ROOT / "docs" / "megatron-lm.md").read_text(encoding="utf-8")
    rows = [line for line in doc.splitlines() if line.startswith("| `--")]
    flags = [s for a in add_dualpipe_arguments(argparse.ArgumentParser())._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    print(f"\n{len(flags)} flags, {len(rows)} rows in docs/megatron-lm.md")
    missing = [f for f in flags if not any(f"`{f}" in row for row in rows)]
    assert not missing, f"docs/megatron-lm.md has no row for {missing}"


def test_megatron_lm_md_lists_every_config():
    """docs/megatron-lm.md's list of configs names each of configs/ with its minimum GPU count (both
    DeepSeek-V3 configs were missing)."""
    doc = (ROOT / "docs" / "megatron-lm.md").read_text(encoding="utf-8")
    configs = sorted(p.stem for p in (ROOT / "configs").glob("*.sh"))
    missing = [c for c in configs if not re.search(rf"`{c}` \(\d+", doc)]
    print(f"\n{len(configs)} configs, missing from docs/megatron-lm.md: {missing}")
    assert not missing
