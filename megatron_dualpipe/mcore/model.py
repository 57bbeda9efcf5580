"""Build the two model chunks of a DualPipe / DualPipeV rank with megatron-core.

On pipeline rank ``i`` of ``pp`` (see ``megatron_dualpipe.schedule.layout``):

* ``layout_kind="bidirectional"`` (DualPipe): ``model[0]`` is stage ``i`` of direction 0 and
  ``model[1]`` is the *mirrored copy* of stage ``pp-1-i`` (direction 1 runs from rank ``pp-1``
  down to rank 0). Every stage exists twice, once as ``model[0]`` on its home rank ``s`` and
  once as ``model[1]`` on rank ``pp-1-s``; the copies start equal (`broadcast_mirrors`) and
  are kept equal by summing their gradients (``finalize.allreduce_bd_grads``).
* ``layout_kind="v"`` (DualPipeV): one route of ``2*pp`` stages; ``model[0]`` is stage ``i``
  and ``model[1]`` is stage ``2*pp-1-i``. There are no copies, so no broadcast and no
  ``shared`` marks.

How megatron-core is made to build the right layers for ``model[1]``: megatron-core 0.16.1
derives the layer offset, the number of layers, ``pre_process``/``post_process`` checks and
the tied-embedding setup from ``pg_collection.pp`` (``get_pg_rank``). ``model[1]`` is built
with a copy of the ``ProcessGroupCollection`` whose ``pp`` is the *reversed* pipeline group of
``groups.build_bd_groups`` (group rank ``pp-1-i`` on rank ``i``):

* DualPipe: the reversed rank ``pp-1-i`` is exactly the mirrored stage; ``vp_stage=None``.
* DualPipeV: the ``2*pp`` stages are megatron's interleaved layout with two virtual stages:
  stage ``s < pp`` is (vp_stage 0, pp rank ``s``) and stage ``2*pp-1-i`` is (vp_stage 1,
  pp rank ``pp-1-i``), i.e. vp_stage 1 on the reversed group. The chunks are therefore built
  with ``vp_stage=0`` (physical group) and ``vp_stage=1`` (reversed group) and **the model
  config must have** ``virtual_pipeline_model_parallel_size=2`` (use `dualpipev_config` to make
  one). megatron-core's ``parallel_state`` must *not* be initialised with a virtual pipeline:
  only the config carries it.

While ``model[1]`` is built, ``parallel_state.get_pipeline_model_parallel_rank()`` (the rank
override ``_MPU_PIPELINE_MODEL_PARALLEL_RANK``) returns ``pp-1-i`` and the pipeline's global
rank list is reversed, for provider code that still asks ``parallel_state`` (e.g. megatron's
``gpt_builder`` slicing MoE / heterogeneous layer specs via ``get_gpt_decoder_block_spec``
without ``pp_rank``). Both are restored afterwards.

Embedding group: ``model[1]`` gets ``pg_collection.embd = None``, so megatron's constructor
all-reduce that initialises a tied output weight from the embedding is skipped for it (with
the reversed group it would be skipped anyway; None makes that independent of the ranks'
first/last positions). For DualPipe ``model[0]`` keeps the physical embedding group: rank
``pp-1``'s ``model[0]`` output weight is initialised from rank 0's embedding as usual, and
`broadcast_mirrors` copies both into the ``model[1]`` copies. For DualPipeV the embedding and
the (tied) output layer are both on rank 0, so both chunks get ``embd=None`` and the output
weight is copied locally from the embedding after construction.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..schedule.layout import BIDIRECTIONAL, V_SHAPE  # re-exported: the layouts' one definition
from . import bd_pairs, groups

__all__ = [
    "build_two_direction_model",
    "broadcast_mirrors",
    "mark_mirror_shared",
    "dualpipev_config",
    "unwrap_chunk",
    "chunk_info",
    "embedding_copy",
    "BIDIRECTIONAL",
    "V_SHAPE",
]

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
    """A copy of a ``TransformerConfig`` with ``virtual_pipeline_model_parallel_size=2``, as
    DualPipeV chunks must be built with (see the module docstring). ``num_layers`` must be
    divisible by ``2 * pipeline_model_parallel_size``. The combined step's flags
    (``mcore.overlap.enable_combined_step``) are carried over, not checked again."""
    import dataclasses

    from .options import COMBINED_STEP_FLAGS

    flags = {name: getattr(config, name, False) for name in COMBINED_STEP_FLAGS}
    copy_ = dataclasses.replace(config, virtual_pipeline_model_parallel_size=2, **{name: False for name in flags})
    for name, value in flags.items():
        setattr(copy_, name, value)
    return copy_


def _mirror_parallel_state(rev_rank: int, rev_ranks: Sequence[int], rev_group):
    """parallel_state answers rank queries for the reversed pipeline group inside the block, and its
    pipeline group is that group: a module megatron-core builds without the chunk's
    ``pg_collection`` takes parallel_state's groups (at 0.16.1 the MTP layer's transformer layer:
    numbered from the physical rank it was 3 instead of 1F1B's 9). ``hooks.scoped`` entries of the
    hooks manifest."""
    from .. import hooks

    return hooks.scoped(hooks.entry("scoped", "_MPU_PIPELINE_MODEL_PARALLEL_RANK").to(rev_rank),
                        hooks.entry("scoped", "_PIPELINE_GLOBAL_RANKS").to(list(rev_ranks)),
                        hooks.entry("scoped", "_PIPELINE_MODEL_PARALLEL_GROUP").to(rev_group))


def _v_stages_in_parallel_state(layout_kind: str):
    """DualPipeV: parallel_state says two virtual stages while the chunks are built, so that
    megatron-core's ``PipelineParallelLayerLayout`` (which otherwise takes ``vp_stage`` as 0) gives
    V-stage ``2pp-1-i`` its layers; nothing else megatron-core builds asks it."""
    import contextlib

    from .. import hooks

    if layout_kind != V_SHAPE:
        return contextlib.nullcontext()
    return hooks.scoped(hooks.entry("scoped", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE").to(2))


def _expected_first_layer(chunk, pp_rank: int, vp_stage: Optional[int]) -> int:
    """1-based global number of the first decoder layer of the stage at (``pp_rank``, ``vp_stage``), by
    megatron-core's own ``get_transformer_layer_offset`` (even and uneven splits, layouts). Called in
    the parallel_state scope the chunk was built in: a layout reads the rank from there."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(unwrap_chunk(chunk).config, vp_stage, pp_rank) + 1


def _check_chunk(chunk, kind: str, direction: int, stage: int, num_stages: int, expected: int) -> None:
    config = chunk.config
    vp = config.virtual_pipeline_model_parallel_size
    if kind == V_SHAPE and vp != 2:
        raise ValueError(
            "DualPipeV chunks must be built with a config whose "
            f"virtual_pipeline_model_parallel_size is 2 (got {vp}); build it with "
            "megatron_dualpipe.mcore.model.dualpipev_config(config)"
        )
    if kind == BIDIRECTIONAL and vp is not None and vp > 1:
        raise ValueError(
            f"DualPipe chunks must be built without a virtual pipeline (config has "
            f"virtual_pipeline_model_parallel_size={vp})"
        )
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is not None and len(layers):
        got = layers[0].layer_number
        if got != expected:
            raise RuntimeError(
                f"model[{direction}] should hold stage {stage} of {num_stages} (first layer "
                f"{expected}) but megatron-core built layers from {got}: does the model "
                "provider pass pg_collection and vp_stage through to GPTModel?"
            )


def build_two_direction_model(
    model_provider: Callable[..., torch.nn.Module],
    *,
    layout_kind: str = BIDIRECTIONAL,
    wrap: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
    pg_collection=None,
) -> List[torch.nn.Module]:
    """Build ``[model_dir0, model_dir1]`` for this rank (collective over all ranks).

    ``model_provider`` is called twice, always with keyword arguments only::

        model_provider(pre_process=bool, post_process=bool, pg_collection=ProcessGroupCollection,
                       vp_stage=Optional[int])

    first for ``model[0]`` (on every rank), then for ``model[1]`` (on every rank), so that
    constructor collectives match across ranks. It must pass ``pg_collection`` and
    ``vp_stage`` through to ``GPTModel`` (megatron's own providers do). The arguments:

    =============  =================================  ==================================
    layout_kind    model[0]                           model[1]
    =============  =================================  ==================================
    bidirectional  stage i: pp = physical group,      stage pp-1-i: pp = reversed group,
                   pre = (i == 0), post = (i == pp-1) pre = (i == pp-1), post = (i == 0),
                   vp_stage None                      embd None, vp_stage None
    v              stage i: pp = physical group,      stage 2pp-1-i: pp = reversed group,
                   embd None, pre = (i == 0),         embd None, pre = False,
                   post = False, vp_stage 0           post = (i == 0), vp_stage 1
    =============  =================================  ==================================

    (``pg_collection`` defaults to ``ProcessGroupCollection.use_mpu_process_groups()``; pass one
    to override the base collection.) For ``"v"`` the provider's config must have
    ``virtual_pipeline_model_parallel_size=2`` (`dualpipev_config`).

    Then, for DualPipe: `broadcast_mirrors` (model[0] on rank i -> model[1] on rank pp-1-i) and
    `mark_mirror_shared` on ``model[1]``; for DualPipeV with tied embeddings: the output weight
    on rank 0 is set to the embedding. Finally ``wrap(chunk)`` (e.g. Megatron DDP) is applied
    to each chunk, model[0] first. Each chunk (and its wrapper) gets a
    ``dualpipe_chunk_info`` dict (`chunk_info`) that `grads` uses.

    Needs `groups.build_bd_groups()` to have run.
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

    return model if wrap is None else _wrapped(model, wrap)


def _wrapped(model: List[torch.nn.Module], wrap: Callable) -> List[torch.nn.Module]:
    """``wrap(chunk)`` of each chunk, model[0] first, the wrapper given the chunk's info."""
    wrapped = []
    for chunk in model:
        w = wrap(chunk)
        if w is not chunk:
            setattr(w, _INFO_ATTR, chunk_info(chunk))
        wrapped.append(w)
    return wrapped


def _chunk_arguments(layout_kind: str, base, rev_group, pp: int, i: int):
    """((pg_collection, provider keywords) of model[0], the same of model[1], their stages, the
    number of stages): the table of :func:`build_two_direction_model`'s docstring."""
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


def keeps_embedding_equal(m: torch.nn.Module) -> bool:
    """Whether Megatron keeps copies of this model's word embedding equal over its embedding group:
    tied output weights, or multi-token prediction (the MTP stage's own embedding copy, even with
    untied output weights: ``finalize_model_grads._get_shared_word_embedding_weight``)."""
    config = getattr(m, "config", None)
    return bool(getattr(m, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", None))


def embedding_copy(chunk: torch.nn.Module):
    """("embedding", weight) for a chunk holding the input embedding, ("output", weight) for one
    holding the other copy Megatron reduces with it (the MTP stage's embedding, which is also its
    output weight when tied; else the tied output weight), or None. As Megatron's
    ``shared_embedding_or_output_weight``, which picks the same parameter."""
    m = unwrap_chunk(chunk)
    if not keeps_embedding_equal(m):
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


def _named_params(chunk: torch.nn.Module) -> "OrderedDict[str, torch.nn.Parameter]":
    return OrderedDict(unwrap_chunk(chunk).named_parameters())


def _signature(params: "OrderedDict[str, torch.nn.Parameter]"):
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in params.items()]


def _require_bidirectional(model: Sequence[torch.nn.Module], what: str) -> None:
    if len(model) != 2:
        raise ValueError(f"{what} needs the two chunks [model_dir0, model_dir1], got {len(model)}")
    info = chunk_info(model[0])
    if info is not None and info["layout"] != BIDIRECTIONAL:
        raise ValueError(f"{what} is for DualPipe's mirrored copies; layout is {info['layout']!r}")


def broadcast_mirrors(model: Sequence[torch.nn.Module]) -> None:
    """Copy every parameter of ``model[0]`` on pipeline rank i into ``model[1]`` on rank pp-1-i.

    Collective within each bd pair. Both partners walk the pair's two stages in stage order
    (stage min(i, pp-1-i) first); for each stage the home rank (``model[0]``) is the source and
    the partner's ``model[1]`` receives, one broadcast per dtype of the flattened parameters in
    ``named_parameters`` order. Before that, the partners exchange the (name, shape, dtype)
    lists of each stage and raise if they differ (instead of hanging or mixing tensors up). On
    the middle rank of an odd pipeline the copy is local. Only parameters are copied, not
    buffers.
    """
    _require_bidirectional(model, "broadcast_mirrors")
    bd_pairs.broadcast_home_to_mirror(model, lambda chunk: [p.data for p in _named_params(chunk).values()],
                                      "parameters", signature_of=lambda chunk: _signature(_named_params(chunk)))


#: On the mirror's module: names of the parameters Megatron itself had marked ``shared``.
MEGATRON_SHARED_ATTR = "_dualpipe_megatron_shared"


def mark_mirror_shared(chunk: torch.nn.Module) -> None:
    """Set ``param.shared = True`` on every parameter of the mirrored copy ``model[1]``.

    megatron-core counts a parameter in the gradient norm and zero count only if
    ``param_is_not_shared(param)`` (``not getattr(param, 'shared', False)``,
    ``transformer/module.py``; used by ``MegatronOptimizer.get_main_grads_for_grad_norm`` and
    ``clip_grads.count_zeros_fp32``), and the optimizers copy ``shared`` onto their main
    params when they are constructed, so this must run before ``get_megatron_optimizer``.
    Megatron-LM's ``calc_params_l2_norm`` (``--log-params-norm``) skips shared params too, but
    asserts that expert params (``allreduce=False``) are not shared: with MoE and
    ``--log-params-norm`` this mark trips that assert.
    """
    inner = unwrap_chunk(chunk)
    # Megatron's own marks (the tied output weight of a last stage), which the shared shard group's
    # optimizer keeps on the mirror's shards (mcore.copies.shared_shard.megatron_marks).
    setattr(inner, MEGATRON_SHARED_ATTR, frozenset(n for n, p in inner.named_parameters() if getattr(p, "shared", False)))
    for p in inner.parameters():
        p.shared = True
