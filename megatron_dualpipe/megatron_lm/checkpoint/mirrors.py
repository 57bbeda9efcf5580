"""After a DualPipe load: every mirror made equal to its home copy, optimizer state included."""

import torch

from ...mcore import bd_pairs
from ...mcore.model import broadcast_mirrors, unwrap_chunk
from .optimizers import inner_optimizers, is_distributed_optimizer, main_to_model


def _params(chunk):
    """The chunk's (unwrapped) parameters, in order."""
    return list(unwrap_chunk(chunk).parameters())


def sync_mirrors(model, optimizer) -> None:
    """Home copy -> mirror over each bd pair: the parameters, the persistent buffers (a MoE router's
    ``expert_bias`` is restored only in the home copy), then every optimizer's state behind each
    parameter in order (the distributed optimizer's: this data-parallel rank's shard)."""
    broadcast_mirrors(model)
    bd_pairs.broadcast_home_to_mirror(model, persistent_buffers, "persistent buffers")
    for opt in inner_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False) or opt.optimizer is None:
            continue
        if is_distributed_optimizer(opt):
            _sync_distributed_optimizer_state(model, opt)
            continue
        state_of = _param_state_getter(opt)
        bd_pairs.broadcast_home_to_mirror(
            model, lambda chunk: [t for p in _params(chunk) for t in state_of(p)], "optimizer state")


def _sync_distributed_optimizer_state(model, opt) -> None:
    """Written back through Megatron's setter: its getter may return copies (the precision-aware optimizer)."""
    fetched = {}

    def tensors_of(chunk):
        out = []
        for p in _params(chunk):
            if p in opt.model_param_group_index_map:  # else: no shard of it on this data-parallel rank
                st = opt._get_main_param_and_optimizer_states(p)
                fetched[p] = st
                out.extend(st[k] for k in sorted(st) if torch.is_tensor(st[k]))
        return out

    bd_pairs.broadcast_home_to_mirror(model, tensors_of, "distributed optimizer state")
    with torch.no_grad():
        for p, st in fetched.items():
            opt._set_main_param_and_optimizer_states(p, st)


def persistent_buffers(chunk):
    """The chunk's floating-point buffers that its state dict saves, in module order."""
    return [b for m in unwrap_chunk(chunk).modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set and b.is_floating_point()]


def _param_state_getter(opt):
    """``param -> [tensors]``: its fp32 main parameter (when another tensor), then its optimizer state by key."""
    mains = {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
    model_to_main = {id(model_p): mains[main_id] for main_id, model_p in main_to_model(opt).items()}

    def of(p):
        main = model_to_main.get(id(p))
        if main is None:
            return []
        st = opt.optimizer.state.get(main, {})
        return ([main.data] if main is not p else []) + [st[k] for k in sorted(st) if torch.is_tensor(st[k])]
    return of
