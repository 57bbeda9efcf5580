"""The tiny GPT recipe the Bridge tests train, and the worker that trains it under each schedule.

One set of gloo processes runs Bridge's own ``pretrain()`` once per schedule, one after the other
(the process group is made here, so Bridge keeps it between runs), and the last rank returns every
metric Bridge logged: the arguments of its ``training_log`` each iteration (losses, learning rate,
loss scale, grad norm, params norm, zeros in the gradients, skipped iterations) and the evaluation
losses. The weights start from a function of each parameter's place in the model (layer number,
name), the same under every schedule: DualPipeV's ranks build other layers than 1F1B's and Megatron
seeds per pipeline rank, so its own initialisation would differ.
"""
from __future__ import annotations

import os
import zlib

PP, LAYERS, SEQ, ITERS, GLOBAL_BATCH = 4, 8, 32, 4, 8
#: The tiny MoE (as tests/megatron_lm_runs.py's MOE_EP2_AUX_LOSS, with one MTP layer): 4 experts, top-2,
#: the alltoall dispatcher, aux loss and z-loss, expert parallel 2 x pp=2 x dp=2 on the 4 ranks, 4 layers
#: (DualPipeV at pp=2 needs a multiple of 4), MTP with rotary positions (as Megatron-LM requires).
MOE = dict(pipeline_model_parallel_size=2, num_layers=4, expert_model_parallel_size=2, num_moe_experts=4,
           moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
           moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, add_bias_linear=False, mtp_num_layers=1,
           position_embedding_type="rope")
#: Tensor parallel 2 with sequence parallelism x pp=2 (a recipe's TP, as the Qwen3 and Llama 3 recipes set it).
TP2 = dict(pipeline_model_parallel_size=2, num_layers=4, tensor_model_parallel_size=2, sequence_parallel=True)
SHAPES = {"dense": {}, "moe": MOE, "tp2": TP2}


def recipe(tied: bool = True, shape: str = "dense", save=None, load=None, step=2, iters=None):
    """A ConfigContainer as a Bridge recipe builds one: tied embeddings (Bridge's default; ``tied=False``
    as the Llama 3 and DeepSeek-V3 recipes), TE layer spec, Adam, clipping, the distributed optimizer and
    overlapped gradient reduction, mock data, an evaluation; ``shape``: one of :data:`SHAPES`;
    ``save`` / ``load``: a torch_dist checkpoint every 2 iterations (the distributed optimizer's state
    fully reshardable: 1F1B buckets its chunk, DualPipe does not), loaded at iteration ``step``;
    ``iters``: where training stops (when checkpointed, the learning rate decays over :data:`CHAIN_ITERS` in
    every run, and the scheduler takes the recipe's settings, not the checkpoint's: they differ in the
    weight decay's span, train_iters x batch, which a constant weight decay does not read)."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
                                                 TrainingConfig)

    model = GPTModelProvider(num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                             seq_length=SEQ, pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
                             make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0,
                             share_embeddings_and_output_weights=tied)
    for name, value in SHAPES[shape].items():
        setattr(model, name, value)
    model.register_pre_wrap_hook(same_weights)
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=iters or ITERS, global_batch_size=GLOBAL_BATCH, micro_batch_size=1,
                             eval_interval=2, eval_iters=1),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, clip_grad=1.0,
                                  use_distributed_optimizer=True, log_num_zeros_in_grad=True),
        scheduler=SchedulerConfig(start_weight_decay=0.01, end_weight_decay=0.01, weight_decay_incr_style="constant",
                                  lr_warmup_iters=1, lr_warmup_init=0.0, lr_decay_style="cosine",
                                  lr_decay_iters=CHAIN_ITERS if save or load else ITERS,
                                  override_opt_param_scheduler=bool(load)),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                          grad_reduce_in_fp32=True),
        dataset=MockGPTDatasetConfig(random_seed=1234, seq_length=SEQ, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=1, log_params_norm=True),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=2 if save else None,
                                    ckpt_step=step if load else None, dist_ckpt_optim_fully_reshardable=True),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        rng=RNGConfig(seed=1234),
    )


def same_weights(model):
    """Bridge's pre-wrap hook: every non-constant parameter drawn from a generator seeded by its logical
    name (decoder layers by their global layer number; a tied output weight is the embedding)."""
    import torch

    for chunk in model:
        for name, param in logical_names(chunk):
            if param.numel() > 1 and param.detach().std() > 0:
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                with torch.no_grad():
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen, dtype=torch.float32))
    return model


def logical_names(chunk):
    """(name, parameter) with the decoder layers numbered as in the whole model, an expert's weights
    named by its expert-parallel rank too (each holds other experts), the MTP block by its own name."""
    from megatron.core import parallel_state

    layers = {id(p): f"layer{layer.layer_number}.{n}" for layer in chunk.decoder.layers
              for n, p in layer.named_parameters()}
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    for name, param in chunk.named_parameters():
        if name == "output_layer.weight" and tied:
            name = "embedding.word_embeddings.weight"
        name = layers.get(id(param), name)
        if not getattr(param, "allreduce", True):
            name += f".ep{parallel_state.get_expert_model_parallel_rank()}"
        yield name, param


def train_each(rank: int, world: int, port: int, schedules, tied: bool = True, shape: str = "dense"):
    """Train the recipe under each schedule; the last rank returns {schedule: its logged metrics}.
    The MoE recipe (one MTP layer) runs dualpipev without the zero-bubble split (refused with MTP)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from megatron_dualpipe.bridge import cpu

    cpu.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    logged = {schedule: train_once(schedule, tied, shape) for schedule in schedules}
    return logged if rank == world - 1 else None


def train_once(schedule: str, tied: bool, shape: str = "dense", **ckpt) -> dict:
    """One run of Bridge's pretrain (the package's drop-in, or Bridge's own for Bridge's 1F1B)."""
    import megatron.bridge.training.eval as bridge_eval
    import megatron.bridge.training.train as bridge_train
    import megatron.bridge.training.utils.train_utils as train_utils
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain as bridge_pretrain

    from megatron_dualpipe.bridge import pretrain

    metrics = {"train": [], "eval": [], "stages": []}
    log, evaluate, helper = bridge_train.training_log, bridge_eval.evaluate, train_utils.MTPLossLoggingHelper
    moe_metrics = train_utils.track_moe_metrics
    bridge_train.training_log = _recording_training_log(log, metrics["train"], metrics["stages"])
    bridge_eval.evaluate = _recording_evaluate(evaluate, metrics["eval"])
    train_utils.track_moe_metrics = _recording_tracker(moe_metrics, metrics["train"])
    train_utils.MTPLossLoggingHelper = type("RecordingMTPHelper", (helper,), {
        "track_mtp_metrics": staticmethod(_recording_tracker(helper.track_mtp_metrics, metrics["train"]))})
    try:
        if schedule == "bridge-1f1b":
            bridge_pretrain(recipe(tied, shape, **ckpt), forward_step)
        else:
            options = {"zero_bubble": False} if shape == "moe" and schedule == "dualpipev" else {}
            pretrain(recipe(tied, shape, **ckpt), forward_step, schedule=schedule, **options)
    finally:
        bridge_train.training_log, bridge_eval.evaluate = log, evaluate
        train_utils.track_moe_metrics, train_utils.MTPLossLoggingHelper = moe_metrics, helper
    return metrics


def _recording_tracker(track, into: list):
    """Bridge's MoE / MTP metric call inside ``training_log``: what it adds to ``total_loss_dict``
    (``load_balancing_loss``, ``z_loss``, ``mtp_1 loss``; one iteration's, at log interval 1) goes into
    the iteration's row."""

    def record(*args, **kwargs):
        total = kwargs.get("total_loss_dict", args[4] if len(args) > 4 else None)
        before = {k: _number(v) for k, v in (total or {}).items()}
        out = track(*args, **kwargs)
        into[-1].update({f"loss/{k}": _number(v) for k, v in (total or {}).items() if _number(v) != before.get(k)})
        return out

    return record


#: The checkpoint chain: Bridge's 1F1B trains :data:`CHAIN_ITERS` iterations uninterrupted, saving every 2;
#: then each leg resumes the previous saver's checkpoint for 2 iterations and saves its own: dualpipe from
#: 1F1B's (iteration 2), dualpipev from dualpipe's (4), Bridge's 1F1B from dualpipev's (6). Each schedule
#: saves once and loads once, and 1F1B's format is crossed both ways.
CHAIN = ("dualpipe", "dualpipev", "bridge-1f1b")
CHAIN_ITERS = 2 * (len(CHAIN) + 1)


def save_then_resume(rank: int, world: int, port: int, directory: str):
    """The checkpoint chain (:data:`CHAIN`, torch_dist): the last rank returns {"uninterrupted": metrics,
    "saver->resumer": the resumer's metrics}. Every run has the uninterrupted run's learning-rate schedule;
    each checkpoint folder is loaded once (Bridge 0.3.1 loading one folder a second time in a process
    read the newest iteration's state, though ``ckpt_step`` named another, and logged the one named)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from megatron_dualpipe.bridge import cpu

    cpu.enable()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    saver, saved = "bridge-1f1b", os.path.join(directory, "uninterrupted")
    logged = {"uninterrupted": train_once(saver, True, save=saved, iters=CHAIN_ITERS)}
    for leg, resumer in enumerate(CHAIN, 1):
        own = os.path.join(directory, f"{leg}-{resumer}")
        logged[f"{saver}->{resumer}"] = train_once(resumer, True, save=own, load=saved, step=2 * leg,
                                                   iters=2 * leg + 2)
        saver, saved = resumer, own
    return logged if rank == world - 1 else None


def _number(value):
    return float(value.item() if hasattr(value, "item") else value) if value is not None else None


def _recording_training_log(training_log, into: list, stages: list):
    """Bridge's ``training_log``, recording its metrics in ``into`` and the stages the rank's chunks hold."""
    from megatron_dualpipe.mcore.model import chunk_info

    def record(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, loss_scale, report_memory_flag,
               skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args, **kwargs):
        row = {f"loss/{k}": _number(v) for k, v in loss_dict.items()}
        row.update({"learning rate": _number(learning_rate), "loss scale": _number(loss_scale),
                    "grad norm": _number(grad_norm), "params norm": _number(params_norm),
                    "num zeros": _number(num_zeros_in_grad), "skipped": _number(skipped_iter)})
        into.append(row)
        model = args[3] if len(args) > 3 else kwargs["model"]
        stages[:] = [(chunk_info(c) or {}).get("stage") for c in model]
        return training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad, *args,
                            **kwargs)

    return record


def _recording_evaluate(evaluate, into: list):
    def record(*args, **kwargs):
        out = evaluate(*args, **kwargs)
        total = out[0] if isinstance(out, tuple) else out
        into.append({f"eval/{k}": _number(v) for k, v in (total or {}).items()})
        return out

    return record


#: (schedule, {field: bad value}) -> the fields the one-line refusal must name.
MISTAKES = (
    ("dualpipe", {"model.virtual_pipeline_model_parallel_size": 2, "checkpoint.ckpt_format": "zarr",
                  "model.num_layers": 6, "train.global_batch_size": 2, "model.cuda_graph_impl": "local",
                  "dist.use_decentralized_pg": True, "model.pipeline_model_parallel_layout": "Et|tt|tt|tL"}),
    ("dualpipe", {"model.pipeline_model_parallel_size": 3}),
    ("dualpipev", {"model.num_layers": 12, "dist.use_megatron_fsdp": True, "model.mtp_num_layers": 1,
                   "checkpoint.async_save": True}),
    ("zb-h1", {}),
)


def _set(cfg, path: str, value) -> None:
    *parents, name = path.split(".")
    owner = cfg
    for part in parents:
        owner = getattr(owner, part)
    setattr(owner, name, value)


def refusals(rank: int, world: int, port: int):
    """What ``enable`` says about each of :data:`MISTAKES` (one process, nothing started), and
    whether Bridge's names were left alone."""
    os.environ.update(RANK="0", WORLD_SIZE=str(PP))
    from megatron_dualpipe.bridge import cpu, enable

    cpu.enable()  # before anything imports megatron-core: it reads at import whether TE exists
    import megatron.bridge.training.train as bridge_train

    from megatron_dualpipe.bridge.checks import BridgeConfigError

    before, said = bridge_train.get_forward_backward_func, []
    for schedule, mistakes in MISTAKES:
        cfg = recipe()
        for path, value in mistakes.items():
            _set(cfg, path, value)
        try:
            enable(cfg, schedule)
            said.append(None)
        except BridgeConfigError as e:
            said.append(str(e))
    return said, bridge_train.get_forward_backward_func is before


def enable_twice_then_disable(rank: int, world: int, port: int):
    """Bridge's patched names (every entry of ``bridge.patches`` for this Bridge's series) after enable,
    a second enable, disable, and enable of Bridge's own 1f1b."""
    os.environ.update(RANK="0", WORLD_SIZE=str(PP))
    from megatron_dualpipe.bridge import cpu, disable, enable, patches
    from megatron_dualpipe.hooks.mechanism import megatron_core_version, resolve

    cpu.enable()
    here = [p for p in patches.for_schedule("dualpipe") if megatron_core_version() in p.versions]

    def names():
        return tuple(getattr(*resolve(patch)) for patch in here)

    original, cfg = names(), recipe()
    enable(cfg, "dualpipe")
    first, stale = names(), _still_bound(original)
    enable(cfg, "dualpipe")
    second = names()
    disable()
    restored = names()
    enable(cfg, "1f1b")
    own = names()
    disable()
    changed = [a is not b for a, b in zip(first, original)]
    return changed, [a is b for a, b in zip(second, first)], [a is b for a, b in zip(restored, original)], \
        [a is b for a, b in zip(own, original)], stale


#: Bridge modules that bind a replaced function by name but are not on pretrain()'s path.
NOT_ON_PRETRAINS_PATH = ("megatron.bridge.training.model_load_save",)  # checkpoint conversion tools


def _still_bound(original) -> list:
    """Every ``module.name`` of Bridge's training package that still holds one of the functions enable()
    replaced, outside the module that defines it: a call site imported by name that the patches miss
    (Bridge 0.3's pretrain() saved its last checkpoint so)."""
    import sys

    import inspect

    replaced = {id(obj): obj for obj in original if inspect.isfunction(obj)}  # classes: isinstance checks hold
    return sorted(f"{module}.{name}" for module, mod in list(sys.modules.items())
                  if module.startswith("megatron.bridge.training") and module not in NOT_ON_PRETRAINS_PATH
                  for name, obj in list(vars(mod).items())
                  if id(obj) in replaced and getattr(obj, "__module__", None) != module)


def enable_after_megatron_core(rank: int, world: int, port: int):
    """What the CPU mode for Bridge says in a rank whose forkserver had imported megatron-core (as one
    kept from an earlier megatron-core test has): Bridge would fail importing Transformer Engine."""
    import sys

    from megatron_dualpipe.bridge import cpu

    assert "megatron.core.models.gpt" in sys.modules, "the forkserver did not preload megatron-core"
    try:
        cpu.enable()
    except RuntimeError as e:
        return str(e)
    finally:
        cpu.disable()
    return None
