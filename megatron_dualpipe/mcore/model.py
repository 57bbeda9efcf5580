"""Build the two model chunks of a DualPipe / DualPipeV rank with megatron-core.

On pipeline rank ``i`` of ``pp``: DualPipe's ``model[0]`` is stage ``i`` and ``model[1]`` the mirrored copy of
stage ``pp-1-i`` (the copies start equal, `broadcast_mirrors`, and stay equal by summing their gradients);
DualPipeV's ``model[0]`` is V-stage ``i`` and ``model[1]`` V-stage ``2pp-1-i`` (no copies). megatron-core
derives a chunk's layer offset, ends and tied-embedding setup from ``pg_collection.pp``, so ``model[1]`` is
built with the *reversed* pipeline group (for DualPipeV: megatron's interleaved layout, vp_stage 1, hence
`dualpipev_config`), and with ``embd=None``, so that megatron's constructor all-reduce of a tied output weight
skips it: DualPipe's mirrors are filled by `broadcast_mirrors`, DualPipeV's output weight copied locally.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..schedule.layout import BIDIRECTIONAL, V_SHAPE  # re-exported: the layouts' one definition
from .. import hooks
from . import bd_pairs, groups

__all__ = ["build_two_direction_model", "broadcast_mirrors", "mark_mirror_shared", "dualpipev_config",
           "unwrap_chunk", "chunk_info", "embedding_copy", "BIDIRECTIONAL", "V_SHAPE"]

# Attributes set on every chunk (and on its wrapper) by build_two_direction_model.
_INFO_ATTR = "dualpipe_chunk_info"


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of a chunk wrapped in DDP / Float16Module (``.module`` chain)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def chunk_info(chunk: torch.nn.Module) -> Optional[dict]:
    """``{"layout", "direction", "stage", "num_stages"}`` recorded by `build_two_direction_model`,
    looked up through wrappers; None for chunks built elsewhere."""
    while chunk is not None:
        info = getattr(chunk, _INFO_ATTR, None)
        if info is not None:
            return info
        inner = getattr(chunk, "module", None)
        chunk = inner if isinstance(inner, torch.nn.Module) else None
    return None


def describe_chunks(model: Sequence[torch.nn.Module]) -> str:
    """One line saying which stage, layers and ends each chunk of this rank holds, e.g.
    ``model[0] stage 0/4 layers 1-2 +embedding; model[1] stage 3/4 layers 7-8 +output +mtp``."""
    parts = []
    for c, chunk in enumerate(model):
        info, inner = chunk_info(chunk), unwrap_chunk(chunk)
        layers = [layer.layer_number for layer in getattr(getattr(inner, "decoder", None), "layers", [])]
        where = f"stage {info['stage']}/{info['num_stages']} " if info else ""
        span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
        ends = (" +embedding" if getattr(inner, "pre_process", False) else "") + \
            (" +output" if getattr(inner, "post_process", False) else "") + \
            (" +mtp" if getattr(inner, "mtp_process", False) else "")
        parts.append(f"model[{c}] {where}{span}{ends}")
    return "; ".join(parts)


def dualpipev_config(config):
    """A copy of a ``TransformerConfig`` with ``virtual_pipeline_model_parallel_size=2``, as DualPipeV chunks
    are built; the combined step's flags are carried over without the config's checks running again."""
    import dataclasses

    from .options import COMBINED_STEP_FLAGS

    flags = {name: getattr(config, name, False) for name in COMBINED_STEP_FLAGS}
    copy_ = dataclasses.replace(config, virtual_pipeline_model_parallel_size=2, **{name: False for name in flags})
    for name, value in flags.items():
        setattr(copy_, name, value)
    return copy_


def _mirror_parallel_state(rev_rank: int, rev_ranks: Sequence[int], rev_group):
    """parallel_state's pipeline rank, ranks and group are the reversed group's inside the block: a module
    megatron-core builds without the chunk's ``pg_collection`` asks it (at 0.16.1 the MTP layer's transformer
    layer, numbered 3 instead of 1F1B's 9 from the physical rank)."""
    return hooks.scoped(hooks.entry("scoped", "_MPU_PIPELINE_MODEL_PARALLEL_RANK").to(rev_rank),
                        hooks.entry("scoped", "_PIPELINE_GLOBAL_RANKS").to(list(rev_ranks)),
                        hooks.entry("scoped", "_PIPELINE_MODEL_PARALLEL_GROUP").to(rev_group))


def _v_stages_in_parallel_state(layout_kind: str):
    """DualPipeV: parallel_state says two virtual stages while the chunks are built, so that megatron-core's
    ``PipelineParallelLayerLayout`` (which otherwise takes ``vp_stage`` as 0) gives V-stage ``2pp-1-i`` its layers."""
    if layout_kind != V_SHAPE:
        return contextlib.nullcontext()
    return hooks.scoped(hooks.entry("scoped", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE").to(2))


def _expected_first_layer(chunk, pp_rank: int, vp_stage: Optional[int]) -> int:
    """1-based number of the stage's first decoder layer by megatron-core's own ``get_transformer_layer_offset``;
    called in the parallel_state scope the chunk was built in (a layout reads the rank there)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(unwrap_chunk(chunk).config, vp_stage, pp_rank) + 1


def _check_chunk(chunk, kind: str, direction: int, stage: int, num_stages: int, expected: int) -> None:
    config = chunk.config
    vp = config.virtual_pipeline_model_parallel_size
    if kind == V_SHAPE and vp != 2:
        raise ValueError("DualPipeV chunks must be built with a config whose "
                         f"virtual_pipeline_model_parallel_size is 2 (got {vp}); build it with "
                         "megatron_dualpipe.mcore.model.dualpipev_config(config)")
    if kind == BIDIRECTIONAL and vp is not None and vp > 1:
        raise ValueError(f"DualPipe chunks must be built without a virtual pipeline (config has "
                         f"virtual_pipeline_model_parallel_size={vp})")
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is not None and len(layers) and layers[0].layer_number != expected:
        raise RuntimeError(f"model[{direction}] should hold stage {stage} of {num_stages} (first layer "
                           f"{expected}) but megatron-core built layers from {layers[0].layer_number}: does the "
                           "model provider pass pg_collection and vp_stage through to GPTModel?")


def build_two_direction_model(
    model_provider: Callable[..., torch.nn.Module],
    *,
    layout_kind: str = BIDIRECTIONAL,
    wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
    pg_collection=None,
) -> List[torch.nn.Module]:
    """Build ``[model_dir0, model_dir1]`` for this rank (collective over all ranks; needs
    `groups.build_bd_groups()`; the chunks' arguments: `_chunk_arguments`).

    ``model_provider(pre_process=, post_process=, pg_collection=, vp_stage=)`` is called for ``model[0]``, then
    for ``model[1]``, on every rank, so that constructor collectives match; it must pass ``pg_collection`` and
    ``vp_stage`` through to ``GPTModel`` (megatron's own providers do). ``pg_collection`` defaults to
    ``ProcessGroupCollection.use_mpu_process_groups()``. Then DualPipe's mirrors are filled and marked
    (`mark_mirror_shared`), DualPipeV's tied output weight set to the embedding, and ``wrap(chunk)`` (e.g.
    Megatron DDP) applied, model[0] first; every chunk and wrapper carries its `chunk_info`.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if layout_kind not in (BIDIRECTIONAL, V_SHAPE):
        raise ValueError(f"layout_kind must be {BIDIRECTIONAL!r} or {V_SHAPE!r}, got {layout_kind!r}")
    rev_group = groups.get_reversed_pp_group()
    pp_ranks = groups.get_pp_global_ranks()
    pp = len(pp_ranks)
    i = pp_ranks.index(dist.get_rank())
    if layout_kind == V_SHAPE and pp < 2:
        raise NotImplementedError("DualPipeV needs a pipeline of at least 2 ranks")

    base = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    (pg0, kwargs0), (pg1, kwargs1), stages, num_stages = _chunk_arguments(layout_kind, base, rev_group, pp, i)
    with _v_stages_in_parallel_state(layout_kind):
        model0 = model_provider(pg_collection=pg0, **kwargs0)
        first = [_expected_first_layer(model0, i, kwargs0["vp_stage"])]
        with _mirror_parallel_state(pp - 1 - i, list(reversed(pp_ranks)), rev_group):
            model1 = model_provider(pg_collection=pg1, **kwargs1)
            first.append(_expected_first_layer(model1, pp - 1 - i, kwargs1["vp_stage"]))
    model = [model0, model1]
    for d, (chunk, stage) in enumerate(zip(model, stages)):
        _check_chunk(unwrap_chunk(chunk), layout_kind, d, stage, num_stages, first[d])
        setattr(chunk, _INFO_ATTR, dict(layout=layout_kind, direction=d, stage=stage, num_stages=num_stages))

    if layout_kind == BIDIRECTIONAL:
        broadcast_mirrors(model)
        mark_mirror_shared(model[1])
    else:
        _tie_v_output_weight(model)

    if wrap is None:
        return model
    wrapped = [wrap(chunk) for chunk in model]  # model[0] first
    for chunk, w in zip(model, wrapped):
        setattr(w, _INFO_ATTR, chunk_info(chunk))
    return wrapped


def _chunk_arguments(layout_kind: str, base, rev_group, pp: int, i: int):
    """((pg_collection, provider keywords) of each chunk, their stages, the number of stages). model[1] gets the
    reversed group and ``embd`` None; DualPipeV's chunks are vp_stage 0 and 1, the loss on rank 0's model[1]."""
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    pg0, pg1 = copy.copy(base), copy.copy(base)
    pg1.pp, pg1.embd = rev_group, None
    if layout_kind == BIDIRECTIONAL:
        kwargs0 = dict(pre_process=is_pp_first_stage(pg0.pp), post_process=is_pp_last_stage(pg0.pp), vp_stage=None)
        kwargs1 = dict(pre_process=is_pp_first_stage(rev_group), post_process=is_pp_last_stage(rev_group), vp_stage=None)
        return (pg0, kwargs0), (pg1, kwargs1), (i, pp - 1 - i), pp
    pg0.embd = None
    kwargs0 = dict(pre_process=is_pp_first_stage(pg0.pp), post_process=False, vp_stage=0)
    kwargs1 = dict(pre_process=False, post_process=is_pp_last_stage(rev_group), vp_stage=1)
    return (pg0, kwargs0), (pg1, kwargs1), (i, 2 * pp - 1 - i), 2 * pp


def embedding_copy(chunk: torch.nn.Module):
    """("embedding", weight) for a chunk holding the input embedding, ("output", weight) for one
    holding the other copy Megatron reduces with it (the MTP stage's embedding, which is also its
    output weight when tied; else the tied output weight), or None. As Megatron's
    ``shared_embedding_or_output_weight``, which picks the same parameter; Megatron keeps the copies equal
    with tied output weights or MTP (``finalize_model_grads._get_shared_word_embedding_weight``)."""
    m = unwrap_chunk(chunk)
    if not (getattr(m, "share_embeddings_and_output_weights", False)
            or getattr(getattr(m, "config", None), "mtp_num_layers", None)):
        return None
    if getattr(m, "pre_process", False):
        return "embedding", m.embedding.word_embeddings.weight
    if getattr(m, "mtp_process", False):
        return "output", m.embedding.word_embeddings.weight
    if getattr(m, "post_process", False) and getattr(m, "share_embeddings_and_output_weights", False):
        w = m.output_layer.weight
        return ("output", w) if w is not None else None
    return None


def _tie_v_output_weight(model: Sequence[torch.nn.Module]) -> None:
    """DualPipeV: on the rank holding stage 0 (embedding) and stage 2pp-1, set stage 2pp-1's copy
    of the word embedding (`embedding_copy`: the tied output weight, or the MTP block's embedding)
    to the embedding. Megatron zero-fills that copy and, with ``embd=None``, does not all-reduce."""
    m0, found = unwrap_chunk(model[0]), embedding_copy(model[1])
    if found is None or found[0] != "output" or not m0.pre_process:
        return
    out = found[1]
    with torch.no_grad():
        out.copy_(m0.embedding.word_embeddings.weight)
    # Megatron sets these when pp > 1 (post_process and not pre_process); make sure.
    out.shared = True
    out.shared_embedding = True


def broadcast_mirrors(model: Sequence[torch.nn.Module]) -> None:
    """Copy every parameter of ``model[0]`` on pipeline rank i into ``model[1]`` on rank pp-1-i (collective
    within each bd pair; the partners first compare the stage's (name, shape, dtype) lists). Not buffers."""
    if len(model) != 2:
        raise ValueError(f"broadcast_mirrors needs the two chunks [model_dir0, model_dir1], got {len(model)}")
    info = chunk_info(model[0])
    if info is not None and info["layout"] != BIDIRECTIONAL:
        raise ValueError(f"broadcast_mirrors is for DualPipe's mirrored copies; layout is {info['layout']!r}")
    bd_pairs.broadcast_home_to_mirror(
        model, lambda chunk: [p.data for p in unwrap_chunk(chunk).parameters()], "parameters",
        signature_of=lambda chunk: [(n, tuple(p.shape), str(p.dtype))
                                    for n, p in unwrap_chunk(chunk).named_parameters()])


#: On the mirror's module: names of the parameters Megatron itself had marked ``shared``.
MEGATRON_SHARED_ATTR = "_dualpipe_megatron_shared"


def mark_mirror_shared(chunk: torch.nn.Module) -> None:
    """Set ``param.shared = True`` on every parameter of the mirrored copy ``model[1]``, so that megatron-core
    leaves the mirror out of the gradient norm and zero count (``param_is_not_shared``). The optimizers copy
    the mark onto their main params, so this runs before ``get_megatron_optimizer``. Megatron-LM's
    ``calc_params_l2_norm`` asserts expert params are not shared: MoE with ``--log-params-norm`` trips it."""
    inner = unwrap_chunk(chunk)
    # Megatron's own marks (the tied output weight of a last stage), which the shared shard group's
    # optimizer keeps on the mirror's shards (mcore.copies.shared_shard.megatron_marks).
    setattr(inner, MEGATRON_SHARED_ATTR, frozenset(n for n, p in inner.named_parameters() if getattr(p, "shared", False)))
    for p in inner.parameters():
        p.shared = True
