"""The docs do not contradict the options table: no doc (README.md, docs/*.md but the generated
docs/megatron-options.md) calls an option refused that the table proves without saying when the table
refuses it, and none calls an option proven or supported that the table only refuses.

The truth is what ``tools/gen_docs.py`` renders into docs/megatron-options.md: ``mcore/options.py``'s
``REFUSED`` and ``HANDLED`` and the structural refusals of ``tools/megatron_options_doc.NOT_OPTIONS``.
A claim is one item of a sentence or table cell (cut at , ; and :, an aside in parentheses a sentence of
its own) that names an option by its flag (or as MTP) and says refused, or supported (proven, equal, needs a
GPU, ...), itself or through the list or table row it is in. A refusal of a proven option must name a
condition of one of its rules: another flag of the rule (or what the docs call it, also in the list's head
or the section's headings), a value (``delayed``), or the schedules it is refused for. MTP stayed
"refused" in five docs after it was proven (issue 36, item 5)."""
import ast
import importlib.util
import pathlib
import re
import sys
from typing import List, NamedTuple, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = "megatron-options.md"
REFUSAL = re.compile(r"\b(?:refus\w*|reject\w*|not supported)", re.I)
#: Words by which an item says that the option runs (or would on a GPU).
SUPPORT = re.compile(r"\b(?:takes?|works?|accepted|supported|proven|equal|wired|needs a GPU|GPU only)\b", re.I)
FLAG = re.compile(r"--[a-z0-9][a-z0-9*/-]*[a-z0-9*]")
#: Names the docs give an option instead of its flag (a claim about the option all the same).
NAMED = ((re.compile(r"\bMTP\b|multi-token prediction", re.I), "--mtp-num-layers"),)
#: How the docs name a flag when they state it as another option's condition.
CONDITION_NAMES = {"--context-parallel-size": ("context parallel",), "--mtp-num-layers": ("MTP",),
                   "--pipeline-model-parallel-layout": ("layout",), "--overlap-moe-expert-parallel-comm": ("fused",),
                   "--dualpipe-shared-shard-group": ("shared shard",), "--dualpipe-dp-first": ("dp-first", "dp first")}


class Rule(NamedTuple):
    flags: Set[str]
    conditions: Set[str]  # lowercase words or flags: one of them must be in a refusal of a proven flag


def _options():
    """``mcore/options.py`` on its own (standard library and the registry): importing the mcore package
    checks megatron-core's version, which imports megatron-core (seconds)."""
    if "megatron_dualpipe.mcore.options" in sys.modules:
        return sys.modules["megatron_dualpipe.mcore.options"]
    name = "megatron_dualpipe.mcore._options_for_docs_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "megatron_dualpipe" / "mcore" / "options.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _not_options() -> Tuple[Tuple[str, ...], ...]:
    """tools/megatron_options_doc.py's NOT_OPTIONS, read as the literal it is."""
    tree = ast.parse((ROOT / "tools" / "megatron_options_doc.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "NOT_OPTIONS")
    return ast.literal_eval(node.value)


def flags_of(text: str) -> Set[str]:
    """Every flag ``text`` names, ``--decoder-first/last-x`` as both, ``--account-for-*-y`` as a pattern."""
    found = set()
    for flag in FLAG.findall(text):
        m = re.fullmatch(r"(--(?:[a-z0-9]+-)*)([a-z0-9]+)/([a-z0-9]+)(-[a-z0-9-]+)?", flag)
        found |= {m.group(1) + w + (m.group(4) or "") for w in m.group(2, 3)} if m else {flag}
    return found


def _schedule_words(schedules) -> Set[str]:
    options = _options()
    if set(options.TWO_CHUNKS) <= set(schedules):
        return set()  # refused under every DualPipe schedule: no schedule to name
    return set(schedules) | ({"one-chunk"} if set(schedules) == set(options.ONE_CHUNK_EXECUTOR) else set())


def rules() -> List[Rule]:
    """Every refusal of the table: REFUSED, and NOT_OPTIONS cut at its semicolons."""
    options = _options()
    found = []
    for r in options.REFUSED:
        values = {w.lower() for w in re.findall(r"[A-Za-z_]{3,}", FLAG.sub(" ", r.flag)) if w != "with"}
        found.append(Rule(flags_of(r.flag), values | _schedule_words(r.schedules) | flags_of(r.needs or "")))
    for row in _not_options():
        for part in row[0].split(";"):
            after = re.search(r"`\s+(\w+\s+\w+)", part)
            schedules = set(re.findall(r"\b(?:dualpipev?|executor-1f1b|zb-h1)\b", part))
            schedules = set() if schedules >= set(_options().TWO_CHUNKS) else schedules
            found.append(Rule(flags_of(part), schedules | ({after.group(1)} if after else set())))
    return [r for r in found if r.flags]


def proven() -> Set[str]:
    """Every flag a row of the table's HANDLED names: an option that runs."""
    return {f for h in _options().HANDLED for f in flags_of(h.option)}


def _matches(flag: str, known: Set[str]) -> Set[str]:
    """``flag`` as the table spells it: itself, or every table flag its ``*`` pattern covers."""
    if "*" not in flag:
        return {flag} & known
    pattern = re.compile(re.escape(flag).replace(r"\*", "[a-z0-9-]+"))
    return {k for k in known if pattern.fullmatch(k)}


def named_flags(item: str, known: Set[str]) -> Set[str]:
    """The table's flags ``item`` makes a claim about: named outside its asides and before what the
    message names as the fix ("naming --x", "resume with --x") or what the refused option needs."""
    text = re.split(r"\bnam(?:ing|es)\b|\bresume with\b|\bneeds?\b", core(item))[0]
    found = {k for f in flags_of(text) for k in _matches(f, known)}
    return found | {flag for pattern, flag in NAMED if pattern.search(text)}


def split_items(text: str) -> List[Tuple[str, str]]:
    """``text`` cut at , ; and : outside backticks and parentheses: (item, the mark that ends it)."""
    items, current, code, depth = [], [], False, 0
    for ch in text:
        code = not code if ch == "`" else code
        depth += 0 if code else (ch == "(") - (ch == ")")
        if not code and depth == 0 and ch in ",;:":
            items.append(("".join(current).strip(), ch))
            current = []
        else:
            current.append(ch)
    return [(i, mark) for i, mark in items + [("".join(current).strip(), "")] if i]


def core(item: str) -> str:
    """``item`` without its asides in parentheses (which :func:`asides` gives)."""
    while re.search(r"\([^()]*\)", item):
        item = re.sub(r"\([^()]*\)", " ", item)
    return item


def asides(item: str) -> List[Tuple[int, str]]:
    """(where, text) of the outermost parenthesised parts of ``item`` (outside backticks)."""
    found, depth, code, start = [], 0, False, 0
    for n, ch in enumerate(item):
        code = not code if ch == "`" else code
        if code or ch not in "()":
            continue
        depth += 1 if ch == "(" else -1
        if ch == "(" and depth == 1:
            start = n + 1
        elif ch == ")" and depth == 0:
            found.append((start, item[start:n]))
    return found


def _blanked(item: str) -> str:
    """``item`` with its asides and code blanked out, each character kept in its place."""
    for start, text in asides(item):
        item = item[:start] + " " * len(text) + item[start + len(text):]
    return re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), item)


def _polarity(item: str):
    """What ``item`` itself says, and where: (refused, supported or None; the position of the word)."""
    text = _blanked(item)
    negated = re.search(r"\bnot (?:refus|reject)", text, re.I)
    said = negated or REFUSAL.search(text) or SUPPORT.search(text)
    if not said:
        return None, len(item)
    return ("supported" if negated or said.re is SUPPORT else "refused"), said.start()


class Claim(NamedTuple):
    line: int  # where the paragraph or table row starts
    kind: str  # "refused" or "supported"
    item: str
    scope: str  # where a condition may be said besides the item: the item the claim follows, the headings


def _sentence_claims(sentence: str, verdict=None, scope: str = "") -> List[Tuple[str, str, str]]:
    """(kind, item, scope) of one sentence, table cell or aside: an item says what it says, else what the
    item said that opened its list with a colon ("refused: A, B"), else ``verdict`` (a table row's status
    cell, or the item an aside follows: "refused (--x)"). An aside's claims have its item in their scope."""
    items = split_items(sentence)
    said = [_polarity(i)[0] for i, _ in items]
    claims = []
    for n, (item, _) in enumerate(items):
        heads = [k for k in range(n) if said[k] and ":" in {m for _, m in items[k:n]}][-1:]
        kind = said[n] or (said[heads[0]] if heads else verdict)
        where = " / ".join(filter(None, [items[heads[0]][0] if heads else "", scope]))
        claims += [(kind, item, where)] if kind else []
        for start, aside in asides(item):
            follows = kind if not said[n] or start > _polarity(item)[1] else None
            claims += _sentence_claims(aside, follows, f"{core(item)} / {where}")
    return claims


def _units(text: str):
    """(line, headings, unit, verdict) of every sentence and table cell outside code fences; a table row's
    first cell takes the verdict of the first status cell that starts with one ("refused before ...")."""
    headings, block, start, fenced = {}, [], 0, False
    for n, line in enumerate(text.splitlines() + [""], 1):
        fenced = not fenced if line.startswith("```") else fenced
        if block and (not line.strip() or fenced or re.match(r"```|\||#|[-*>] |\d+\. ", line)):
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[])", " ".join(block)):
                yield start, " / ".join(headings.values()), sentence, None
            block = []
        if line.startswith("#") and not fenced:
            level = len(line) - len(line.lstrip("#"))
            headings = {k: v for k, v in headings.items() if k < level} | {level: line}
        elif line.startswith("|") and not fenced and not re.fullmatch(r"\|[-:| ]+\|", line.strip()):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            verdict = next((_polarity(c)[0] for c in cells[1:] if _polarity(c)[1] == 0), None)
            for cell, v in [(cells[0], verdict)] + [(c, None) for c in cells[1:]]:
                yield n, " / ".join(headings.values()), cell, v
        elif line.strip() and not fenced and not line.startswith(("```", "#", "|")):
            start = n if not block else start
            block.append(line)


def claims(text: str) -> List[Claim]:
    """Every claim of a markdown text that says refused or supported."""
    return [Claim(line, kind, item, f"{scope} / {headings}") for line, headings, unit, verdict in _units(text)
            for kind, item, scope in _sentence_claims(unit, verdict)]


def _said(condition: str, text: str) -> bool:
    names = (condition,) + CONDITION_NAMES.get(condition, ())
    return any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text, re.I) for n in names)


def contradictions(text: str, table: List[Rule], known: Set[str]) -> List[str]:
    """One line per claim of ``text`` that the table contradicts."""
    refused_flags = set().union(*(r.flags for r in table))
    found = []
    for claim in claims(text):
        for flag in sorted(named_flags(claim.item, known | refused_flags)):
            mine = [r for r in table if flag in r.flags]
            conditions = set().union(set(), *(r.conditions | (r.flags - {flag}) for r in mine))
            said = any(_said(c, claim.item) or (c.startswith("--") and _said(c, claim.scope)) for c in conditions)
            if claim.kind == "refused" and flag in known and not said:
                when = ", ".join(sorted(conditions)) or "never"
                found.append(f"line {claim.line}: calls {flag} refused, which the table proves (refused: {when}): "
                             f"{claim.item!r}")
            elif claim.kind == "supported" and flag not in known and any(not r.conditions for r in mine):
                found.append(f"line {claim.line}: calls {flag} supported, which the table only refuses: {claim.item!r}")
    return found


def doc_files() -> List[pathlib.Path]:
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != GENERATED)


def test_no_doc_contradicts_the_options_table():
    table, known = rules(), proven()
    found, counted = [], 0
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        counted += sum(1 for c in claims(text) if named_flags(c.item, known | set().union(*(r.flags for r in table))))
        found += [f"{path.relative_to(ROOT)} {line}" for line in contradictions(text, table, known)]
    print(f"\n{len(doc_files())} docs, {counted} claims about {len(known)} proven flags and {len(table)} refusals: "
          f"{len(found)} contradicted")
    assert not found, "the options table (mcore/options.py) says otherwise:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_contradiction():
    """The wordings this test was written for, and their corrections."""
    table, known = rules(), proven()
    wrong = {"Rejected for dualpipe: odd pp; MTP; `--decoder-first/last-pipeline-num-layers`.": 3,
             "| FSDP, MTP, CUDA graphs | refused before training |": 1,
             "| `mtp_on_this_rank` | where MTP layers live | refused (`--mtp-num-layers`) |": 1,
             "| `--tp-comm-overlap`, FP8 | needs a GPU (wired; not run here) |": 1,
             "`--use-torch-fsdp2` is supported.": 1}
    right = ["Refused: MTP with context parallelism or a layout; `--decoder-first/last-pipeline-num-layers` under "
             "dualpipev; `--fp8-recipe delayed`.", "`--use-torch-fsdp2` is refused.",
             "Optimizer state across layouts is refused (resume with `--no-load-optim`).",
             "Not rejected: `--log-params-norm` with MoE."]
    for text, count in wrong.items():
        found = contradictions(text, table, known)
        print(f"{len(found)} of {count}: {text}")
        assert len(found) == count, found
    for text in right:
        print(f"0: {text}")
        assert contradictions(text, table, known) == [], text
