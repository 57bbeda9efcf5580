"""``megatron-dualpipe patch PATH``: add (or remove) the 3-line hook in Megatron-LM's pretrain_gpt.py,
so that ``torchrun pretrain_gpt.py`` installs the plugin without the launcher: ``patches/megatron-lm-<tag>.patch``
applied in Python (no git needed), idempotent, the file replaced whole (never half-written)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Optional, Tuple

from .. import project_files, versions

#: The Megatron-LM tags the hook is written for (one patch file each in patches/), oldest first.
TAGS = tuple(versions.TAGS)
#: The line the hook goes after (the first ``import torch`` of pretrain_gpt.py at the tag).
ANCHOR = "import torch\n"
HOOK = (
    "import importlib.util  # megatron-dualpipe (optional): --pipeline-schedule {1f1b,dualpipe,dualpipev}\n",
    'if importlib.util.find_spec("megatron_dualpipe") is not None:\n',
    "    import megatron_dualpipe.megatron_lm.install as _dualpipe; _dualpipe.install()\n",
)
MARKER = "megatron_dualpipe.megatron_lm.install"


class PatchError(ValueError):
    """The checkout cannot be patched as asked; the message says why and what to do."""


def tag_problem(path: str, version: Optional[str], tag: Optional[str] = None) -> Optional[str]:
    """Why the checkout at ``path`` (megatron-core ``version``) is not one of :data:`TAGS`, or None."""
    if versions.tag_of(version) is not None:
        return None
    found = f"megatron-core {version}" if version else "no megatron/core/package_info.py"
    return (f"{path} is not a supported Megatron-LM checkout (found {found}{f', git tag {tag}' if tag else ''}): "
            f"megatron-dualpipe supports {versions.SUPPORTED_TEXT}; check one of those tags out "
            f"(git -C {path} checkout {TAGS[-1]})")


def _git_tag(path: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", path, "describe", "--tags", "--exact-match"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def inspect(path: str, require_tag: bool = True) -> Tuple[str, list, bool]:
    """(pretrain_gpt.py's path, its lines, whether the hook is in them); refuses a checkout it cannot patch."""
    script = os.path.join(path, "pretrain_gpt.py")
    if not os.path.isfile(script):
        raise PatchError(f"no pretrain_gpt.py in {path}: give the root of a Megatron-LM checkout at tag "
                         f"{' or '.join(TAGS)}")
    if require_tag and (problem := tag_problem(path, versions.checkout_core_version(path), _git_tag(path))):
        raise PatchError(problem + " and run this command again")
    lines = _read_lines(script)
    hooked = [i for i, line in enumerate(lines) if MARKER in line]
    if hooked:
        i = hooked[0] - 2
        if i < 0 or tuple(_bare(line) for line in lines[i:i + 3]) != tuple(_bare(h) for h in HOOK):
            raise PatchError(f"{script} contains a modified megatron-dualpipe hook (line {hooked[0] + 1}): "
                             f"remove it by hand, then run this command again")
        return script, lines, True
    if _anchor_index(lines) is None:
        raise PatchError(f"{script} has no line {ANCHOR.strip()!r} to put the hook after: is it from "
                         f"{' or '.join(TAGS)}?")
    return script, lines, False


def _read_lines(script: str):
    """The script's lines with their own line endings (a CRLF checkout stays CRLF when written back)."""
    with open(script, encoding="utf-8", newline="") as f:
        return f.read().splitlines(keepends=True)


def _bare(line: str) -> str:
    return line.rstrip("\r\n")


def _anchor_index(lines) -> Optional[int]:
    return next((i for i, line in enumerate(lines) if _bare(line) == _bare(ANCHOR)), None)


def patch_file(tag: str) -> str:
    """The patch file of Megatron-LM tag ``tag`` (one of :data:`TAGS`), relative to the project's root."""
    if tag not in TAGS:
        raise PatchError(f"no patch for {tag}: the hook is written for {' and '.join(TAGS)}")
    return f"patches/megatron-lm-{tag}.patch"


def _cannot_write(script: str, why: str) -> str:
    tag = versions.tag_of(versions.checkout_core_version(os.path.dirname(os.path.abspath(script)))) or TAGS[-1]
    return (f"cannot change {script}: {why}; run this as a user who can write the checkout, or apply "
            f"{project_files.path(patch_file(tag))} (git apply) as one")


def _write_atomically(path: str, text: str) -> None:
    """The new text beside the old, renamed over it: never a half-written file."""
    try:
        mode = os.stat(path).st_mode
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".pretrain_gpt.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise PatchError(_cannot_write(path, e.strerror or str(e))) from None


def apply(path: str, *, revert: bool = False, check: bool = False) -> str:
    """Apply (or revert, at any version) the hook; with ``check`` change nothing but fail where the
    real run would. Returns what was (or would be) done."""
    script, lines, applied = inspect(path, require_tag=not revert)
    if applied != revert:
        return f"not applied to {script}; nothing to revert" if revert else \
            f"already applied to {script}; nothing to do"
    for what in (os.path.dirname(os.path.abspath(script)), script):  # the new text goes beside it, then over it
        if not os.access(what, os.W_OK):
            raise PatchError(_cannot_write(script, f"{what} is not writable"))
    if revert:
        if check:
            return f"would remove the megatron-dualpipe hook from {script}"
        i = next(i for i, line in enumerate(lines) if MARKER in line) - 2
        _write_atomically(script, "".join(lines[:i] + lines[i + len(HOOK):]))
        return f"removed the megatron-dualpipe hook from {script}"
    if check:
        return f"would add the megatron-dualpipe hook ({len(HOOK)} lines) to {script}"
    at = _anchor_index(lines) + 1
    eol = lines[at - 1][len(_bare(lines[at - 1])):] or "\n"  # the anchor line's own ending
    _write_atomically(script, "".join(lines[:at] + [_bare(h) + eol for h in HOOK] + lines[at:]))
    return f"added the megatron-dualpipe hook ({len(HOOK)} lines) to {script}"
