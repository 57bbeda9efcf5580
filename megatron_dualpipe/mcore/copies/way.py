"""The interface of one way of summing a DualPipe stage's two copies under megatron-core.

Why one interface: the rest of the package holds the chosen way (:func:`.chosen`, :func:`.of`) and
asks it what to do at each point where the ways differ, instead of testing which one it is. The
methods here are the default way's answers (no wrapper, one optimizer over both chunks); a way
overrides what it changes. Its pure facts (bytes, the collectives it appends, whether the sum runs
during the schedule) are its :class:`~..schedule.copy_sum.CopySum`, :attr:`CopySumWay.way`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List, Optional, Sequence

from ...schedule.copy_sum import CopySum, stage_order
from ...schedule.layout import BIDIRECTIONAL, Layout


def _this_rank():
    """This rank's DualPipe layout and pipeline rank (``parallel_state``)."""
    from megatron.core import parallel_state

    layout = Layout(BIDIRECTIONAL, parallel_state.get_pipeline_model_parallel_world_size())
    return layout, parallel_state.get_pipeline_model_parallel_rank()


def chunks_in_stage_order(model: Sequence) -> List[int]:
    """This rank's chunk indices in ascending stage order (``schedule.copy_sum.stage_order`` on this
    rank's pipeline coordinates): the order both bd partners issue collectives outside the schedule in."""
    return stage_order(*_this_rank()) if len(model) == 2 else [0]


class CopySumWay:
    """One way (module docstring). ``marker``: the attribute its DDP wrapper sets on a chunk (None:
    no wrapper); ``purpose``: what it changes, for the argument check's messages."""

    way: CopySum = CopySum.BD_FIRST
    marker: Optional[str] = None
    purpose: str = ""

    def __repr__(self) -> str:
        return f"<copy sum {self.way}>"

    # -- choosing -------------------------------------------------------------------------------
    def chosen_by(self, args) -> bool:
        """Whether Megatron-LM's ``args`` carry the way's flag (``CopySum.flag``)."""
        flag = self.way.flag
        return flag is not None and bool(getattr(args, flag[2:].replace("-", "_"), False))

    def marks(self, model) -> bool:
        return self.marker is not None and any(getattr(chunk, self.marker, False) for chunk in model)

    # -- building -------------------------------------------------------------------------------
    def build_groups(self) -> None:
        """The process groups it needs besides the bd pairs (collective; before the chunks are built)."""

    def wrap_ddp(self, ddp_class: type) -> type:
        """DualPipe's DDP class made from megatron-core's."""
        return ddp_class

    def building_optimizer(self) -> ContextManager:
        """The scope in which Megatron-LM's setup builds the optimizer its way."""
        return contextlib.nullcontext()

    # -- after the schedule -----------------------------------------------------------------------
    def sum_in_finalize(self, model: Sequence, bd_sum: Callable[[Sequence], None]) -> None:
        """Finalize's own copy sum, before Megatron's finalize: ``bd_sum`` (``finalize.allreduce_bd_grads``)."""
        bd_sum(model)

    def finalize_order(self, model: Sequence) -> List:
        """The chunks in the order Megatron's finalize gets them: where its per-chunk loop issues the
        collectives that sum the copies, stage order on both partners."""
        return [model[c] for c in self.way.finalize_order(*_this_rank())] if len(model) == 2 else list(model)

    @contextlib.contextmanager
    def params_norm_chunks(self, model: Sequence, reads_main_params: bool):
        """What Megatron-LM's ``calc_params_l2_norm`` is given for DualPipe's two chunks, so that its
        sum is 1F1B's: every parameter of every stage once, at home (``model[0]``)."""
        yield list(model[:1])

    # -- checkpoints and memory ---------------------------------------------------------------------
    def checkpoint_view(self, home_copy_state: Callable, per_stage_state: Callable) -> Callable:
        """Which of the checkpoint layer's two optimizer views holds 1F1B's optimizer state: the
        ``model[0]`` part of one optimizer over both chunks (the mirror's copied after a load), or
        the home copy's own optimizers, one per stage."""
        return home_copy_state

    def one_f_one_b_bytes(self, home):
        """What 1F1B holds on this rank, from ``model[0]``'s ``state_bytes.ChunkBytes``."""
        return home

    #: How the state-bytes table's 1F1B column relates to this rank's ``model[0]``.
    one_f_one_b_note = "under the same sharding)"

