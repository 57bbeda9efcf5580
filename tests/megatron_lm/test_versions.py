"""The supported Megatron range is declared once (megatron_dualpipe/versions.py) and checked: by
setup.py's requirement, at import of megatron_dualpipe.mcore, and by the launcher's preflight,
each refusing a version outside it in one line that names the supported versions."""
import runpy
import pathlib

import pytest

from megatron_dualpipe import versions

pytestmark = pytest.mark.smoke
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version,ok", [
    ("0.16.0", False), ("0.16.1", True), ("0.17.0rc0", False), ("0.17.1", False), ("0.18.2", False), ("0.19.1", True),
    ("0.19.2+e32f1b8", True), ("0.20.0", False), ("1.0", False), ("", False),
])
def test_supported_range(version, ok, monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    assert versions.supported(version) is ok
    problem = versions.problem(version or None)
    print(f"\n{version!r}: {problem}")
    if ok:
        assert problem is None
    else:
        assert "\n" not in problem and versions.SUPPORTED_TEXT in problem and versions.SKIP_ENV in problem


def test_skip_variable_lets_any_version_through(monkeypatch):
    monkeypatch.setenv(versions.SKIP_ENV, "1")
    assert versions.problem("0.15.0") is None


def test_setup_py_requires_the_declared_range():
    """pip's requirement admits exactly what versions.supported admits (0.16.1, 0.19.x; not 0.17/0.18)."""
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "setup.py").read_text()
    assert "megatron-core>=" not in text, "setup.py must take the range from versions.REQUIREMENT"
    spec = SpecifierSet(versions.REQUIREMENT[len("megatron-core"):])
    candidates = [f"0.{minor}.{patch}" for minor in range(14, 22) for patch in range(4)]
    admitted = [v for v in candidates if v in spec]
    print(f"\n{versions.REQUIREMENT}: {admitted}")
    assert admitted == [v for v in candidates if versions.supported(v)]
    assert runpy.run_path(str(ROOT / "megatron_dualpipe" / "versions.py"))["REQUIREMENT"] == versions.REQUIREMENT


def test_every_file_states_the_same_versions():
    """README, docs, scripts and the CPU mode's help name the versions as versions.py does: both
    Megatron-LM tags wherever a tag is named, and no older range ("through 0.19", "<0.17")."""
    files = ["README.md", "docs/multi-node.md", "docs/megatron-lm.md", "scripts/slurm_dualpipe.sbatch",
             "scripts/pretrain_gpt_dualpipe.sh", "scripts/cpu_smoke.sh", "megatron_dualpipe/cli/cpu_mode.py"]
    for name in files:
        text = (ROOT / name).read_text()
        print(f"\n{name}: {text.count('core_v0.16.1')} x core_v0.16.1, {text.count('core_v0.19.0')} x core_v0.19.0")
        for stale in ("through 0.19", "<0.17", "core_v0.19.1", "core_v0.19.2", "0.16.1 only"):
            assert stale not in text, f"{name} says {stale!r}"
        assert ("core_v0.16.1" in text) == ("core_v0.19.0" in text), f"{name} names one supported tag only"


def test_every_tag_has_a_patch_file_and_lies_in_the_range():
    for tag, core in versions.TAGS.items():
        assert (ROOT / "patches" / f"megatron-lm-{tag}.patch").is_file(), tag
        assert versions.supported(core) and versions.tag_of(core) == tag


def test_import_refuses_a_megatron_core_outside_the_range(monkeypatch):
    pytest.importorskip("megatron.core")
    import megatron.core.package_info as info

    import megatron_dualpipe.mcore as mcore

    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    mcore._check_megatron_core_version()  # the installed one is supported
    monkeypatch.setattr(info, "__version__", "0.20.0")
    with pytest.raises(ImportError) as e:
        mcore._check_megatron_core_version()
    print(f"\n{e.value}")
    assert "found megatron-core 0.20.0" in str(e.value) and "\n" not in str(e.value)
