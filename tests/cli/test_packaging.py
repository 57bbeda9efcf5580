"""A wheel works without the checkout: setup.py copies configs/, patches/ and scripts/ into the package,
the sdist carries them to the wheel's build (MANIFEST.in), and :mod:`megatron_dualpipe.project_files`
finds the copy first. The wheel itself, built and installed in a fresh venv: docs/packaging.md."""
import os
import pathlib
import subprocess
import sys

from megatron_dualpipe import project_files

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _names(folder) -> list:
    return sorted(os.listdir(folder))


def test_build_py_copies_every_project_folder_into_the_package(tmp_path):
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    packaged = tmp_path / "megatron_dualpipe" / project_files.PACKAGED_NAME
    for folder in project_files.FOLDERS:
        copied, there = _names(packaged / folder), _names(ROOT / folder)
        print(f"{folder}: {len(copied)} files copied of {len(there)}")
        assert copied == there
    assert (packaged / "scripts" / "pretrain_gpt_dualpipe.sh").stat().st_mode & 0o111, "scripts stay executable"


def test_the_sdist_carries_what_the_wheel_copies():
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    missing = [f for f in project_files.FOLDERS if f"graft {f}" not in manifest]
    missing += [f for f in ("LICENSE", "README.md", "CHANGELOG.md") if f not in " ".join(manifest).split()]
    print(f"missing from MANIFEST.in: {missing}")
    assert not missing


def test_the_packaged_copy_goes_before_the_checkout(tmp_path, monkeypatch):
    checkout = project_files.path("configs")
    print(f"without a packaged copy: {checkout}")
    assert checkout == str(ROOT / "configs") and "gpt_8b.sh" in _names(checkout)
    (tmp_path / "configs").mkdir()
    monkeypatch.setattr(project_files, "PACKAGED", str(tmp_path))
    print(f"with one: {project_files.path('configs')}")
    assert project_files.path("configs") == str(tmp_path / "configs")
    assert project_files.path("patches") == str(ROOT / "patches"), "a folder the copy lacks: the checkout's"
