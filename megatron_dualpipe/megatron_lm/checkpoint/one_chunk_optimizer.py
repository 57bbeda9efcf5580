"""``--ckpt-format torch`` under DualPipe: the optimizer seen as 1F1B's one-chunk optimizer, model[0]'s
state re-indexed as a one-chunk run indexes it; at load the mirror's entries are zero placeholders
that ``mirrors.sync_mirrors`` overwrites from the home copy."""

import torch

from ..refusal import Refusal
from .optimizers import (home_buffers, inner_optimizers, is_distributed_optimizer, kind, main_to_model,
                         param_group_key as _group_key)


def _masks(opt, keep_ids):
    """Per torch param group: which of its (main) params belong to a kept model param."""
    to_model = main_to_model(opt)
    return [[id(to_model[id(p)]) in keep_ids for p in g["params"]] for g in opt.optimizer.param_groups]


def _torch_sd(opt, sd):
    return sd if kind(opt) == "fp32" else sd["optimizer"]


def filter_state_dict(opt, sd, keep_ids):
    """``opt.state_dict()`` restricted to the params of ``keep_ids`` (model params), re-indexed;
    param groups left empty are dropped (a one-chunk optimizer would not have them)."""
    tsd = _torch_sd(opt, sd)
    masks = _masks(opt, keep_ids)
    if len(masks) != len(tsd["param_groups"]):
        raise RuntimeError("optimizer state dict and optimizer disagree on the number of param groups")
    state, groups, kept, idx = {}, [], [], 0
    for gi, (group, mask) in enumerate(zip(tsd["param_groups"], masks)):
        if len(group["params"]) != len(mask):
            raise RuntimeError("optimizer state dict and optimizer disagree on a param group's size")
        params = []
        for pid, keep in zip(group["params"], mask):
            if keep:
                if pid in tsd["state"]:
                    state[idx] = tsd["state"][pid]
                params.append(idx)
                idx += 1
        if params:
            groups.append(dict(group, params=params))
            kept.append(gi)
    new_tsd = {"state": state, "param_groups": groups}
    if kind(opt) == "fp32":
        return new_tsd
    return dict(sd, optimizer=new_tsd, fp32_from_fp16_params=[
        [main for model_p, main in zip(opt.float16_groups[gi], sd["fp32_from_fp16_params"][gi]) if id(model_p) in keep_ids]
        for gi in kept])


def expand_state_dict(opt, sd, keep_ids):
    """Inverse of `filter_state_dict`: a one-chunk state dict -> this optimizer's layout. The
    parameters outside ``keep_ids`` (the mirror) get zero placeholders (`sync_mirrors` fills them)."""
    tsd = _torch_sd(opt, sd)
    saved_state = tsd["state"]
    template = next(iter(saved_state.values()), None)
    by_key = {_group_key(g): si for si, g in enumerate(tsd["param_groups"])}
    masks = _masks(opt, keep_ids)
    fp16 = kind(opt) == "fp16"
    state, groups, fp32_groups, used, idx = {}, [], [], set(), 0
    current = opt.optimizer.state_dict()["param_groups"]
    for gi, (cur, mask, live) in enumerate(zip(current, masks, opt.optimizer.param_groups)):
        n_keep = sum(mask)
        si = by_key.get(_group_key(cur)) if n_keep else None
        if n_keep and si is None:
            raise ValueError(
                f"checkpoint optimizer state has no parameter group {_group_key(cur)} (it has "
                f"{list(by_key)}): it was saved for a different model; resume with --no-load-optim")
        saved_group = tsd["param_groups"][si] if si is not None else None
        if saved_group is not None and len(saved_group["params"]) != n_keep:
            raise ValueError(
                f"checkpoint optimizer parameter group {_group_key(cur)} has {len(saved_group['params'])} "
                f"parameters, this rank's model[0] has {n_keep}: it was saved for a different model or "
                "pipeline split; resume with --no-load-optim")
        used.add(si)
        saved_ids = iter(saved_group["params"] if saved_group is not None else ())
        params = list(range(idx, idx + len(mask)))
        idx += len(mask)
        for i, p, keep in zip(params, live["params"], mask):
            if keep:
                sid = next(saved_ids)
                if sid in saved_state:
                    state[i] = saved_state[sid]
            elif template is not None:
                state[i] = {k: (torch.zeros_like(p.data, dtype=v.dtype) if torch.is_tensor(v) and v.dim() > 0
                                else v.clone() if torch.is_tensor(v) else v) for k, v in template.items()}
        groups.append(dict(saved_group if saved_group is not None else cur, params=params))
        if fp16:
            saved_mains = iter(sd["fp32_from_fp16_params"][si] if si is not None else ())
            fp32_groups.append([next(saved_mains) if id(model_p) in keep_ids else main
                                for model_p, main in zip(opt.float16_groups[gi], opt.fp32_from_float16_groups[gi])])
    unused = [i for i in range(len(tsd["param_groups"])) if i not in used]
    if unused:
        raise ValueError(
            f"checkpoint optimizer state has parameter groups this model does not have "
            f"({[_group_key(tsd['param_groups'][i]) for i in unused]}); resume with --no-load-optim")
    new_tsd = {"state": state, "param_groups": groups}
    if not fp16:
        return new_tsd
    return dict(sd, optimizer=new_tsd, fp32_from_fp16_params=fp32_groups)


class OneChunkOptimizerView:
    """Presents a DualPipe optimizer to Megatron's checkpoint code as a 1F1B (one-chunk) one."""

    def __init__(self, optimizer, keep_ids):
        self._optimizer, self._keep_ids, self._inner = optimizer, keep_ids, inner_optimizers(optimizer)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def state_dict(self):
        sds = [o.state_dict() if is_distributed_optimizer(o) else filter_state_dict(o, o.state_dict(), self._keep_ids)
               for o in self._inner]
        return sds[0] if len(sds) == 1 else sds

    def load_state_dict(self, state_dict):
        def expand(o, sd):
            return sd if is_distributed_optimizer(o) else expand_state_dict(o, sd, self._keep_ids)

        if len(self._inner) == 1:
            self._optimizer.load_state_dict(expand(self._inner[0], state_dict))
            return
        if isinstance(state_dict, dict):
            state_dict = [v for _, v in sorted(state_dict.items())]
        if len(state_dict) != len(self._inner):
            raise RuntimeError(f"expected {len(self._inner)} optimizer state dicts, got {len(state_dict)}")
        self._optimizer.load_state_dict([expand(o, s) for o, s in zip(self._inner, state_dict)])

    # The distributed optimizer's per-parameter state (--ckpt-format torch: distrib_optim.pt,
    # written on data-parallel rank 0), as ChainedOptimizer.save/load_parameter_state lay it out.

    def save_parameter_state(self, filename):
        states = [filter_parameter_state(o, o.get_parameter_state_dp_zero(), self._keep_ids) for o in self._inner]
        if self._inner[0].data_parallel_group.rank() == 0:
            torch.save(states[0] if len(states) == 1 else states, filename)

    def load_parameter_state(self, filename, *, update_legacy_format=False):
        if update_legacy_format:
            raise Refusal("--pipeline-schedule dualpipe cannot convert a legacy distributed-optimizer "
                                      "checkpoint; convert it under --pipeline-schedule 1f1b first")
        rank0 = self._inner[0].data_parallel_group.rank() == 0
        states = torch.load(filename) if rank0 else None
        if rank0 and len(self._inner) == 1:
            states = [states]
        for k, o in enumerate(self._inner):
            o.load_parameter_state_from_dp_zero(
                expand_parameter_state(o, states[k], self._keep_ids) if rank0 else None)


def filter_parameter_state(opt, state, keep_ids):
    """``get_parameter_state_dp_zero()`` of model[0]'s buffers, numbered as a one-chunk optimizer numbers them."""
    if state is None:
        return None
    out = {k: v for k, v in state.items() if not isinstance(k, int)}
    for new, old in enumerate(home_buffers(opt, keep_ids)):
        out[new] = state[old]
    return out


def expand_parameter_state(opt, state, keep_ids):
    """Inverse of `filter_parameter_state`; the mirror's buffers get zero placeholders (`sync_mirrors` fills them)."""
    home = home_buffers(opt, keep_ids)
    saved = sorted(k for k in state if isinstance(k, int))
    if len(saved) != len(home):
        raise ValueError(f"the checkpoint's distributed-optimizer state has {len(saved)} buffers, this rank's "
                         f"model[0] has {len(home)}: it was saved for a different model or pipeline split; "
                         "resume with --no-load-optim")
    out = {k: v for k, v in state.items() if not isinstance(k, int)}
    from_file = dict(zip(home, saved))
    for k, buf in enumerate(opt.buffers):
        if k in from_file:
            out[k] = state[from_file[k]]
            continue
        n = buf.numel_unpadded
        out[k] = {dtype: dict({key: torch.zeros((n,), dtype=torch.float32) for key in ("param", "exp_avg", "exp_avg_sq")},
                              numel_unpadded=n)
                  for dtype in opt.gbuf_ranges[k]}
    return out
