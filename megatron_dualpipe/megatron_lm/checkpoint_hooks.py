"""Checkpoints under ``--pipeline-schedule dualpipe``: the same logical model as 1F1B.

DualPipe holds every stage twice: ``model[0]`` is stage ``i`` on rank ``i`` (exactly the chunk
1F1B has there) and ``model[1]`` the mirrored copy of stage ``pp-1-i``, kept equal to its home
copy. A checkpoint therefore only needs ``model[0]``; the mirror is reconstructed at load.

Legacy ``--ckpt-format torch`` (one file per (tp, pp) rank, keys ``model`` and ``optimizer``):

* **save**: Megatron's ``save_checkpoint`` gets ``model[:1]`` and a view of the optimizer whose
  ``state_dict()`` keeps only ``model[0]``'s parameters (their Adam moments, step, and for
  fp16/bf16 the fp32 main copies), re-indexed as the one-chunk optimizer of a 1F1B run indexes
  them. The file is what a 1F1B run of the same model writes (plus ``args.pipeline_schedule``).
* **load**: Megatron's ``load_checkpoint`` gets ``model[:1]`` (so it reads the ``model`` key of
  a 1F1B or DualPipe checkpoint into ``model[0]``) and a view of the optimizer whose
  ``load_state_dict()`` expands the one-chunk state to both chunks: the saved entries go to
  ``model[0]``'s parameters, ``model[1]``'s get zero placeholders of the same structure. Then
  :func:`sync_mirrors` copies, over each bd pair, ``model[0]``'s parameters, fp32 main
  parameters and optimizer state on rank ``i`` into ``model[1]`` on rank ``pp-1-i``. After
  that, the mirror is bit-identical to its home copy in parameters *and* optimizer state, as it
  is in an uninterrupted DualPipe run (both copies always receive the same summed gradient).
* Supported optimizers: Megatron's ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` and
  ``DistributedOptimizer`` (and a ``ChainedOptimizer`` of them, e.g. dense + expert parameters).
  The distributed optimizer's ``state_dict()`` holds no per-parameter state and is the same for
  one and two chunks; its per-parameter state (``distrib_optim.pt``, gathered on data-parallel
  rank 0, one entry per grad buffer) is written for ``model[0]``'s buffers only, renumbered as a
  one-chunk run numbers them, and read back into them (the mirror's buffers get placeholders
  that ``sync_mirrors`` overwrites with its partner's shards).

``--ckpt-format torch_dist``: keys are global (layer numbers, shard offsets), and ``model[1]`` is
built with the reversed pipeline group, so its keys are those of the stage it mirrors: at load
every replica reads the stored shard, so ``model[1]`` loads its stage from the home copy's data.
At save the mirror's entries (and the optimizer state derived from them) are left out, and the
distributed optimizer's buffer-keyed state holds model[0]'s buffers only (:mod:`.torch_dist_mirror`),
so the files are a 1F1B run's. After the load :func:`sync_mirrors` copies parameters and optimizer
state from each home copy to its mirror.

DualPipeV has no mirrors: its two chunks are different stages of a 2*pp-stage split. In
``--ckpt-format torch`` its files hold Megatron's own two-chunk layout (``model0``/``model1``, the
optimizer of both) plus ``model``, the weights of 1F1B's stage ``i`` (two V-stages, gathered from
the ranks holding them), so 1F1B and DualPipe read them; a DualPipeV load of a one-chunk file cuts
its ``model`` into V-stages and sends them to their ranks (:mod:`.dualpipev_checkpoint`). Optimizer
state does not cross between the two layouts: such a load needs ``--no-load-optim`` and is
refused with that message otherwise. (torch_dist reshards by global keys; DualPipeV chunks carry
vp_stage 0/1 keys, not verified here.)
"""

import contextlib
import functools

from .. import hooks
from ..schedule import registry
from . import torch_dist_mirror
from .training_hooks import schedule_of

_schedule = schedule_of


# ------------------------------------------------------------------------------------------
# Optimizer bookkeeping
# ------------------------------------------------------------------------------------------


def inner_optimizers(optimizer):
    """The megatron optimizers behind ``optimizer`` (the members of a ChainedOptimizer)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _kind(opt) -> str:
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if is_distributed_optimizer(opt):
        return "distributed"
    if isinstance(opt, Float16OptimizerWithFloat16Params):
        return "fp16"
    if isinstance(opt, FP32Optimizer):
        return "fp32"
    raise NotImplementedError(
        f"--pipeline-schedule dualpipe with --ckpt-format torch: optimizer {type(opt).__name__} is not "
        "supported (its state is saved in its own layout); use --ckpt-format torch_dist, or "
        "--no-save-optim / --no-load-optim"
    )


def _main_to_model(opt):
    """{id(main param): model param} for the parameters this optimizer updates."""
    if getattr(opt, "is_stub_optimizer", False) or opt.optimizer is None:
        return {}
    if _kind(opt) == "fp32":
        return {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
    m = {}
    for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model_p, main_p in zip(model_group, main_group):
            m[id(main_p)] = model_p
    for group in opt.fp32_from_fp32_groups:
        for p in group:
            m[id(p)] = p
    return m


def _group_key(group):
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group[k] if k in group else group.get(f"pre_{k}") for k in param_group_identifier_keys)


def _masks(opt, keep_ids):
    """Per torch param group: which of its (main) params belong to a kept model param."""
    to_model = _main_to_model(opt)
    return [[id(to_model[id(p)]) in keep_ids for p in g["params"]] for g in opt.optimizer.param_groups]


def _torch_sd(opt, sd):
    return sd if _kind(opt) == "fp32" else sd["optimizer"]


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
    if _kind(opt) == "fp32":
        return new_tsd
    out = dict(sd)
    out["optimizer"] = new_tsd
    out["fp32_from_fp16_params"] = [
        [main for model_p, main in zip(opt.float16_groups[gi], sd["fp32_from_fp16_params"][gi]) if id(model_p) in keep_ids]
        for gi in kept
    ]
    return out


def expand_state_dict(opt, sd, keep_ids):
    """Inverse of `filter_state_dict`: a one-chunk state dict -> this optimizer's layout. The
    parameters outside ``keep_ids`` (the mirror) get zero placeholders (`sync_mirrors` fills them)."""
    import torch

    tsd = _torch_sd(opt, sd)
    saved_state = tsd["state"]
    template = next(iter(saved_state.values()), None)
    by_key = {}
    for si, g in enumerate(tsd["param_groups"]):
        by_key[_group_key(g)] = si
    masks = _masks(opt, keep_ids)
    fp16 = _kind(opt) == "fp16"
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
        if si is not None:
            used.add(si)
        saved_ids = iter(saved_group["params"] if saved_group is not None else ())
        params = []
        for p, keep in zip(live["params"], mask):
            if keep:
                sid = next(saved_ids)
                if sid in saved_state:
                    state[idx] = saved_state[sid]
            elif template is not None:
                state[idx] = {
                    k: (torch.zeros_like(p.data, dtype=v.dtype) if torch.is_tensor(v) and v.dim() > 0
                        else (v.clone() if torch.is_tensor(v) else v))
                    for k, v in template.items()
                }
            params.append(idx)
            idx += 1
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
    out = dict(sd)
    out["optimizer"] = new_tsd
    out["fp32_from_fp16_params"] = fp32_groups
    return out


class _OneChunkOptimizerView:
    """Presents a DualPipe optimizer to Megatron's checkpoint code as a 1F1B (one-chunk) one."""

    def __init__(self, optimizer, keep_ids):
        self._optimizer = optimizer
        self._keep_ids = keep_ids
        self._inner = inner_optimizers(optimizer)

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
        import torch

        states = [filter_parameter_state(o, o.get_parameter_state_dp_zero(), self._keep_ids) for o in self._inner]
        if self._inner[0].data_parallel_group.rank() == 0:
            torch.save(states[0] if len(states) == 1 else states, filename)

    def load_parameter_state(self, filename, *, update_legacy_format=False):
        import torch

        if update_legacy_format:
            raise NotImplementedError("--pipeline-schedule dualpipe cannot convert a legacy distributed-optimizer "
                                      "checkpoint; convert it under --pipeline-schedule 1f1b first")
        rank0 = self._inner[0].data_parallel_group.rank() == 0
        states = torch.load(filename) if rank0 else None
        if rank0 and len(self._inner) == 1:
            states = [states]
        for k, o in enumerate(self._inner):
            o.load_parameter_state_from_dp_zero(
                expand_parameter_state(o, states[k], self._keep_ids) if rank0 else None)


def _home_buffers(opt, keep_ids):
    """Indices of the distributed optimizer's grad buffers that belong to model[0] (a buffer
    holds the parameters of one chunk: DDP builds them per chunk)."""
    home = []
    for k, buf in enumerate(opt.buffers):
        ids = {id(p) for p in buf.params}
        if ids <= keep_ids:
            home.append(k)
        elif ids & keep_ids:
            raise RuntimeError("a distributed-optimizer buffer holds parameters of both model chunks")
    return home


def filter_parameter_state(opt, state, keep_ids):
    """``get_parameter_state_dp_zero()`` restricted to model[0]'s buffers, renumbered from 0 as a
    one-chunk optimizer numbers them (None off data-parallel rank 0)."""
    if state is None:
        return None
    out = {k: v for k, v in state.items() if not isinstance(k, int)}
    for new, old in enumerate(_home_buffers(opt, keep_ids)):
        out[new] = state[old]
    return out


def expand_parameter_state(opt, state, keep_ids):
    """Inverse of `filter_parameter_state`: a one-chunk parameter state -> this optimizer's
    buffers; the mirror's buffers get zero placeholders (`sync_mirrors` fills them)."""
    import torch

    home = _home_buffers(opt, keep_ids)
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


def _model0_ids(model):
    from ..mcore.model import unwrap_chunk

    return {id(p) for p in unwrap_chunk(model[0]).parameters()}


# ------------------------------------------------------------------------------------------
# Mirrors
# ------------------------------------------------------------------------------------------


def sync_mirrors(model, optimizer) -> None:
    """Home copy -> mirror, over each bd pair (`bd_pairs.broadcast_home_to_mirror`, stage
    min(i, pp-1-i) first, structure checked): the parameters (``broadcast_mirrors``), the
    persistent buffers (e.g. a MoE router's ``expert_bias``, which the checkpoint restores only
    in the home copy), then for every optimizer the state behind each parameter in
    ``named_parameters`` order: the fp32 main parameter (when it is not the parameter itself)
    and the optimizer state tensors. For the distributed optimizer that is this data-parallel
    rank's shard of each (the partners have the same data-parallel rank and, with identical
    buffer layouts, the same shard ranges; a layout that differs is reported by the structure
    check)."""
    from ..mcore import bd_pairs
    from ..mcore.model import broadcast_mirrors

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
            model, lambda chunk: [t for _, p in _named_params(chunk) for t in state_of(p)], "optimizer state")


def _sync_distributed_optimizer_state(model, opt) -> None:
    """The distributed optimizer keeps, per parameter with a shard on this data-parallel rank,
    the main parameter shard and its state (Megatron's ``_get/_set_main_param_and_optimizer_states``;
    the getter may return copies, e.g. with the precision-aware optimizer, so the received values
    are written back through the setter)."""
    import torch

    from ..mcore import bd_pairs

    fetched = {}

    def tensors_of(chunk):
        out = []
        for _, p in _named_params(chunk):
            if p in opt.model_param_group_index_map:  # else: no shard of it on this data-parallel rank
                st = opt._get_main_param_and_optimizer_states(p)
                fetched[p] = st
                out.extend(st[k] for k in sorted(st) if torch.is_tensor(st[k]))
        return out

    bd_pairs.broadcast_home_to_mirror(model, tensors_of, "distributed optimizer state")
    with torch.no_grad():
        for p, st in fetched.items():
            opt._set_main_param_and_optimizer_states(p, st)


def _named_params(chunk):
    from ..mcore.model import unwrap_chunk

    return list(unwrap_chunk(chunk).named_parameters())


def persistent_buffers(chunk):
    """The chunk's floating-point buffers that its state dict saves, in module order."""
    from ..mcore.model import unwrap_chunk

    return [b for m in unwrap_chunk(chunk).modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set and b.is_floating_point()]


def _param_state_getter(opt):
    """``param -> [tensors]`` for Megatron's (non-distributed) optimizers: the fp32 main
    parameter when it is not the parameter itself, then the optimizer state tensors by key."""
    import torch

    mains = {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
    model_to_main = {id(model_p): mains[main_id] for main_id, model_p in _main_to_model(opt).items()}

    def of(p):
        main = model_to_main.get(id(p))
        if main is None:
            return []
        st = opt.optimizer.state.get(main, {})
        return ([main.data] if main is not p else []) + [st[k] for k in sorted(st) if torch.is_tensor(st[k])]
    return of


def is_distributed_optimizer(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


# ------------------------------------------------------------------------------------------
# save_checkpoint / load_checkpoint
# ------------------------------------------------------------------------------------------


def _one_chunk_distributed_optimizer(model, optimizer):
    """torch_dist: the distributed optimizers' buffer-keyed state restricted to model[0]'s buffers."""
    dist = [o for o in inner_optimizers(optimizer) if is_distributed_optimizer(o)]
    if not dist:
        return contextlib.nullcontext()
    return torch_dist_mirror.one_chunk_distributed_optimizer(dist, _model0_ids(model))


def wrap_save(orig):
    @functools.wraps(orig)
    def save_checkpoint(iteration, model, optimizer, *a, **kw):
        from megatron.training import get_args

        args = get_args()
        if _schedule(args) == registry.DUALPIPEV and args.ckpt_format == "torch":
            with _dualpipev_state_dict_with_one_chunk(model):
                return orig(iteration, model, optimizer, *a, **kw)
        if _schedule(args) == registry.DUALPIPE and args.ckpt_format == "torch_dist":
            with _generated_state_dict_edited(torch_dist_mirror.drop_mirror_entries), \
                    _one_chunk_distributed_optimizer(model, optimizer):
                return orig(iteration, model, optimizer, *a, **kw)
        if _schedule(args) != registry.DUALPIPE or args.ckpt_format != "torch":
            return orig(iteration, model, optimizer, *a, **kw)
        if not args.no_save_optim and optimizer is not None:
            for o in inner_optimizers(optimizer):
                if not getattr(o, "is_stub_optimizer", False):
                    _kind(o)  # refuses unsupported optimizers before anything is written
            optimizer = _OneChunkOptimizerView(optimizer, _model0_ids(model))
        return orig(iteration, list(model)[:1], optimizer, *a, **kw)

    return save_checkpoint


def _disk_format(args, load_arg):
    """'torch_dist' if the checkpoint that load_checkpoint will read is a distributed one, else
    the format it will be read as (args.ckpt_format when nothing can be found)."""
    try:
        import megatron.training.checkpointing as mckpt
        from megatron.core import dist_checkpointing

        load_dir = getattr(args, load_arg, None)
        tracker = mckpt.get_checkpoint_tracker_filename(load_dir)
        import os

        if not load_dir or not os.path.isfile(tracker):
            return args.ckpt_format
        iteration, release = mckpt.read_metadata(tracker)
        if getattr(args, "ckpt_step", None):
            iteration = args.ckpt_step
        name = mckpt.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        return "torch_dist" if dist_checkpointing.check_is_distributed_checkpoint(name) else "torch"
    except Exception:  # noqa: BLE001 - detection is best effort; Megatron reports real errors
        return args.ckpt_format


def _peek_torch_checkpoint(args, load_arg):
    """(top-level keys, schedule that wrote it) of this rank's torch-format file that
    load_checkpoint will read, or None when there is none (memory-mapped, tensors not read)."""
    import os

    import torch

    import megatron.training.checkpointing as mckpt

    load_dir = getattr(args, load_arg, None)
    tracker = mckpt.get_checkpoint_tracker_filename(load_dir) if load_dir else None
    if not tracker or not os.path.isfile(tracker):
        return None
    iteration, release = mckpt.read_metadata(tracker)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    name = mckpt.get_checkpoint_name(load_dir, iteration, release)
    if not os.path.isfile(name):
        return None
    sd = torch.load(name, map_location="cpu", weights_only=False, mmap=True)
    return set(sd), getattr(sd.get("args"), "pipeline_schedule", registry.DEFAULT) or registry.DEFAULT


def _loads_optimizer(args, optimizer) -> bool:
    return optimizer is not None and not args.no_load_optim and not args.finetune


def _check_cross_layout_optimizer(args, load_arg, optimizer, schedule, peek) -> bool:
    """True if this load has to remap DualPipeV <-> 1F1B layers; refuses, before anything is
    read, to load optimizer state across the two layouts (it is per stage and not remapped)."""
    if peek is None:
        return False
    keys, saved = peek
    two_chunk_file = "model0" in keys and "model1" in keys
    crosses = (schedule == registry.DUALPIPEV) != (saved == registry.DUALPIPEV) or (schedule == registry.DUALPIPEV and not two_chunk_file)
    if crosses and _loads_optimizer(args, optimizer):
        raise NotImplementedError(
            f"--pipeline-schedule {schedule} can load the weights of this --ckpt-format torch checkpoint (written by "
            f"--pipeline-schedule {saved}), remapped to its stages, but not its optimizer state, which is laid out per "
            "stage: pass --no-load-optim (or --finetune)")
    return schedule == registry.DUALPIPEV and not two_chunk_file


def _dualpipev_state_dict_from_one_chunk(model):
    """Within the block, the state dict Megatron's load reads from this rank's file gets
    ``model0``/``model1`` cut out of its 1F1B-layout ``model`` (collective, `dualpipev_checkpoint`)."""
    from . import dualpipev_checkpoint as dvc

    me, pp, n = _dualpipev_geometry(model)

    def cut(orig):
        @functools.wraps(orig)
        def load_base(*a, **kw):
            result = orig(*a, **kw)
            sd = result[0]
            if not kw.get("rank0", False) and sd is not None and "model" in sd and "model0" not in sd:
                sd["model0"], sd["model1"] = dvc.scatter_one_chunk_state_dict(sd.pop("model"), me, pp, n)
            return result

        return load_base

    return hooks.scoped(hooks.entry("scoped", "_load_base_checkpoint").made_by(cut))


@contextlib.contextmanager
def _dualpipev_state_dict_with_one_chunk(model):
    """Within the block, the state dict Megatron's save writes also holds ``model``: 1F1B stage
    ``i``'s weights (gathered from the V-stages first, collectively, on every rank)."""
    from . import dualpipev_checkpoint as dvc

    me, pp, n = _dualpipev_geometry(model)
    one_chunk = dvc.gather_one_chunk_state_dict(model, me, pp, n)
    with _generated_state_dict_edited(lambda sd: sd.__setitem__("model", one_chunk)):
        yield


def _generated_state_dict_edited(edit):
    """Within the block, ``edit(state_dict)`` runs on every state dict Megatron's save generates."""

    def editing(orig):
        @functools.wraps(orig)
        def generate(*a, **kw):
            sd = orig(*a, **kw)
            edit(sd)
            return sd

        return generate

    return hooks.scoped(hooks.entry("scoped", "generate_state_dict").made_by(editing))


def _dualpipev_geometry(model):
    """(pipeline rank, pp, layers per V-stage) of a DualPipeV model."""
    from megatron.core import parallel_state

    from ..mcore.model import unwrap_chunk

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return (parallel_state.get_pipeline_model_parallel_rank(), pp,
            unwrap_chunk(model[0]).config.num_layers // (2 * pp))


def wrap_load(orig):
    @functools.wraps(orig)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kw):
        from megatron.training import get_args

        args = get_args()
        schedule = _schedule(args)
        fmt = _disk_format(args, load_arg)
        peek = _peek_torch_checkpoint(args, load_arg) if fmt == "torch" else None
        if _check_cross_layout_optimizer(args, load_arg, optimizer, schedule, peek):
            with _dualpipev_state_dict_from_one_chunk(ddp_model):
                return orig(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, **kw)
        if schedule != registry.DUALPIPE:
            return orig(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, **kw)
        if fmt == "torch":
            view = optimizer
            if optimizer is not None:
                view = _OneChunkOptimizerView(optimizer, _model0_ids(ddp_model))
            result = orig(list(ddp_model)[:1], view, opt_param_scheduler, load_arg, strict, **kw)
        else:
            with _one_chunk_distributed_optimizer(ddp_model, optimizer):
                result = orig(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, **kw)
        sync_mirrors(ddp_model, optimizer)
        return result

    return load_checkpoint
