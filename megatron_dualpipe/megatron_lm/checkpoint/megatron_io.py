"""The two places of Megatron-LM's checkpointing that a strategy edits, each for one block: what
``save_checkpoint`` writes and what ``load_checkpoint`` read (looked up at call time)."""

import functools

from ... import hooks


def state_dict_editor(edit):
    """``orig -> generate``: a state-dict generator whose result ``edit`` changes in place (also for
    Megatron-Bridge's ``generate_state_dict``, ``bridge.checkpoint``)."""

    def editing(orig):
        @functools.wraps(orig)
        def generate(*a, **kw):
            sd = orig(*a, **kw)
            edit(sd)
            return sd

        return generate

    return editing


def generated_state_dict_edited(edit):
    """Within the block, ``edit(state_dict)`` runs on every state dict Megatron's save generates."""
    return hooks.scoped(hooks.entry("scoped", "generate_state_dict").made_by(state_dict_editor(edit)))


def loaded_state_dict_edited(edit):
    """Within the block, ``edit(state_dict)`` runs on the state dict Megatron's load read from this
    rank's file (not on the rank-0 metadata reads, nor when there is none)."""

    def editing(orig):
        @functools.wraps(orig)
        def load_base(*a, **kw):
            result = orig(*a, **kw)
            if not kw.get("rank0", False) and result[0] is not None:
                edit(result[0])
            return result

        return load_base

    return hooks.scoped(hooks.entry("scoped", "_load_base_checkpoint").made_by(editing))
