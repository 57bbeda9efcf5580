"""The interface of one way of summing a DualPipe stage's two copies under megatron-core: the rest
of the package asks the chosen way instead of testing which one it is. The methods are the default
way's answers; a way overrides what it changes. Its pure facts: :attr:`CopySumWay.way`."""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

from ...schedule.copy_sum import CopySum, stage_order
from ...schedule.layout import BIDIRECTIONAL, Layout
from ..options import flag_on


def _this_rank():
    from megatron.core import parallel_state

    return (Layout(BIDIRECTIONAL, parallel_state.get_pipeline_model_parallel_world_size()),
            parallel_state.get_pipeline_model_parallel_rank())


def chunks_in_stage_order(model: Sequence) -> List[int]:
    """This rank's chunk indices in :func:`~...schedule.copy_sum.stage_order`."""
    return stage_order(*_this_rank()) if len(model) == 2 else [0]


class CopySumWay:
    """``marker``: the attribute its DDP wrapper sets on a chunk; ``purpose``: for the argument check."""

    way: CopySum = CopySum.BD_FIRST
    marker: Optional[str] = None
    purpose: str = ""
    #: How the state-bytes table's 1F1B column relates to this rank's ``model[0]``.
    one_f_one_b_note = "under the same sharding)"

    def __repr__(self) -> str:
        return f"<copy sum {self.way}>"

    def chosen_by(self, args) -> bool:
        """Whether Megatron-LM's ``args`` carry the way's flag (``CopySum.flag``)."""
        return self.way.flag is not None and flag_on(self.way.flag, args)

    def marks(self, model) -> bool:
        return self.marker is not None and any(getattr(chunk, self.marker, False) for chunk in model)

    def build_groups(self) -> None:
        """Its process groups besides the bd pairs (collective; before the chunks are built)."""

    def wrap_ddp(self, ddp_class: type) -> type:
        return ddp_class

    def building_optimizer(self):
        """The scope in which Megatron-LM's setup builds the optimizer."""
        return contextlib.nullcontext()

    def sum_in_finalize(self, model: Sequence, bd_sum: Callable[[Sequence], None]) -> None:
        """Finalize's own copy sum, before Megatron's: ``bd_sum`` (``finalize.allreduce_bd_grads``)."""
        bd_sum(model)

    def finalize_order(self, model: Sequence) -> List:
        """The chunks as Megatron's finalize gets them (stage order where its loop sums the copies)."""
        return [model[c] for c in self.way.finalize_order(*_this_rank())] if len(model) == 2 else list(model)

    @contextlib.contextmanager
    def params_norm_chunks(self, model: Sequence, reads_main_params: bool):
        """What Megatron-LM's ``calc_params_l2_norm`` reads so that its sum is 1F1B's: every
        parameter once, at home (``model[0]``; the mirror's copy is the same tensor)."""
        yield list(model[:1])

    def checkpoint_view(self, home_copy_state: Callable, per_stage_state: Callable) -> Callable:
        """Which of the checkpoint layer's optimizer views holds 1F1B's state: ``model[0]``'s part of
        one optimizer (the mirror's copied after a load), or the home copy's optimizers per stage."""
        return home_copy_state

    def one_f_one_b_bytes(self, home):
        """What 1F1B holds on this rank, from ``model[0]``'s ``state_bytes.ChunkBytes``."""
        return home
