"""The main job on one machine: train a small megatron-core GPT with DualPipe, then with 1F1B.

    torchrun --nproc-per-node 4 -m megatron_dualpipe.demo [--iters 30] [--schedule dualpipe]

Four processes form a pp=4 pipeline (gloo and the CPU mode without a GPU; NCCL with GPUs).
The same initial weights and the same synthetic batches are trained twice: first with the
chosen DualPipe schedule through ``forward_backward_dualpipe``, then with megatron-core's own
1F1B (``get_forward_backward_func()``). The last rank prints Megatron-style lines and, at the
end, both loss series side by side with their largest difference.

The data is a learnable synthetic language: each sample is an arithmetic sequence of tokens
modulo the vocabulary (random start and stride), so the loss falls within a few dozen steps.
Embeddings are untied here because megatron-core's 1F1B reference needs megatron DDP for the
tied-embedding all-reduce; DualPipe itself supports tied embeddings (see the tests). The 1F1B
run gets the DualPipe run's initial weights, gathered by global layer number.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import time

import torch
import torch.distributed as dist

from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.layout import V_SHAPE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default=registry.DUALPIPE, choices=registry.names(chunks_per_rank=2))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=16, help="micro-batches per iteration (global batch)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-compare", action="store_true", help="skip the 1F1B run")
    return p.parse_args(argv)


def synthetic_batches(args, iteration):
    """The iteration's micro-batches, identical on every rank (seeded by iteration)."""
    g = torch.Generator().manual_seed(10_000 + iteration)
    out = []
    for _ in range(args.microbatches):
        start = torch.randint(0, args.vocab_size, (args.micro_batch_size, 1), generator=g)
        stride = torch.randint(1, 8, (args.micro_batch_size, 1), generator=g)
        seq = (start + stride * torch.arange(args.seq_length + 1)) % args.vocab_size
        out.append(dict(tokens=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous(),
                        position_ids=torch.arange(args.seq_length).expand(args.micro_batch_size, -1).contiguous()))
    return out


def loss_func(output_tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """pretrain_gpt-style: only the first and the last stage read the batch."""
    from megatron.core import parallel_state as ps
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    b = next(data_iterator) if (first or last) else None
    device = next(model.parameters()).device
    tokens = b["tokens"].to(device) if first else None
    position_ids = b["position_ids"].to(device) if first else None
    labels = b["labels"].to(device) if last else None
    return model(tokens, position_ids, None, labels=labels), loss_func


def model_config(args, v_layout):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
        ffn_hidden_size=4 * args.hidden_size, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size())
    if v_layout:
        from megatron_dualpipe.mcore.model import dualpipev_config
        config = dualpipev_config(config)
    return config


def gpt_provider(args, v_layout):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def provider(pre_process, post_process, pg_collection=None, vp_stage=None):
        kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        return GPTModel(model_config(args, v_layout), get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                        max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process,
                        share_embeddings_and_output_weights=False, vp_stage=vp_stage, **kwargs)
    return provider


def _layer_offset(chunk) -> int:
    layers = chunk.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _global_key(key: str, offset: int) -> str:
    prefix = "decoder.layers."
    if not key.startswith(prefix):
        return key
    index, rest = key[len(prefix):].split(".", 1)
    return f"{prefix}{int(index) + offset}.{rest}"


def gather_full_state(model):
    """Every rank's copy of the whole model's weights, keyed by global layer numbers (tiny
    model: all_gather_object is fine), so the 1F1B run can start from the same weights."""
    mine = {}
    for chunk in model:
        offset = _layer_offset(chunk)
        for k, v in chunk.state_dict().items():
            if isinstance(v, torch.Tensor):
                mine[_global_key(k, offset)] = v.detach().cpu().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def load_full_state(stage, full):
    offset = _layer_offset(stage)
    with torch.no_grad():
        for k, v in stage.state_dict().items():
            if isinstance(v, torch.Tensor):
                v.copy_(full[_global_key(k, offset)])


def train(args, name, model, fb_func, log):
    """Run ``args.iters`` iterations; return the per-iteration mean lm loss (last rank)."""
    params = [p for chunk in model for p in chunk.parameters()]
    opt = torch.optim.Adam(params, lr=args.lr)
    losses = []
    for it in range(args.iters):
        t0 = time.perf_counter()
        opt.zero_grad()
        out = fb_func(forward_step_func=forward_step, data_iterator=iter(synthetic_batches(args, it)),
                      model=model, num_microbatches=args.microbatches, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, forward_only=False)
        opt.step()
        ms = (time.perf_counter() - t0) * 1000
        if out:
            loss = torch.stack([d["lm loss"] for d in out]).mean().item()
            losses.append(loss)
            log(f" [{name}] iteration {it + 1:>5}/{args.iters:>5} | consumed samples: "
                f"{(it + 1) * args.microbatches * args.micro_batch_size:>7} | elapsed time per iteration (ms): "
                f"{ms:8.1f} | learning rate: {args.lr:.3E} | lm loss: {loss:.6E} | micro-batches: {len(out)}")
    return losses


def main(argv=None):
    args = parse_args(argv)
    from megatron_dualpipe import cpu as cpu_mode
    cpu = cpu_mode.enable()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        raise SystemExit("run with torchrun --nproc-per-node 4 (pp = number of processes, at least 2)")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(minutes=5))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_dualpipe.mcore.forward_backward import get_forward_backward_func
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    build_bd_groups()
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    last = rank == world - 1

    def log(msg):
        if last:
            print(msg, flush=True)

    v_layout = registry.get(args.schedule).layout_kind == V_SHAPE
    log(f"megatron-dualpipe demo: {args.schedule} vs megatron-core 1F1B, pp={world}, {args.num_layers} layers, "
        f"hidden {args.hidden_size}, {args.microbatches} micro-batches x {args.micro_batch_size} x {args.seq_length} "
        f"tokens per iteration, {'CPU/gloo' if cpu else 'GPU/NCCL'}")
    model = build_two_direction_model(gpt_provider(args, v_layout), layout_kind=registry.get(args.schedule).layout_kind)
    if not v_layout:
        broadcast_mirrors(model)
    for chunk in model:
        chunk.config.finalize_model_grads_func = lambda *a, **k: None  # pp only, untied: nothing else to reduce
    initial = gather_full_state(model)
    dual = train(args, args.schedule, model, get_forward_backward_func(args.schedule), log)
    if args.no_compare:
        return
    # 1F1B over the same initial weights: stage i of pp holds layers [i*L/pp, (i+1)*L/pp).
    stage = gpt_provider(args, False)(pre_process=rank == 0, post_process=last)
    load_full_state(stage, initial)
    stage.config.finalize_model_grads_func = None
    one = train(args, registry.ONE_F_ONE_B, [stage], megatron_fb_func(), log)
    if last:
        print("\n iteration | " + f"{args.schedule:>12} | {registry.ONE_F_ONE_B:>12} | difference")
        for i, (a, b) in enumerate(zip(dual, one)):
            print(f" {i + 1:>9} | {a:12.6f} | {b:12.6f} | {abs(a - b):.2e}")
        print(f" max |{args.schedule} - 1f1b| over {len(dual)} iterations: {max(abs(a - b) for a, b in zip(dual, one)):.3e}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
