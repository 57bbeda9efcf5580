"""What Megatron-LM's training code imports beyond torch and megatron-core, and a check for it.
``setup.py`` runs this file on its own for the ``megatron-lm`` extra (standard library only)."""
import importlib.util
import sys

#: import name -> pip package.
PACKAGES = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic", "pybind11": "pybind11"}
#: Install command for all of them, from a checkout of this project.
EXTRA = "megatron-lm"


def _importable(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def problem():
    """One line naming what is missing and the command that installs it, or None."""
    lacking = [pip for module, pip in PACKAGES.items() if not _importable(module)]
    if not lacking:
        return None
    return (f"Megatron-LM's training code needs {', '.join(lacking)}, missing from {sys.executable}: "
            f"{sys.executable} -m pip install {' '.join(lacking)} "
            f"(or pip install -e '.[{EXTRA}]' from the megatron-dualpipe checkout)")
