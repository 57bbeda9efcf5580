"""Megatron-core glue for DualPipe / DualPipeV. Importing it checks that the importable megatron-core lies in
the supported range (:mod:`megatron_dualpipe.versions`): outside it, one line naming the supported versions.
"""


def _check_megatron_core_version():
    from .. import versions

    try:
        from megatron.core.package_info import __version__ as found
    except ImportError:  # no megatron-core: the module that needs it says so when imported
        return
    problem = versions.problem(found)
    if problem:
        raise ImportError(f"megatron_dualpipe: {problem}")


_check_megatron_core_version()
