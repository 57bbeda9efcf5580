"""Megatron-LM's argument help texts read once per process, not once per parse.

Megatron-LM builds much of its argument parser from dataclasses, and reads each field's help text
by parsing its module's source (``ArgumentGroupFactory._get_field_docstrings``: ``inspect.getsource``
and ``ast.parse`` per class and base class) on every ``parse_args``: ~1 s of CPU, 35-45% of a tiny
4-rank run's CPU per rank (py-spy, core_v0.19.0). The texts depend on the source files only, so a
memo per class gives every later parse the same strings.
"""
import sys


def read_once(prefill=False):
    """Memoize the help texts in this process; with ``prefill``, read them now by building the
    parser (a process that forks its ranks hands them the texts already read)."""
    try:
        import argparse

        from megatron.training import argument_utils, arguments
    except ImportError as e:
        print(f"argument_help: Megatron-LM's help texts not memoized: {e!r}", file=sys.stderr)
        return
    factory = argument_utils.ArgumentGroupFactory
    read = factory._get_field_docstrings
    if getattr(read, "memoized", False):
        return
    memo = {}

    def field_docstrings(self, src_cfg_class):
        if src_cfg_class not in memo:
            memo[src_cfg_class] = read(self, src_cfg_class)
        return dict(memo[src_cfg_class])

    field_docstrings.memoized = True
    factory._get_field_docstrings = field_docstrings
    if prefill:
        arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
