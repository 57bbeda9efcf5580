"""Build Megatron's dataset C++ helper (``helpers_cpp``) for the *running* interpreter.

``megatron.core.datasets.utils.compile_helpers`` runs ``make -C megatron/core/datasets``. Its
Makefile asks whatever ``python3`` / ``python3-config`` come first on ``PATH`` for the pybind11
include flags and the extension suffix. In a virtualenv launched as ``/venv/bin/torchrun`` (with
the venv not on ``PATH``) those are a different interpreter: pybind11 is not found, or the
library is built as ``helpers_cpp.cpython-312-...so`` for a 3.11 process and then fails to import.

:func:`compile_helpers` runs the same ``make`` but passes ``CPPFLAGS`` and ``LIBEXT`` computed
from ``sys.executable`` on the command line (which overrides the Makefile's variables). It is
installed in place of ``megatron.core.datasets.utils.compile_helpers`` (looked up at call time by
``megatron.training.initialize._compile_dependencies``) -- on any machine, GPU or not.
It needs the ``pybind11`` package in the running environment and a C++ compiler.
"""

import logging
import os
import subprocess
import sys
import sysconfig

logger = logging.getLogger(__name__)


def make_command(datasets_dir: str):
    try:
        import pybind11
    except ImportError as exc:  # pragma: no cover - environment dependent
        raise RuntimeError(
            "building Megatron's dataset helper needs pybind11 in this Python environment: "
            f"{sys.executable} -m pip install pybind11"
        ) from exc
    includes = [sysconfig.get_paths()["include"], pybind11.get_include()]
    cppflags = " ".join(f"-I{p}" for p in dict.fromkeys(includes))
    return [
        "make",
        "-C",
        datasets_dir,
        f"CPPFLAGS={cppflags}",
        f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
    ]


def compile_helpers():
    """Drop-in replacement for ``megatron.core.datasets.utils.compile_helpers``."""
    import megatron.core.datasets.utils as dutils

    datasets_dir = os.path.abspath(os.path.dirname(dutils.__file__))
    if subprocess.run(make_command(datasets_dir)).returncode != 0:
        logger.error("Failed to compile the C++ dataset helper functions")
        sys.exit(1)


def replace_compile_helpers(original):
    """The hooks manifest's replacement for ``megatron.core.datasets.utils.compile_helpers``."""
    return compile_helpers


def install():
    """Install the ``megatron-lm dataset helper`` part of the hooks manifest (idempotent)."""
    from .. import hooks

    hooks.install(["megatron-lm dataset helper"])
