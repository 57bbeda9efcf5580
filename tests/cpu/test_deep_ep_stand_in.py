"""The DeepEP stand-in (``megatron_dualpipe.cpu.stand_ins.deep_ep``) keeps DeepEP's contract.

Contract: on 4 gloo ranks with uneven token counts, ``get_dispatch_layout``, ``dispatch`` (fresh and
cached) and ``combine`` give what plain Python loops over every rank's inputs say DeepEP gives:
the layout, the received rows in source-rank then token order with their top-k mapped to local
experts (-1 and weight 0 elsewhere), the per-expert counts, each token's rows summed back (with
biases, weights, and the top-k weights themselves). Every rank regenerates every rank's inputs
from its seed, so the reference needs no communication and shares no code with the stand-in.

megatron-core: a tiny MoE GPT at ep=2 with the flex dispatcher on the stand-in equals the same
model with the alltoall dispatcher, on the same weights and inputs: the loss and every gradient.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch

from harness import megatron_env as me
from harness import workers

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode stand-in; on a GPU machine the real DeepEP runs"
)

HIDDEN, EXPERTS, TOPK = 16, 8, 3
#: Gradients of the two bfloat16 models: the same sums in another order round differently.
RTOL_BF16 = 1e-2


def _inputs(rank):
    """Rank ``rank``'s tokens (bfloat16), top-k indices (some -1) and float32 weights."""
    gen = torch.Generator().manual_seed(1000 + rank)
    num_tokens = 5 + 3 * rank
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(num_tokens, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    idx[0] = -1  # a token that goes nowhere
    idx[1, 0] = -1  # a partly masked selection
    weights = torch.rand(num_tokens, TOPK, generator=gen)
    return x, idx.contiguous(), weights


def _reference_layout(idx, world):
    """(tokens per rank, tokens per expert, is_token_in_rank) by loops."""
    per_rank_experts = EXPERTS // world
    in_rank = [[False] * world for _ in range(idx.size(0))]
    per_expert = [0] * EXPERTS
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // per_rank_experts] = True
    per_rank = [sum(row[r] for row in in_rank) for r in range(world)]
    return per_rank, per_expert, in_rank


def _reference_receive(me_rank, world):
    """What ``me_rank`` receives: rows, local top-k, masked weights, source token, per-expert counts."""
    local = EXPERTS // world
    rows, topk, weights, source, counts = [], [], [], [], [0] * local
    for src in range(world):
        x, idx, w = _inputs(src)
        for t, row in enumerate(idx.tolist()):
            mine = [e - me_rank * local if me_rank * local <= e < (me_rank + 1) * local else -1 for e in row]
            if all(m < 0 for m in mine):
                continue
            rows.append(x[t])
            topk.append(mine)
            weights.append([float(w[t, k]) if m >= 0 else 0.0 for k, m in enumerate(mine)])
            source.append(t)
            for m in mine:
                counts[m] += m >= 0
    return torch.stack(rows), torch.tensor(topk), torch.tensor(weights), torch.tensor(source), counts


def _gap(got, want):
    """max |got - want| over max |want| (in float64), printed by the tests."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def _init_gloo(rank, world, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))


def _layout_and_dispatch(buffer, rank, world, report):
    import deep_ep

    x, idx, w = _inputs(rank)
    per_rank, rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
        idx, EXPERTS, previous_event=deep_ep.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    want = _reference_layout(idx, world)
    report["layout equal"] = (per_rank.tolist() == want[0] and per_expert.tolist() == want[1]
                              and in_rank.tolist() == want[2] and rdma is None and event.event is not None)
    report["layout dtypes"] = (per_rank.dtype, per_expert.dtype, in_rank.dtype)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    rows, topk, weights, source, want_counts = _reference_receive(rank, world)
    report["received rows"] = recv_x.size(0)
    report["rows gap"] = _gap(recv_x, rows) if recv_x.shape == rows.shape else float("inf")
    report["topk idx equal"] = recv_idx.tolist() == topk.tolist()
    report["topk weights gap"] = _gap(recv_w, weights) if recv_w.shape == weights.shape else float("inf")
    report["source equal"] = handle[3].tolist() == source.tolist()
    report["counts"] = (counts, want_counts)
    return x, idx, w, recv_x, recv_w, handle


def _combine_checks(buffer, x, idx, w, recv_x, recv_w, handle, report):
    world = buffer.group_size
    sent_to = torch.tensor(_reference_layout(idx, world)[2], dtype=torch.float64).sum(1, keepdim=True)
    combined, none_weights, _ = buffer.combine(recv_x, handle)
    report["plain combine gap"] = _gap(combined, (x.double() * sent_to).to(torch.bfloat16))
    report["plain combine weights"] = none_weights
    scaled = (recv_x.float() * recv_w.sum(1, keepdim=True)).to(torch.bfloat16)
    combined, back_w, _ = buffer.combine(scaled, handle, topk_weights=recv_w)
    report["weighted combine gap"] = _gap(combined, x.double() * (w.double() * (idx >= 0)).sum(1, keepdim=True))
    report["combined topk weights gap"] = _gap(back_w, w * (idx >= 0))
    bias = (torch.ones_like(x), torch.full_like(x, 0.5))
    combined, _, _ = buffer.combine(recv_x, handle, bias=bias)
    report["biased combine gap"] = _gap(combined, x.double() * sent_to + 1.5)


def _cached_dispatch_checks(buffer, rank, world, x, handle, report):
    again, *nothing, event = buffer.dispatch(x * 2, handle=handle)
    rows = _reference_receive(rank, world)[0]
    report["cached dispatch gap"] = _gap(again, rows.double() * 2) if again.shape == rows.shape else float("inf")
    report["cached dispatch rest"] = nothing + [event.event]


def _refusals(buffer, x, recv_x, handle):
    """The misuses DeepEP refuses, refused before any communication (so no rank waits)."""
    import deep_ep

    cases = {
        "float32 combine": lambda: buffer.combine(recv_x.float(), handle),
        "comm-stream allocation without an event": lambda: buffer.combine(
            recv_x, handle, async_finish=True, allocate_on_comm_stream=True),
        "a buffer too small": lambda: deep_ep.Buffer(buffer.group, 128).combine(recv_x, handle),
        "a 3-d x": lambda: buffer.dispatch(x.unsqueeze(0), handle=handle),
    }
    refused = {}
    for name, call in cases.items():
        try:
            call()
            refused[name] = "accepted"
        except RuntimeError as error:
            refused[name] = str(error)
    return refused


def _contract_worker(rank, world, port):
    from megatron_dualpipe.cpu import stand_ins

    assert stand_ins.install(["deep_ep"]) == ["deep_ep"]
    import deep_ep

    _init_gloo(rank, world, port)
    try:
        group = torch.distributed.new_group(list(range(world)))
        config = deep_ep.Buffer.get_dispatch_config(world)
        nvl_bytes = config.get_nvl_buffer_size_hint(HIDDEN * 2, world)
        buffer = deep_ep.Buffer(group, nvl_bytes, 0)
        report = {"module": deep_ep.__name__, "nvl bytes": nvl_bytes}
        x, idx, w, recv_x, recv_w, handle = _layout_and_dispatch(buffer, rank, world, report)
        _combine_checks(buffer, x, idx, w, recv_x, recv_w, handle, report)
        _cached_dispatch_checks(buffer, rank, world, x, handle, report)
        report["refusals"] = _refusals(buffer, x, recv_x, handle)
        return report
    finally:
        torch.distributed.destroy_process_group()


def test_dispatch_and_combine_equal_deepeps_contract():
    reports = workers.run_workers(_contract_worker, world_size=4, timeout=60)
    exact = ("rows gap", "topk weights gap", "plain combine gap", "combined topk weights gap", "cached dispatch gap")
    for rank, report in enumerate(reports):
        print(f"\nrank {rank}: {report['received rows']} rows received, per local expert {report['counts'][0]} "
              f"(reference {report['counts'][1]}); layout equal {report['layout equal']}")
        rounded = ("weighted combine gap", "biased combine gap")
        print("  " + ", ".join(f"{k} {report[k]:.3g}" for k in exact + rounded))
        assert report["module"] == "megatron_dualpipe.cpu.stand_ins.deep_ep"
        assert report["layout equal"] and report["layout dtypes"] == (torch.int32, torch.int32, torch.bool)
        assert report["topk idx equal"] and report["source equal"]
        assert report["counts"][0] == report["counts"][1]
        assert all(report[k] == 0.0 for k in exact), {k: report[k] for k in exact}
        assert report["plain combine weights"] is None
        assert report["cached dispatch rest"] == [None, None, None, None, None]
        # one bfloat16 rounding of a float32 sum, against float64
        assert report["weighted combine gap"] <= 8e-3 and report["biased combine gap"] <= 8e-3
        for name, outcome in report["refusals"].items():
            if rank == 0:
                print(f"  refused {name}: {outcome}")
            assert outcome.startswith("DeepEP (CPU stand-in): assertion failed"), (name, outcome)


# ----------------------------------------------------------------------------------------------
# megatron-core's flex dispatcher on the stand-in


#: The two ways to ask for the DeepEP backend: its name, and the deprecated switch that sets it.
DEEPEP_FLAGS = {"backend": {"moe_flex_dispatcher_backend": "deepep"}, "enable_deepep": {"moe_enable_deepep": True}}


def _flex_worker(rank, world, port, grouped, flag):
    """The same tiny MoE GPT (ep=world) with the alltoall dispatcher and with flex / DeepEP."""
    from harness import stand_in_moe as moe

    moe.start(rank, world, port, ["deep_ep", "grouped_gemm"] if grouped else ["deep_ep"], ep=world)
    try:
        from megatron.core.transformer.moe import fused_a2a, token_dispatcher

        assert fused_a2a.HAVE_DEEP_EP and token_dispatcher.fused_dispatch is fused_a2a.fused_dispatch
        batch = moe.DATA.batches(world, seed=11)[rank]
        reference = moe.build(moe.moe_config("alltoall"))
        state = moe.grouped_state(reference) if grouped else reference.module.state_dict()
        flex = moe.build(moe.moe_config("flex", grouped=grouped, **DEEPEP_FLAGS[flag]), state)
        mlp = flex.module.decoder.layers[0].mlp
        assert type(mlp.token_dispatcher).__name__ == "MoEFlexTokenDispatcher", type(mlp.token_dispatcher)
        assert type(mlp.experts).__name__ == ("GroupedMLP" if grouped else "SequentialMLP"), type(mlp.experts)
        want_loss, want = moe.loss_and_grads(reference, batch)
        got_loss, got = moe.loss_and_grads(flex, batch)
        if grouped:
            got = moe.sequential_grads(got, flex.config)
        used = type(fused_a2a._buffer).__module__
        return want_loss, got_loss, want, got, used
    finally:
        me.destroy_distributed()


@pytest.mark.parametrize("grouped, flag", [(False, "backend"), (False, "enable_deepep"), (True, "backend")],
                         ids=["sequential", "sequential-enable_deepep", "grouped_gemm"])
def test_flex_dispatcher_equals_alltoall(grouped, flag):
    from harness import stand_in_moe as moe

    if grouped and not moe.has_legacy_grouped_mlp():
        pytest.skip("megatron-core >= 0.19 has no legacy GroupedMLP (grouped_gemm is not used)")
    results = me.run_workers(_flex_worker, world_size=2, args=(grouped, flag), timeout=120)
    experts = "GroupedMLP on the grouped_gemm stand-in" if grouped else "SequentialMLP"
    print(f"\nflex dispatcher (DeepEP stand-in, {DEEPEP_FLAGS[flag]}), {experts}, vs alltoall with "
          "SequentialMLP, ep=2, bfloat16")
    for rank, (want_loss, got_loss, want, got, used) in enumerate(results):
        assert used == "megatron_dualpipe.cpu.stand_ins.deep_ep.buffer", used
        print(f"  rank {rank}: loss {got_loss:.6f} vs {want_loss:.6f} (diff {abs(got_loss - want_loss):.2e})")
        assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
        moe.compare(f"rank {rank} gradients", got, want, rtol=RTOL_BF16)
