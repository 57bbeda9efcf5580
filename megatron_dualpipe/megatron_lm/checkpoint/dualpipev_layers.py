"""DualPipeV ``--ckpt-format torch`` checkpoints that 1F1B reads, and 1F1B checkpoints that DualPipeV reads:
1F1B's stage ``t`` is V-stages ``2t`` and ``2t+1`` (the weights renamed by local layer index; another
split fails on the keys, never silently). The transfers are walked in one fixed order on every rank
(blocking object send/recv), so they cannot deadlock.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from ...mcore.model import chunk_info, unwrap_chunk
from .megatron_io import generated_state_dict_edited, loaded_state_dict_edited

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def v_stage_owner(v: int, pp: int) -> Tuple[int, int]:
    """(pipeline rank, chunk) holding V-stage ``v`` of ``2*pp``."""
    return (v, 0) if v < pp else (2 * pp - 1 - v, 1)


def split_stage(sd: Dict[str, object], t: int, first: int) -> Dict[int, Dict[str, object]]:
    """1F1B stage ``t``'s state dict -> ``{v: V-stage v's state dict}`` for v in (2t, 2t+1), V-stage
    ``2t`` holding the stage's ``first`` layers."""
    out: Dict[int, Dict[str, object]] = {2 * t: {}, 2 * t + 1: {}}
    for key, value in sd.items():
        m = _LAYER.match(key)
        if m:
            k = int(m.group(1))
            second = k >= first
            out[2 * t + second][f"decoder.layers.{k - first * second}.{m.group(2)}"] = value
        else:  # the embedding begins stage 0; the final norm, the output layer and MTP (with its copy of
            # the embedding, on the last stage) end theirs
            out[2 * t if key.startswith("embedding.") and t == 0 else 2 * t + 1][key] = value
    return out


def join_stage(pieces: Dict[int, Dict[str, object]], t: int, first: int) -> Dict[str, object]:
    """Inverse of `split_stage`: V-stages 2t (``first`` layers) and 2t+1 -> 1F1B stage ``t``'s state dict."""
    sd: Dict[str, object] = {}
    for v in (2 * t, 2 * t + 1):
        for key, value in pieces[v].items():
            m = _LAYER.match(key)
            sd[f"decoder.layers.{(v - 2 * t) * first + int(m.group(1))}.{m.group(2)}" if m else key] = value
    return sd


def route(pieces: Dict[int, Dict[str, object]], src_of: Callable[[int], int], dest_of: Callable[[int], int],
          pp: int) -> Dict[int, Dict[str, object]]:
    """Move every V-stage's state dict from pipeline rank ``src_of(v)`` to ``dest_of(v)``, in V-stage
    order (tensors on the CPU); return the pieces that arrive here. Collective over the pipeline group."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    received: Dict[int, Dict[str, object]] = {}
    for v in range(2 * pp):
        src, dst = src_of(v), dest_of(v)
        if src == dst == me:
            received[v] = pieces[v]
        elif src == me:
            on_cpu = {k: (t.detach().cpu() if torch.is_tensor(t) else t) for k, t in pieces[v].items()}
            dist.send_object_list([on_cpu], dst=ranks[dst], group=group)
        elif dst == me:
            box = [None]
            dist.recv_object_list(box, src=ranks[src], group=group)
            received[v] = box[0]
    return received


def geometry(model) -> Tuple[int, int, Tuple[int, ...]]:
    """(pipeline rank, pp, layers of every V-stage as built) of a DualPipeV model (collective)."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    mine = {chunk_info(c)["stage"]: len(unwrap_chunk(c).decoder.layers) for c in model}
    every: List[Dict[int, int]] = [{} for _ in range(pp)]
    dist.all_gather_object(every, mine, group=parallel_state.get_pipeline_model_parallel_group())
    sizes = {v: n for held in every for v, n in held.items()}
    return parallel_state.get_pipeline_model_parallel_rank(), pp, tuple(sizes[v] for v in range(2 * pp))


def one_chunk_model_added(model):
    """Within the block, Megatron's save also writes ``model``: 1F1B stage ``i``'s weights (collective)."""
    me, pp, sizes = geometry(model)
    pieces = {chunk_info(c)["stage"]: c.state_dict_for_save_checkpoint() for c in model}
    one_chunk = join_stage(route(pieces, lambda v: v_stage_owner(v, pp)[0], lambda v: v // 2, pp), me, sizes[2 * me])
    return generated_state_dict_edited(lambda sd: sd.__setitem__("model", one_chunk))


def cut_into_v_stages(model):
    """Within the block, Megatron's load cuts ``model0``/``model1`` out of a 1F1B file's ``model`` (collective)."""
    me, pp, sizes = geometry(model)

    def cut(sd):
        if "model" in sd and "model0" not in sd:  # 1F1B's stage ``me`` cut into this rank's V-stages
            pieces = split_stage(sd.pop("model"), me, sizes[2 * me])
            got = route(pieces, lambda v: v // 2, lambda v: v_stage_owner(v, pp)[0], pp)
            sd["model0"], sd["model1"] = got[me], got[2 * pp - 1 - me]

    return loaded_state_dict_edited(cut)
