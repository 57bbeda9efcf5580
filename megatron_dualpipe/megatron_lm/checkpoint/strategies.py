"""How each (schedule, checkpoint format) saves and loads: one function per cell of :data:`SAVE` /
:data:`LOAD` (others: as Megatron does). Every schedule's checkpoint holds 1F1B's layout, so that any
schedule resumes any other's; optimizer state across the DualPipeV and 1F1B layouts is refused before
a torch-format load, and every torch_dist save and load writes the fully reshardable state at each
parameter's own offsets (:func:`.optimizers.exact_offsets`).
"""

import contextlib
from typing import Callable, Dict, Tuple

from ...mcore import copies
from ...schedule import registry
from ...schedule.layout import BIDIRECTIONAL, V_SHAPE
from ..refusal import Refusal
from . import dualpipev_layers, torch_dist_mirror
from .megatron_io import generated_state_dict_edited
from .mirrors import sync_mirrors
from .one_chunk_optimizer import OneChunkOptimizerView
from .shared_shards import SharedShardOptimizerView
from .optimizers import exact_offsets, inner_optimizers, kind, model0_ids

ANY_FORMAT = "*"


# --- save: (orig, args, iteration, model, optimizer, *rest) -> what Megatron's save returns ----


def save_as_is(orig, args, iteration, model, optimizer, *a, **kw):
    return orig(iteration, model, optimizer, *a, **kw)


class HomeCopyState:
    """One optimizer over both chunks (the bd sum, dp-first): 1F1B's state is its ``model[0]`` part."""

    formats = None  # the checkpoint formats it is written and read in (None: every one)

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def torch_view(self, saving: bool):
        if saving:
            for o in inner_optimizers(self.optimizer):
                if not getattr(o, "is_stub_optimizer", False):
                    kind(o)  # refuses unsupported optimizers before anything is written
        return OneChunkOptimizerView(self.optimizer, model0_ids(self.model))

    @contextlib.contextmanager
    def torch_dist_view(self):
        with torch_dist_mirror.model0_distributed_optimizers(self.model, self.optimizer):
            yield self.optimizer

    def sync_mirrors(self) -> None:
        sync_mirrors(self.model, self.optimizer)


class PerStageState(HomeCopyState):
    """The shared shard group's optimizers, one per stage (:mod:`.shared_shards`): mirrors sync parameters only."""

    formats = ("torch", "torch_dist")  # torch_dist keyed by parameter: the argument check refuses the rest

    def torch_view(self, saving: bool):
        return SharedShardOptimizerView(self.optimizer, self.model)

    @contextlib.contextmanager
    def torch_dist_view(self):
        yield None if self.optimizer is None else SharedShardOptimizerView(self.optimizer, self.model)

    def sync_mirrors(self) -> None:
        sync_mirrors(self.model, None)


def _state(model, optimizer):
    """The optimizer view the way the copies are summed keeps 1F1B's state in (``mcore.copies``)."""
    return copies.of(model).checkpoint_view(HomeCopyState, PerStageState)(model, optimizer)


def save_model0_as_one_chunk(orig, args, iteration, model, optimizer, *a, **kw):
    """dualpipe, torch: the file 1F1B writes (``model[0]`` and its optimizer state, re-indexed)."""
    if not args.no_save_optim and optimizer is not None:
        optimizer = _state(model, optimizer).torch_view(saving=True)
    return orig(iteration, list(model)[:1], optimizer, *a, **kw)


def save_without_mirror(orig, args, iteration, model, optimizer, *a, **kw):
    """dualpipe, torch_dist: 1F1B's keys (the mirror's entries and grad buffers are not written)."""
    with generated_state_dict_edited(torch_dist_mirror.drop_mirror_entries), exact_offsets(optimizer), \
            _state(model, None if args.no_save_optim else optimizer).torch_dist_view() as view:
        return orig(iteration, model, optimizer if args.no_save_optim else view, *a, **kw)


def save_with_one_chunk_model(orig, args, iteration, model, optimizer, *a, **kw):
    """dualpipev, torch: Megatron's two-chunk file, plus ``model`` = 1F1B stage ``i`` (collective)."""
    with dualpipev_layers.one_chunk_model_added(model):
        return orig(iteration, model, optimizer, *a, **kw)


def save_tied_output_once(orig, args, iteration, model, optimizer, *a, **kw):
    """dualpipev, torch_dist: Megatron's save without rank 0's output copy of a tied embedding, the
    embedding's state at its own offsets (V-stage 0 pads the bucket before it where 1F1B's stage 0 may not)."""
    with generated_state_dict_edited(torch_dist_mirror.drop_mirror_entries), exact_offsets(optimizer):
        return orig(iteration, model, optimizer, *a, **kw)


SAVE: Dict[Tuple[str, str], Callable] = {
    (BIDIRECTIONAL, "torch"): save_model0_as_one_chunk,
    (BIDIRECTIONAL, "torch_dist"): save_without_mirror,
    (V_SHAPE, "torch"): save_with_one_chunk_model,
    (V_SHAPE, "torch_dist"): save_tied_output_once,
}


# --- load: (orig, args, model, optimizer, file, *rest) -> what Megatron's load returns ----------
# ``file`` is hooks.peek_torch_checkpoint's (keys, schedule that wrote it) for torch, else None.


def load_as_is(orig, args, model, optimizer, file, *a, **kw):
    return orig(model, optimizer, *a, **kw)


def load_into_model0(orig, args, model, optimizer, file, *a, **kw):
    """dualpipe, torch: 1F1B's file into ``model[0]`` and its optimizer state, then the mirrors."""
    state = _state(model, optimizer)
    result = orig(list(model)[:1], None if optimizer is None else state.torch_view(saving=False), *a, **kw)
    state.sync_mirrors()
    return result


def load_then_sync_mirrors(orig, args, model, optimizer, file, *a, **kw):
    """dualpipe, torch_dist: every replica reads its stage's shards (the distributed optimizer's
    buffer-keyed state: model[0]'s buffers), then the mirrors are synced from the home copies."""
    state = _state(model, optimizer)
    with state.torch_dist_view() as view, exact_offsets(optimizer):
        result = orig(model, view, *a, **kw)
    state.sync_mirrors()
    return result


def load_into_v_stages(orig, args, model, optimizer, file, *a, **kw):
    """dualpipev, torch: its own two-chunk file as it is; a one-chunk file cut into the V-stages."""
    if file is None or not one_chunk_file(file):
        return orig(model, optimizer, *a, **kw)
    with dualpipev_layers.cut_into_v_stages(model):
        return orig(model, optimizer, *a, **kw)


#: What Megatron's torch_dist load says when the distributed optimizer's dp_reshardable state
#: (keyed by grad buffer) was written for other buffers than this rank's.
_OTHER_BUFFERS = ("Global shape mismatch", "optimizer.distributed.")


def load_reshardable_state(orig, args, model, optimizer, file, *a, **kw):
    """dualpipev, torch_dist: as Megatron loads, at the save's offsets; another layout's dp_reshardable
    optimizer state is refused in one line naming the fix, instead of DCP's shape-mismatch traceback."""
    try:
        with exact_offsets(optimizer):
            return orig(model, optimizer, *a, **kw)
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or not all(text in str(err) for text in _OTHER_BUFFERS):
            raise
        raise Refusal(
            f"--pipeline-schedule {registry.DUALPIPEV}: this torch_dist checkpoint's distributed-optimizer state "
            "(dp_reshardable) was written for another pipeline layout's grad buffers: save it with "
            "--dist-ckpt-optim-fully-reshardable, or load with --no-load-optim") from None


LOAD: Dict[Tuple[str, str], Callable] = {
    (BIDIRECTIONAL, "torch"): load_into_model0,
    (BIDIRECTIONAL, ANY_FORMAT): load_then_sync_mirrors,
    (V_SHAPE, "torch"): load_into_v_stages,
    (V_SHAPE, "torch_dist"): load_reshardable_state,
}


def save_strategy(schedule: str, fmt: str) -> Callable:
    return SAVE.get((registry.spec(schedule).layout_kind, fmt), save_as_is)


def load_strategy(schedule: str, fmt: str) -> Callable:
    kind_ = registry.spec(schedule).layout_kind
    return LOAD.get((kind_, fmt)) or LOAD.get((kind_, ANY_FORMAT)) or load_as_is


def refuse_unreadable_format(model, fmt: str) -> None:
    """A --load whose format the optimizer view of the way the copies are summed cannot read."""
    way = copies.of(model)
    formats = way.checkpoint_view(HomeCopyState, PerStageState).formats
    if formats is not None and fmt not in formats:
        raise Refusal(f"{way.way.flag} loads --ckpt-format {' and '.join(formats)} checkpoints, this one is {fmt}: "
                      f"convert it under --pipeline-schedule 1f1b, or remove {way.way.flag}")


def one_chunk_file(file) -> bool:
    """A torch-format file in 1F1B's layout (``model``, no ``model0``/``model1``)."""
    return not ("model0" in file[0] and "model1" in file[0])


def refuse_optimizer_across_layouts(args, optimizer, schedule: str, file) -> None:
    """A load that remaps DualPipeV <-> 1F1B layers cannot take the per-stage optimizer state (refused first)."""
    if file is None or optimizer is None or args.no_load_optim or args.finetune:
        return
    _, saved = file
    crosses = (schedule == registry.DUALPIPEV) != (saved == registry.DUALPIPEV) or (
        schedule == registry.DUALPIPEV and one_chunk_file(file))
    if crosses:
        raise Refusal(
            f"--pipeline-schedule {schedule} can load the weights of this --ckpt-format torch checkpoint (written by "
            f"--pipeline-schedule {saved}), remapped to its stages, but not its optimizer state, which is laid out per "
            "stage: pass --no-load-optim (or --finetune)")
