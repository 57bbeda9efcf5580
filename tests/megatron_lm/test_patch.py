"""`megatron-dualpipe patch`: checks the checkout, adds the 3-line hook, is idempotent, has
--check and --revert, and equals patches/megatron-lm-<tag>.patch for both tags."""
import os
import pathlib
import shutil
import subprocess

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.megatron_lm.patching import HOOK, PatchError, apply

pytestmark = pytest.mark.smoke
ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH_FILE = ROOT / "patches" / "megatron-lm-core_v0.16.1.patch"
CONTEXT = "from typing import List, Optional, Tuple\n\nimport torch\n\nfrom gpt_builders import gpt_builder\n" \
          "from megatron.core import parallel_state\n"
#: Every tag the hook is written for: its patch file, its package_info version, the lines around the hook.
TAGGED = {
    "core_v0.16.1": (PATCH_FILE, (0, 16, 1), CONTEXT),
    "core_v0.19.0": (ROOT / "patches" / "megatron-lm-core_v0.19.0.patch", (0, 19, 1),
                     "from typing import Any, List, Optional, Tuple\n\nimport torch\n\nfrom gpt_builders import "
                     "gpt_builder\nfrom megatron.core import mpu\n"),
}


def make_checkout(tmp_path, version=(0, 16, 1), script=None, context=CONTEXT, preamble=19):
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(
        "MAJOR = {}\nMINOR = {}\nPATCH = {}\n".format(*version))
    text = script if script is not None else "".join(f"# line {i}\n" for i in range(1, preamble + 1)) + context
    (root / "pretrain_gpt.py").write_text(text)
    return root


def test_apply_is_idempotent_and_revert_restores_the_file(tmp_path):
    root = make_checkout(tmp_path)
    script = root / "pretrain_gpt.py"
    original = script.read_bytes()
    assert "would add" in apply(str(root), check=True) and script.read_bytes() == original
    assert "added" in apply(str(root))
    patched = script.read_text()
    assert "import torch\n" + "".join(HOOK) in patched
    assert "already applied" in apply(str(root)) and script.read_text() == patched
    assert "would remove" in apply(str(root), revert=True, check=True) and script.read_text() == patched
    assert "removed" in apply(str(root), revert=True)
    assert script.read_bytes() == original
    assert "nothing to revert" in apply(str(root), revert=True)


@pytest.mark.parametrize("tag", sorted(TAGGED))
def test_patch_file_equals_the_command(tmp_path, tag):
    patch_file, version, context = TAGGED[tag]
    added = [line[1:] for line in patch_file.read_text().splitlines(keepends=True)
             if line.startswith("+") and not line.startswith("+++")]
    assert tuple(added) == HOOK
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    hunk_start = int(next(line for line in patch_file.read_text().splitlines() if line.startswith("@@")).split()[1]
                     .lstrip("-").split(",")[0])
    by_git, by_us = (make_checkout(tmp_path / d, version, context=context, preamble=hunk_start - 1) for d in "ab")
    subprocess.run(["git", "apply", str(patch_file)], cwd=by_git, check=True)
    apply(str(by_us))
    assert (by_git / "pretrain_gpt.py").read_text() == (by_us / "pretrain_gpt.py").read_text()


@pytest.mark.parametrize("setup,expected", [
    (dict(version=(0, 15, 0)), "found megatron-core 0.15.0"),
    (dict(script="print('no torch here')\n"), "no line 'import torch'"),
    (dict(script=CONTEXT.replace("import torch\n", "import torch\n" + HOOK[0] + HOOK[2])), "modified megatron-dualpipe hook"),
])
def test_bad_checkouts_are_refused_and_left_alone(tmp_path, setup, expected):
    root = make_checkout(tmp_path, **setup)
    before = (root / "pretrain_gpt.py").read_bytes()
    with pytest.raises(PatchError, match=expected):
        apply(str(root))
    assert (root / "pretrain_gpt.py").read_bytes() == before


def test_cli(tmp_path, capsys):
    root = make_checkout(tmp_path)
    assert main(["patch", str(root), "--check"]) == 0
    assert "would add" in capsys.readouterr().out
    assert main(["patch", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-dualpipe: error: no pretrain_gpt.py")


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0")
def test_real_checkout_copy(tmp_path):
    src = pathlib.Path(os.environ["MEGATRON_LM_PATH"])
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "core").mkdir(parents=True)
    shutil.copy(src / "megatron" / "core" / "package_info.py", root / "megatron" / "core")
    shutil.copy(src / "pretrain_gpt.py", root)
    original = (root / "pretrain_gpt.py").read_bytes()
    print("\n" + apply(str(root)))
    patched = (root / "pretrain_gpt.py").read_text()
    from megatron_dualpipe import versions

    tag = versions.tag_of(versions.checkout_core_version(str(root)))
    subprocess.run(["git", "apply", "--check", "-R", str(TAGGED[tag][0])], cwd=root, check=True)
    print(apply(str(root), revert=True))
    assert (root / "pretrain_gpt.py").read_bytes() == original and "".join(HOOK) in patched


def test_revert_works_on_a_wrong_tag_and_the_message_names_no_launcher(tmp_path):
    root = make_checkout(tmp_path)
    apply(str(root))
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 17\nPATCH = 0\n")
    with pytest.raises(PatchError) as e:
        apply(str(root), check=True)
    print(f"\n{e.value}")
    assert "found megatron-core 0.17.0" in str(e.value) and "launch" not in str(e.value)
    assert "would remove" in apply(str(root), revert=True, check=True)
    assert "removed" in apply(str(root), revert=True)
    assert "megatron_dualpipe" not in (root / "pretrain_gpt.py").read_text()


def test_read_only_checkout_is_refused_by_check_and_by_the_run(tmp_path, monkeypatch, capsys):
    """As root every file is writable, so the read-only case is simulated through os.access."""
    import megatron_dualpipe.megatron_lm.patching as patching

    root = make_checkout(tmp_path)
    before = (root / "pretrain_gpt.py").read_bytes()
    monkeypatch.setattr(patching.os, "access", lambda path, mode: False)
    for argv in (["patch", str(root), "--check"], ["patch", str(root)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "is not writable" in err and "Traceback" not in err
    assert (root / "pretrain_gpt.py").read_bytes() == before


def test_a_failed_write_is_one_line_and_leaves_the_file(tmp_path, monkeypatch, capsys):
    import megatron_dualpipe.megatron_lm.patching as patching

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    root = make_checkout(tmp_path)
    before = (root / "pretrain_gpt.py").read_bytes()
    monkeypatch.setattr(patching.tempfile, "mkstemp", refuse)
    assert main(["patch", str(root)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Permission denied" in err and "git apply" in err
    named = err.split("or apply ")[1].split(" (git apply)")[0]
    print(f"the patch the message names: {named}")
    assert os.path.isfile(named), f"the message names a patch that is not there (a wheel carries a copy): {named}"
    assert (root / "pretrain_gpt.py").read_bytes() == before and not list(root.glob(".pretrain_gpt.*"))


def test_a_crlf_checkout_stays_crlf(tmp_path):
    """A pretrain_gpt.py with Windows line endings (a checkout with core.autocrlf) keeps them: the
    hook gets CRLF too, nothing else changes, and --revert gives back the same bytes."""
    root = make_checkout(tmp_path)
    script = root / "pretrain_gpt.py"
    script.write_bytes(script.read_bytes().replace(b"\n", b"\r\n"))
    original = script.read_bytes()
    assert "added" in apply(str(root))
    patched = script.read_bytes()
    lf_only = patched.count(b"\n") - patched.count(b"\r\n")
    crlf = patched.count(b"\r\n")
    print(f"\n{crlf} CRLF lines, {lf_only} LF-only lines after patching")
    assert lf_only == 0 and b"import torch\r\n" + "".join(HOOK).replace("\n", "\r\n").encode() in patched
    assert "already applied" in apply(str(root))
    assert "removed" in apply(str(root), revert=True) and script.read_bytes() == original
