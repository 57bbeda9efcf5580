"""Build Megatron's dataset C++ helper for the *running* interpreter (Megatron's Makefile asks the
``python3-config`` first on ``PATH``), locked and renamed into place: two jobs from one checkout once
imported each other's half-written library (a CI failure)."""

import fcntl
import logging
import os
import subprocess
import sys
import sysconfig

logger = logging.getLogger(__name__)


def make_command(datasets_dir: str, out: str):
    try:
        import pybind11
    except ImportError as exc:  # pragma: no cover - environment dependent
        raise RuntimeError("building Megatron's dataset helper needs pybind11 in this Python environment: "
                           f"{sys.executable} -m pip install pybind11") from exc
    includes = [sysconfig.get_paths()["include"], pybind11.get_include()]
    cppflags = " ".join(f"-I{p}" for p in dict.fromkeys(includes))
    return ["make", "-C", datasets_dir, f"CPPFLAGS={cppflags}", f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"OUT={out}"]


def library_path(datasets_dir: str) -> str:
    """The library this interpreter imports as ``helpers_cpp``."""
    return os.path.join(datasets_dir, "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))


BUILT, UP_TO_DATE, FAILED = "built", "up to date", "failed"


def build(datasets_dir: str) -> str:
    """make's rule, once per checkout however many jobs ask at once: BUILT, UP_TO_DATE or FAILED."""
    final, source = library_path(datasets_dir), os.path.join(datasets_dir, "helpers.cpp")
    fd = os.open(datasets_dir, os.O_RDONLY)  # a lock on the directory: no file left in the checkout
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some NFS): the rename still keeps imports whole
            pass
        if os.path.exists(final) and os.path.getmtime(final) >= os.path.getmtime(source):
            return UP_TO_DATE
        temporary = f".helpers_cpp.{os.getpid()}.tmp"
        try:
            built = subprocess.run(make_command(datasets_dir, out=temporary)).returncode == 0
            if built:
                os.replace(os.path.join(datasets_dir, temporary), final)
            return BUILT if built else FAILED
        finally:
            if os.path.exists(os.path.join(datasets_dir, temporary)):
                os.remove(os.path.join(datasets_dir, temporary))
    finally:
        os.close(fd)  # releases the lock


def compile_helpers():
    """Drop-in replacement for ``megatron.core.datasets.utils.compile_helpers``."""
    import megatron.core.datasets.utils as dutils

    if build(os.path.abspath(os.path.dirname(dutils.__file__))) == FAILED:
        logger.error("Failed to compile the C++ dataset helper functions")
        sys.exit(1)


def replace_compile_helpers(original):
    """The hooks manifest's replacement for ``megatron.core.datasets.utils.compile_helpers``."""
    return compile_helpers
