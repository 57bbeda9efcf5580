"""The interface of one way of summing a DualPipe stage's two copies.

DualPipe holds every stage twice (one copy per direction); their gradients must be summed before
the optimizer steps. Three ways exist, one module each (:mod:`.bd_first`, :mod:`.shared_shard_wrap`,
:mod:`.dp_first`), and :mod:`.copy_sums` chooses one, once: from Megatron-LM's arguments when
the chunks are built (:func:`.copy_sums.chosen`), from the mark the way's DDP wrapper left on the
chunks everywhere after (:func:`.copy_sums.of`). The rest of the package asks the chosen way what
to do instead of testing flags; a fourth way is a module with its :class:`CopySum`, a line in
``copy_sums.WAYS`` and its row in the options table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

#: When finalize sums the copies over the bd pair itself (``finalize.allreduce_bd_grads``).
ALWAYS, NEVER, MIDDLE_RANK = "always", "never", "on the middle rank"


@dataclass(frozen=True)
class CopySum:
    """One way of summing the copies; ``name`` is the cost model's ``bd_mode``."""

    name: str
    #: the Megatron-LM argument that chooses it (None: the default way)
    flag: Optional[str]
    #: the attribute its DDP wrapper sets on a chunk (None: the default way, no wrapper)
    marker: Optional[str]
    #: makes DualPipe's DDP class from megatron-core's (None: unchanged)
    wrap_ddp: Optional[Callable[[type], type]]
    #: the bd sum runs during the schedule (``grad_reduction.GradReduction``)
    sums_in_schedule: bool
    #: finalize's own bd sum, before Megatron's finalize: ALWAYS, NEVER or MIDDLE_RANK (an odd
    #: pipeline's middle rank holds both copies)
    sums_in_finalize: str
    #: Megatron's finalize gets the chunks in ascending stage order (both partners then issue the
    #: collectives that sum the copies in the same order)
    stage_ordered_finalize: bool
    #: the shard groups are built before the chunks (``shard_groups.build_shard_groups``)
    builds_shard_groups: bool = False
    #: makes the ``get_megatron_optimizer`` used while Megatron-LM sets up the model (None: Megatron's)
    optimizer: Optional[Callable[[Callable], Callable]] = None
    #: the optimizer's state is sharded over both copies' ranks (the state-bytes table's 1F1B column)
    shards_over_both_copies: bool = False

    def marks(self, model) -> bool:
        return self.marker is not None and any(getattr(chunk, self.marker, False) for chunk in model)

    def chosen_by(self, args) -> bool:
        return self.flag is not None and bool(getattr(args, self.flag, False))
