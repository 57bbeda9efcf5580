"""Worker of tests/cpu/test_te_stand_in_megatron.py: megatron-core's Transformer Engine spec on the CPU
stand-in against its local spec, in a fresh interpreter (the stand-in must be importable before
megatron-core is first imported: its modules decide ``HAVE_TE`` at import).

``python te_stand_in_worker.py PORT [tp2]`` prints one JSON line: per case the relative gaps of the losses
and of every parameter's gradient (``proof.compare.Gap``) and their printed lines. Cases:

* ``dense`` / ``moe``: a tiny GPT (an MoE with grouped experts: ``TEGroupedMLP`` against ``SequentialMLP``)
  built with both specs, the local spec's weights copied into the TE one, two micro-batches.
* ``dropout``: the dense GPT with attention and hidden dropout, both runs from the same RNG states (the
  TE attention draws its mask from megatron's tracker, as the local one does).
* ``dense bf16`` / ``moe bf16``: both in BF16 parameters and activations.
* ``tp2``: two gloo ranks, tensor parallel with sequence parallelism (dense and MoE) and without (dense).
* ``deferred`` / ``deferred_fused``: the TE model with ``delay_wgrad_compute`` under megatron DDP
  (``ddp_config.delay_wgrad_compute``: DDP hooks the TE modules), two backwards and then the plugin's W step
  (``mcore.wgrad.TEQueues``) once per backward; ``main_grad`` against the local spec under DDP.
  Also how much of the TE layers' gradient existed before W (nothing may). ``_fused``: the TE layers
  accumulate into ``main_grad`` themselves (``fuse_wgrad_accumulation``); ``_moe``: with grouped experts;
  ``_megatron_layers``: W through megatron-core's own ``Attention`` / ``MLP`` / ``MoELayer.backward_dw``.
* ``bias_order``: with biases, backward_dw right after each backward works and two backwards before
  two backward_dw fail in W as in TE (see the stand-in's ``backward_dw``).
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List

LAYERNORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
              ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def local_name(te_name: str) -> str:
    """The local spec's name of a TE spec parameter (fused norms, grouped experts)."""
    for te_part, local_part in LAYERNORMS:
        te_name = te_name.replace(te_part, local_part)
    return re.sub(r"experts\.linear_fc(\d)\.weight(\d+)$", r"experts.local_experts.\2.linear_fc\1.weight", te_name)


def setup(port: str, rank: int = 0, world_size: int = 1, tp: int = 1) -> None:
    from megatron_dualpipe.cpu import stand_ins

    assert "megatron.core" not in sys.modules
    assert stand_ins.install(["transformer_engine"]) == ["transformer_engine"]
    import torch.distributed as dist

    from megatron_dualpipe import cpu as cpu_mode
    from megatron_dualpipe.proof.groups import init_model_parallel

    cpu_mode.enable(force=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    init_model_parallel(tp=tp, pp=1, ep=1, vpp=None, timeout_minutes=2, seed=1234)


def build_pair(moe: bool, delay: bool = False, **overrides):
    """(local model, TE model) with the local model's weights in the TE one. ``delay``: the TE model's
    config gets ``delay_wgrad_compute`` after validation, as the plugin sets it (training_hooks)."""
    import torch

    from megatron_dualpipe.proof import tiny_gpt

    experts = {"num_moe_experts": 4} if moe else {}
    tiny_gpt.seed_all(1234)
    local = tiny_gpt.build_tiny_gpt(tiny_gpt.tiny_gpt_config(num_layers=2, **experts, **overrides))
    grouped = {"moe_grouped_gemm": True} if moe else {}
    te_config = tiny_gpt.tiny_gpt_config(num_layers=2, **experts, **overrides, **grouped)
    te_config.delay_wgrad_compute = delay
    tiny_gpt.seed_all(4321)
    te_model = tiny_gpt.build_tiny_gpt(te_config, layer_spec="te")
    if te_config.bf16:  # as megatron's Float16Module does (the learned position embedding is built FP32)
        local, te_model = local.bfloat16(), te_model.bfloat16()
    kinds = {type(m).__name__ for m in te_model.modules()}
    assert {"TELayerNormColumnParallelLinear", "TEDotProductAttention"} <= kinds, kinds
    assert not moe or "TEGroupedMLP" in kinds, kinds
    source = dict(local.named_parameters())
    with torch.no_grad():
        for name, param in te_model.named_parameters():
            param.copy_(source.pop(local_name(name)))
    assert not source, f"local parameters without a TE counterpart: {sorted(source)}"
    return local, te_model


def run(model, batches, backward=True, num_microbatches=None) -> List[float]:
    """Forward (and backward of loss / number of micro-batches) of each batch; the losses."""
    from megatron_dualpipe.proof.data import masked_loss_func

    losses = []
    for b in batches:
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss, _ = masked_loss_func(b["loss_mask"], out)
        if backward:
            (loss / (num_microbatches or len(batches))).backward()
        losses.append(float(loss.detach()))
    return losses


def compare(local, te_model, local_losses, te_losses, grad_of) -> Dict[str, object]:
    from megatron_dualpipe.proof.compare import Gap

    loss_gap, grad_gap = Gap(), Gap()
    for i, (got, want) in enumerate(zip(te_losses, local_losses)):
        loss_gap.add(got, want, f"micro-batch {i}")
    grads = {n: p for n, p in local.named_parameters()}
    for name, param in te_model.named_parameters():
        want = grad_of(grads[local_name(name)])
        got = grad_of(param)
        assert got is not None, f"{name}: no gradient"
        grad_gap.add(got.detach().float().numpy(), want.detach().float().numpy(), name)
    return {"loss": loss_gap.rel, "grads": grad_gap.rel, "pairs": grad_gap.pairs,
            "lines": [loss_gap.line("losses"), grad_gap.line(f"gradients of {grad_gap.pairs} parameters")]}


def equality_case(moe: bool, **overrides) -> Dict[str, object]:
    """Both specs from the same RNG states (the tracker reseeded in place: TE's attention keeps the
    tracker object it was built with, as real TE does)."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dualpipe.proof.models import ModelSpec

    local, te_model = build_pair(moe, **overrides)
    batches = ModelSpec(layers=2).batches(2)
    losses = []
    for model in (local, te_model):
        torch.manual_seed(99)
        model_parallel_cuda_manual_seed(99)
        losses.append(run(model, batches))
    return compare(local, te_model, *losses, lambda p: p.grad)


def bf16():
    import torch

    return {"params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16, "bf16": True}


def ddp(model, delay: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False,
                                           delay_wgrad_compute=delay)
    return DistributedDataParallel(model.config, config, model)


def te_layer_weights(model):
    """The weights of the TE linears (grouped experts' ``weight{i}`` included)."""
    pattern = re.compile(r"\.linear_fc\d\.weight\d*$|\.linear_(qkv|proj)\.weight$")
    return [p for n, p in model.named_parameters() if pattern.search(n)]


def backward_and_queue(model, queues, batch, num_microbatches=2):
    """One B: the backward, and what it pushed onto each TE module's queue (what its W pops)."""
    before = queues.sizes()
    run(model, [batch], num_microbatches=num_microbatches)
    return queues.pushed_since(before)


def layers_backward_dw(model) -> None:
    """megatron-core's own W of a chunk (its schedule plan's order): each layer's MLP, then attention."""
    for layer in reversed(model.decoder.layers):
        if getattr(layer, "is_moe_layer", False):
            layer.mlp.backward_dw(routed_experts=True, shared_experts=True)
        else:
            layer.mlp.backward_dw()
        layer.self_attention.backward_dw()


def deferred_case(fused: bool, moe: bool = False, megatron_layers: bool = False) -> Dict[str, object]:
    """B, B, W, W under DDP: TE's weight gradients only from backward_dw, equal to the local spec's.
    W is the plugin's (``TEQueues``) or, with ``megatron_layers``, megatron-core's layers' ``backward_dw``."""
    from megatron_dualpipe.mcore.wgrad import TEQueues
    from megatron_dualpipe.proof.models import ModelSpec

    local, te_model = build_pair(moe, delay=True, add_bias_linear=False)
    if fused:
        for module in te_model.modules():
            if hasattr(module, "fuse_wgrad_accumulation"):
                module.fuse_wgrad_accumulation = True
    local_ddp, te_ddp = ddp(local, delay=False), ddp(te_model, delay=True)
    batches = ModelSpec(layers=2).batches(2)
    local_losses = run(local_ddp, batches)
    queues = TEQueues(te_model)
    pushed = [backward_and_queue(te_ddp, queues, b) for b in batches]
    before_w = sum(float(p.main_grad.abs().sum()) for p in te_layer_weights(te_model))
    for each in pushed:
        layers_backward_dw(te_model) if megatron_layers else queues.pop(each)
    queues.check_empty()
    te_losses = [float(x) for x in run(te_ddp, batches, backward=False)]
    result = compare(local, te_model, local_losses, te_losses, lambda p: p.main_grad)
    result.update(before_w=before_w, weights=len(te_layer_weights(te_model)), queued_modules=len(queues.modules),
                  pushed_per_backward=sum(n for _, n in pushed[0]))
    return result


def _w_error(queues, pushed) -> str:
    """Pop each backward's contexts in turn; the first error's type and module, or 'ok'."""
    try:
        for each in pushed:
            queues.pop(each)
    except AttributeError as err:
        return "AttributeError " + str(err).split(".")[0]
    return "ok"


def bias_order_case(order: str, remark_biases: bool) -> str:
    """``order`` 'BWBW' or 'BBWW' with biases under DDP. megatron-core re-creates the biases of its TE
    linears after TE built them when ``use_cpu_initialization`` is on, so they lose TE's
    ``skip_backward_post_hook`` and DDP's hook consumes their gradient in B; ``remark_biases`` marks them
    again, as they stay on a GPU run without ``use_cpu_initialization``."""
    from megatron_dualpipe.mcore.wgrad import TEQueues
    from megatron_dualpipe.proof.models import ModelSpec

    _, te_model = build_pair(False, delay=True)
    if remark_biases:
        for module in te_model.modules():
            if getattr(module, "wgrad_store", None) is not None and module.use_bias:
                module.bias.skip_backward_post_hook = True
    te_ddp = ddp(te_model, delay=True)
    queues = TEQueues(te_model)
    batches = ModelSpec(layers=2).batches(2)
    if order == "BWBW":
        return _w_error(queues, [backward_and_queue(te_ddp, queues, b) for b in batches[:1]]) + " / " + \
            _w_error(queues, [backward_and_queue(te_ddp, queues, b) for b in batches[1:]])
    return _w_error(queues, [backward_and_queue(te_ddp, queues, b) for b in batches])


def tp_rank(rank: int, port: str, queue) -> None:
    """One of two tensor-parallel ranks: both specs, dense and MoE with sequence parallelism, dense without."""
    setup(port, rank=rank, world_size=2, tp=2)
    cases = {"dense": (False, True), "moe": (True, True), "dense without sp": (False, False)}
    queue.put((rank, {case: equality_case(moe=moe, sequence_parallel=sp) for case, (moe, sp) in cases.items()}))


def tp_main(port: str) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ranks = [ctx.Process(target=tp_rank, args=(rank, port, queue)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)
    found = {}
    while not queue.empty():
        rank, cases = queue.get()
        found[rank] = cases
    assert all(p.exitcode == 0 for p in ranks) and len(found) == 2, f"rank exit codes {[p.exitcode for p in ranks]}"
    print("RESULTS " + json.dumps({f"tp2 {case} rank {rank}": found[rank][case] for rank in (0, 1)
                                   for case in found[0]}))


def main() -> None:
    if sys.argv[2:] == ["tp2"]:
        return tp_main(sys.argv[1])
    setup(sys.argv[1])
    import transformer_engine
    from megatron.core.utils import get_te_version

    results = {"te_version": [transformer_engine.__version__, str(get_te_version())],
               "dense": equality_case(moe=False), "moe": equality_case(moe=True),
               "dropout": equality_case(moe=False, attention_dropout=0.2, hidden_dropout=0.2),
               **{f"{case} bf16": equality_case(moe=case == "moe", **bf16()) for case in ("dense", "moe")},
               "deferred": deferred_case(fused=False), "deferred_fused": deferred_case(fused=True),
               "deferred_moe": deferred_case(fused=False, moe=True),
               "deferred_megatron_layers": deferred_case(fused=False, moe=True, megatron_layers=True),
               "bias_order": {f"{order}{' remarked' if remark else ''}": bias_order_case(order, remark)
                              for order, remark in (("BWBW", False), ("BWBW", True), ("BBWW", True))}}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
