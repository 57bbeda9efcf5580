"""Checkpoints with ``--dualpipe-shared-shard-group`` (``torch``, and fully reshardable ``torch_dist``):
the home copy's sub-optimizers (one per stage, chained in ascending stage order) are written and read
as 1F1B's optimizer of ``model[0]``, the mirror's load the same values. ``distrib_optim.pt``: each
gathers its stage's shards to the home copy's data-parallel rank 0, in stage order (collective).
"""
from typing import Dict, List

import torch

from ..refusal import Refusal
from .optimizers import inner_optimizers, model0_ids, param_group_key


#: Where a torch_dist load puts the mirror's per-parameter state (never saved).
MIRROR_KEY = "dualpipe_mirror_param_state"


def _kind(opt, chunk) -> str:
    """``"expert"`` for the sub-optimizer of the chunk's expert-parallel buffers, else ``"dense"``."""
    experts = {id(b) for b in getattr(chunk, "expert_parallel_buffers", [])}
    return "expert" if any(id(b) in experts for b in getattr(opt, "buffers", [])) else "dense"


class SharedShardOptimizerView:
    """Presents the shared layout's chained sub-optimizers to Megatron-LM's checkpoint code (torch
    and torch_dist) as 1F1B's optimizer (module docstring)."""

    def __init__(self, optimizer, model):
        self._optimizer = optimizer
        self._subs = inner_optimizers(optimizer)  # ascending stage order: the collective order
        home_ids = model0_ids(model)
        self._home: List = []
        self._kind: Dict[int, str] = {}
        for o in self._subs:
            params = {id(p) for b in getattr(o, "buffers", []) for p in b.params}
            chunk = model[0] if params and params <= home_ids else model[1]
            self._kind[id(o)] = _kind(o, chunk)
            if chunk is model[0]:
                self._home.append(o)
        self._home.sort(key=lambda o: self._kind[id(o)] != "dense")  # 1F1B's order: dense, then expert

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def state_dict(self):
        sds = [o.state_dict() for o in self._home]
        return sds[0] if len(sds) == 1 else sds

    def load_state_dict(self, state_dict):
        """1F1B's state into the home copy's sub-optimizers and, by the same keys, the mirror's; a
        torch_dist load (what :meth:`sharded_state_dict` asked for) gives the mirror's its own shards."""
        mirror = None
        if isinstance(state_dict, dict) and MIRROR_KEY in state_dict:
            state_dict = dict(state_dict)
            mirror = state_dict.pop(MIRROR_KEY)
        sds = [state_dict] if len(self._home) == 1 else (
            [v for _, v in sorted(state_dict.items())] if isinstance(state_dict, dict) else list(state_dict))
        if len(sds) != len(self._home):
            raise RuntimeError(f"the checkpoint holds {len(sds)} optimizer state dicts, this rank's model[0] has "
                               f"{len(self._home)} optimizers: it was saved for another model; resume with "
                               "--no-load-optim")
        loaded = {self._kind[id(o)]: sd for o, sd in zip(self._home, sds)}
        for o in self._subs:
            sd = loaded.get(self._kind[id(o)])
            if sd is None:
                raise RuntimeError(f"the checkpoint holds no {self._kind[id(o)]} optimizer state for this rank's "
                                   "mirrored stage: it was saved for another model; resume with --no-load-optim")
            if o in self._home:
                o.load_state_dict(sd)
            else:
                sd = _for_mirror(o, sd)
                o.load_state_dict(sd if mirror is None else dict(sd, param_state=mirror[self._kind[id(o)]]))

    # torch_dist, fully reshardable (module docstring); a load also asks for the mirror's parts (MIRROR_KEY).

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
        parts = {id(o): o.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs) for o in self._subs}
        home = [parts[id(o)] for o in self._home]
        out = dict(home[0]) if len(home) == 1 else dict(enumerate(home))  # ChainedOptimizer's layout
        if is_loading:
            out[MIRROR_KEY] = {self._kind[id(o)]: parts[id(o)].get("param_state")
                               for o in self._subs if o not in self._home}
        return out

    def save_parameter_state(self, filename):
        states = {id(o): o.get_parameter_state_dp_zero() for o in self._subs}  # collective, stage order
        if any(o.data_parallel_group.rank() == 0 for o in self._home):  # as ChainedOptimizer saves
            mine = [states[id(o)] for o in self._home]
            torch.save(mine[0] if len(mine) == 1 else mine, filename)

    def load_parameter_state(self, filename, *, update_legacy_format=False):
        if update_legacy_format:
            raise Refusal("--dualpipe-shared-shard-group cannot convert a legacy distributed-optimizer "
                                      "checkpoint; convert it under --pipeline-schedule 1f1b first")
        file = None
        for o in self._subs:  # stage order, as saved
            state = None
            if o in self._home and o.data_parallel_group.rank() == 0:
                if file is None:
                    file = torch.load(filename)
                    file = [file] if len(self._home) == 1 else list(file)
                state = file[self._home.index(o)]
            o.load_parameter_state_from_dp_zero(state)


def _for_mirror(opt, sd):
    """The home copy's ``state_dict()`` for the mirror's sub-optimizer: the same param groups by their
    identifying keys, plus the mirror's own groups the home stage lacks (with the loaded step)."""
    groups = list(sd["optimizer"]["param_groups"])
    have = {param_group_key(g) for g in groups}
    step = next((g["step"] for g in groups if "step" in g), None)
    for own in opt.optimizer.state_dict()["param_groups"]:
        if param_group_key(own) not in have:
            extra = {k: v for k, v in own.items() if k != "params"}
            if step is not None:
                extra["step"] = step
            groups.append(extra)
    return dict(sd, optimizer=dict(sd["optimizer"], param_groups=groups))
