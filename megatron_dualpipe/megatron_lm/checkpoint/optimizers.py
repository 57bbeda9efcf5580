"""Which Megatron optimizer a checkpoint deals with, which of its parameters and grad buffers are
``model[0]``'s (what a 1F1B checkpoint holds), and the offsets its fully reshardable state is written at."""

from ... import hooks
from ...mcore.model import unwrap_chunk


def inner_optimizers(optimizer):
    """The megatron optimizers behind ``optimizer`` (the members of a ChainedOptimizer)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed_optimizer(opt) -> bool:
    """Whether ``opt`` is Megatron's ``DistributedOptimizer`` (its state is laid out per grad buffer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def param_group_key(group):
    """A param group's identifying keys, as Megatron's load matches groups."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group[k] if k in group else group.get(f"pre_{k}") for k in param_group_identifier_keys)


# --- save_checkpoint / load_checkpoint ---


def kind(opt) -> str:
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


def main_to_model(opt):
    """{id(main param): model param} for the parameters this optimizer updates."""
    if getattr(opt, "is_stub_optimizer", False) or opt.optimizer is None:
        return {}
    if kind(opt) == "fp32":
        return {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
    m = {}
    for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model_p, main_p in zip(model_group, main_group):
            m[id(main_p)] = model_p
    for group in opt.fp32_from_fp32_groups:
        for p in group:
            m[id(p)] = p
    return m


def home_buffers(opt, keep_ids):
    """Indices of the distributed optimizer's grad buffers that are model[0]'s (DDP builds them per chunk)."""
    home = []
    for k, buf in enumerate(opt.buffers):
        ids = {id(p) for p in buf.params}
        if ids <= keep_ids:
            home.append(k)
        elif ids & keep_ids:
            raise RuntimeError("a distributed-optimizer buffer holds parameters of both model chunks")
    return home


def model0_ids(model):
    """ids of the parameters of ``model[0]`` (unwrapped)."""
    return {id(p) for p in unwrap_chunk(model[0]).parameters()}


# --- fully reshardable torch_dist state ---


def exact_offsets(optimizer):
    """Within the block, each distributed optimizer's grad buffers give ``param_index_map`` offsets without
    the padding between buckets: megatron-core's ``sharded_param_state_fully_reshardable`` slices the
    unpadded state at the padded offsets, so a parameter after a padded bucket (DualPipeV's V-stage 0:
    the tied embedding's) is written shifted (where 1F1B's own stage pads, its file has the same shift)."""
    offsets = hooks.entry("per object", "_ParamAndGradBuffer.param_index_map")
    return hooks.scoped(*(offsets.to(_unpadded_offsets(buffer), on=buffer)
                          for opt in inner_optimizers(optimizer) if is_distributed_optimizer(opt)
                          for buffer in opt.buffers))


def _unpadded_offsets(buffer) -> dict:
    """``buffer.param_index_map`` with each bucket's offsets less the padding of the buckets before it."""
    removed, before = 0, []
    for bucket in buffer.buckets:
        before.append(removed)
        removed += bucket.grad_data.numel() - bucket.numel_unpadded
    return {param: (start - before[bucket_id], end - before[bucket_id], bucket_id)
            for param, (start, end, bucket_id) in buffer.param_index_map.items()}
