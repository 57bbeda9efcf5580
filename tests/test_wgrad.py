"""B/W weight-gradient splitting for megatron-core's local linears (megatron_dualpipe.wgrad).

One process: gloo world of size 1, tp=pp=1. The reference is the same model (same weights, same
inputs) run with megatron-core's own backward; the deferred run does B for two micro-batches under
different keys and W later in the other order.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch

megatron_core = pytest.importorskip("megatron.core")

from megatron.core import ModelParallelConfig, parallel_state  # noqa: E402
from megatron.core.tensor_parallel import layers as mc_layers  # noqa: E402
from megatron.core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)

from megatron_dualpipe import wgrad  # noqa: E402

TOL = 1e-5  # fp32; sums of two micro-batches in a different order


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def dist_world_1():
    """gloo world of size 1 with tp=pp=1 model-parallel groups, and the wgrad patch."""
    created = False
    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        torch.distributed.init_process_group(
            "gloo", rank=0, world_size=1, timeout=datetime.timedelta(minutes=2)
        )
        created = True
    had_mp = parallel_state.model_parallel_is_initialized()
    if not had_mp:
        parallel_state.initialize_model_parallel(1, 1)
    with wgrad.installed():
        yield
    if not had_mp:
        parallel_state.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()


def _config(**overrides) -> ModelParallelConfig:
    kwargs = dict(
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )
    kwargs.update(overrides)
    return ModelParallelConfig(**kwargs)


class Stack(torch.nn.Module):
    """Column(bias) -> gelu -> Row(bias) -> Column(skip_bias_add) -> Row(no bias) -> residual."""

    def __init__(self, config: ModelParallelConfig, hidden: int = 16) -> None:
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.fc1 = ColumnParallelLinear(
            hidden, 4 * hidden, config=config, init_method=init, bias=True, gather_output=False
        )
        self.fc2 = RowParallelLinear(
            4 * hidden, hidden, config=config, init_method=init, bias=True,
            input_is_parallel=True, skip_bias_add=False,
        )
        self.fc3 = ColumnParallelLinear(
            hidden, 2 * hidden, config=config, init_method=init, bias=True,
            gather_output=False, skip_bias_add=True,
        )
        self.fc4 = RowParallelLinear(
            2 * hidden, hidden, config=config, init_method=init, bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )
        with torch.no_grad():  # megatron zeroes biases; make them matter
            for p in (self.fc1.bias, self.fc2.bias, self.fc3.bias):
                p.normal_()

    def forward(self, x):
        h, _ = self.fc1(x)
        h, _ = self.fc2(torch.nn.functional.gelu(h))
        y, b3 = self.fc3(h)
        y, _ = self.fc4(torch.tanh(y + b3))
        return x + y  # residual: the same output gradient also flows around the linears


def _twin(build):
    """Two models from ``build()`` with identical parameters and buffers (megatron modules hold
    process groups, so ``copy.deepcopy`` does not work)."""
    a, b = build(), build()
    with torch.no_grad():
        for x, y in zip([*a.parameters(), *a.buffers()], [*b.parameters(), *b.buffers()]):
            y.copy_(x)
    return a, b


def _weights(model):
    return [p for n, p in model.named_parameters() if n.endswith("weight")]


def _biases(model):
    return [p for n, p in model.named_parameters() if n.endswith("bias")]


def _inputs(n_mb=2, s=5, b=3, h=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, h, generator=g) for _ in range(n_mb)]


def _loss(out, i):
    return (out * (i + 1.0)).square().mean()


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _reference(model, xs):
    """Megatron-core's own backward; returns the inputs' grads."""
    grads = []
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_(True)
        _loss(model(x), i).backward()
        grads.append(x.grad)
    return grads


def _deferred_b(model, store, xs, keys):
    grads = []
    for i, (x, key) in enumerate(zip(xs, keys)):
        x = x.clone().requires_grad_(True)
        out = model(x)
        with store.deferring(key):
            _loss(out, i).backward()
        grads.append(x.grad)
    return grads


def test_deferred_equals_undeferred_two_microbatches_w_out_of_order():
    torch.manual_seed(0)
    ref, dfr = _twin(lambda: Stack(_config()))
    xs = _inputs()

    ref_in_grads = _reference(ref, xs)

    store = wgrad.WeightGradStore()
    keys = [(0, 0), (1, 1)]  # (chunk, mb)
    in_grads = _deferred_b(dfr, store, xs, keys)

    # Input gradients: identical (same ops, same order).
    for a, b in zip(in_grads, ref_in_grads):
        assert torch.equal(a, b)
    # After B, before W: weight grads untouched; bias grads done in B.
    assert all(p.grad is None for p in _weights(dfr))
    bias_diff = _max_diff([p.grad for p in _biases(dfr)], [p.grad for p in _biases(ref)])
    assert bias_diff <= TOL
    assert store.pending() == keys

    assert store.run((1, 1)) == 4  # four linears
    assert store.pending() == [(0, 0)]
    assert store.run((0, 0)) == 4
    store.assert_empty()

    diff = _max_diff([p.grad for p in _weights(dfr)], [p.grad for p in _weights(ref)])
    print(f"layer stack: max |dW| deferred vs undeferred = {diff:.3e}; bias {bias_diff:.3e}")
    assert diff <= TOL


def test_w_between_b_steps_and_pending_w_after_second_b():
    """B0, W0, B1, W1 and B0, B1, W1, W0 give the same result as no deferral."""
    torch.manual_seed(1)
    ref, dfr = _twin(lambda: Stack(_config()))
    xs = _inputs(seed=1)
    _reference(ref, xs)
    store = wgrad.WeightGradStore()
    _deferred_b(dfr, store, xs[:1], ["a"])
    store.run("a")
    x = xs[1].clone().requires_grad_(True)
    out = dfr(x)
    with store.deferring("b"):
        _loss(out, 1).backward()
    store.run("b")
    store.assert_empty()
    assert _max_diff([p.grad for p in _weights(dfr)], [p.grad for p in _weights(ref)]) <= TOL


def test_outside_deferring_the_patch_is_transparent():
    torch.manual_seed(2)
    ref, other = _twin(lambda: Stack(_config()))
    xs = _inputs(seed=2)
    wgrad.uninstall()
    try:
        ref_in = _reference(ref, xs)
    finally:
        wgrad.install()
    got_in = _reference(other, xs)
    for a, b in zip(got_in, ref_in):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_unknown_key_and_leftovers_are_reported():
    torch.manual_seed(3)
    model = Stack(_config())
    store = wgrad.WeightGradStore()
    _deferred_b(model, store, _inputs(seed=3), [(0, 7), (1, 2)])

    with pytest.raises(KeyError, match=r"no deferred weight gradients under key \(0, 9\)"):
        store.run((0, 9))
    with pytest.raises(RuntimeError, match=r"\(0, 7\) \(4 closures\), \(1, 2\) \(4 closures\)"):
        store.assert_empty()
    store.run((0, 7))
    with pytest.raises(KeyError, match=r"already run.*pending keys: \[\(1, 2\)\]"):
        store.run((0, 7))
    with pytest.raises(RuntimeError, match=r"\(1, 2\)"):
        store.assert_empty()
    store.clear()
    store.assert_empty()


def test_key_without_linears_runs_as_no_op_and_blocks_do_not_nest():
    store = wgrad.WeightGradStore()
    x = torch.randn(3, requires_grad=True)
    with store.deferring("norm-only"):
        (x * 2).sum().backward()
    assert store.pending() == ["norm-only"]
    assert store.run("norm-only") == 0
    with store.deferring("outer"):
        with pytest.raises(RuntimeError, match="already open"):
            with wgrad.WeightGradStore().deferring("inner"):
                pass
        with pytest.raises(RuntimeError, match="cannot uninstall"):
            wgrad.uninstall()
    store.run("outer")


def test_deferring_requires_install():
    wgrad.uninstall()
    try:
        with pytest.raises(RuntimeError, match="not installed"):
            with wgrad.WeightGradStore().deferring(0):
                pass
    finally:
        wgrad.install()


# ----------------------------------------------------------------------------------------------
# main_grad: megatron DDP (grad hooks add param.grad into main_grad) and the fusion path


def _ddp_wrap(module, monkeypatch):
    """megatron-core DDP on CPU: its grad buffer is allocated on torch.cuda.current_device()."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    ddp = DistributedDataParallel(config, ddp_config, module)
    monkeypatch.undo()
    return ddp


def test_megatron_ddp_main_grad(monkeypatch):
    torch.manual_seed(4)
    ref_module, dfr_module = _twin(lambda: Stack(_config()))
    ref = _ddp_wrap(ref_module, monkeypatch)
    dfr = _ddp_wrap(dfr_module, monkeypatch)
    wgrad.check_ddp_compatible(dfr)
    for m in (ref, dfr):
        m.zero_grad_buffer()
    xs = _inputs(seed=4)

    _reference(ref, xs)
    store = wgrad.WeightGradStore()
    _deferred_b(dfr, store, xs, [(0, 0), (0, 1)])

    dfr_w = _weights(dfr_module)
    assert all(p.grad is None for p in dfr_w)
    assert all(p.main_grad.abs().max().item() == 0.0 for p in dfr_w), "W-only work ran in B"
    bias_diff = _max_diff(
        [p.main_grad for p in _biases(dfr_module)], [p.main_grad for p in _biases(ref_module)]
    )
    assert bias_diff <= TOL

    store.run((0, 1))
    store.run((0, 0))
    store.assert_empty()
    # DDP's hook moved param.grad into main_grad and cleared it, as in the undeferred run.
    assert all(p.grad is None for p in dfr_module.parameters())
    assert all(p.grad is None for p in ref_module.parameters())
    diff = _max_diff([p.main_grad for p in dfr_w], [p.main_grad for p in _weights(ref_module)])
    print(f"megatron DDP: max |main_grad| deferred vs undeferred = {diff:.3e}; "
          f"bias {bias_diff:.3e}")
    assert diff <= TOL
    assert all(p.main_grad.abs().max().item() > 0 for p in dfr_w)


def test_ddp_overlap_grad_reduce_is_refused():
    class Fake(torch.nn.Module):
        ddp_config = type("C", (), {"overlap_grad_reduce": True})()

    with pytest.raises(ValueError, match="overlap_grad_reduce=False"):
        wgrad.check_ddp_compatible(Fake())


def test_fusion_path_accumulates_into_main_grad():
    """gradient_accumulation_fusion=True (APEX kernel absent here: W falls back to add_).

    megatron-core's own fusion backward needs the APEX kernel, so the reference is plain autograd
    on an identical unfused model, plus a pre-existing main_grad value (accumulation, not copy).
    """
    torch.manual_seed(5)
    ref, dfr = _twin(lambda: Stack(_config()))
    for layer in (dfr.fc1, dfr.fc2, dfr.fc3, dfr.fc4):
        layer.gradient_accumulation_fusion = True
    start = {}
    for p in _weights(dfr):
        p.main_grad = torch.randn_like(p)
        p.grad_added_to_main_grad = False
        start[p] = p.main_grad.clone()
    hook_grads = []

    def make_hook(p):  # stand-in for DDP's hook: must see the dummy grad only in W
        def hook(*unused):
            hook_grads.append(p.grad is not None)
            p.grad = None

        return hook

    accs = []
    for p in _weights(dfr):
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(make_hook(p))
        accs.append(acc)  # keep the accumulators (and their hooks) alive, as DDP does
    xs = _inputs(seed=5)
    _reference(ref, xs)
    store = wgrad.WeightGradStore()
    _deferred_b(dfr, store, xs, ["x", "y"])
    assert all(not p.grad_added_to_main_grad for p in _weights(dfr))
    assert hook_grads == [False] * 8  # B: hooks ran with no gradient
    store.run("y")
    store.run("x")
    assert hook_grads[8:] == [True] * 8  # W: dummy grad handed on, as megatron-core does
    assert all(p.grad_added_to_main_grad for p in _weights(dfr))
    diff = _max_diff(
        [p.main_grad - start[p] for p in _weights(dfr)], [p.grad for p in _weights(ref)]
    )
    print(f"fusion path: max |main_grad delta - ref grad| = {diff:.3e}")
    assert diff <= TOL


# ----------------------------------------------------------------------------------------------
# SequentialMLP (MoE experts of the local spec) and a whole local-spec GPT model


def _cpu_mode():
    from megatron_dualpipe import cpu

    cpu.enable()
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def _tiny_transformer_config(**extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, **extra,
    )


MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
    moe_ffn_hidden_size=16,
    # Expert bias + per-token scale trips an in-place-on-view autograd error in
    # megatron-core's MLP at tp=1 (unrelated to deferral); MoE models run without linear bias.
    add_bias_linear=False,
)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-sequentialmlp"])
def test_local_spec_gpt_model(moe):
    _cpu_mode()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = _tiny_transformer_config(**(MOE if moe else {}))
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    torch.manual_seed(6)
    ref, dfr = _twin(lambda: GPTModel(config, spec, vocab_size=32, max_sequence_length=8))
    assert wgrad.find_undeferred_weights(dfr) == []
    if moe:
        assert any(isinstance(m, SequentialMLP) for m in dfr.modules())

    g = torch.Generator().manual_seed(6)
    batches = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(2)]
    pos = torch.arange(8).unsqueeze(0).expand(2, 8)

    def loss(model, tokens):
        return model(tokens, pos, None, labels=tokens).float().mean()

    for tokens in batches:
        loss(ref, tokens).backward()
    store = wgrad.WeightGradStore()
    for i, tokens in enumerate(batches):
        out = loss(dfr, tokens)
        with store.deferring((0, i)):
            out.backward()

    linear_weights = [
        n for n, m in dfr.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    untouched = [n for n in linear_weights if dfr.get_submodule(n).weight.grad is not None]
    assert untouched == [], f"weight grads computed in B: {untouched}"
    n_rec = store.run((0, 1))
    store.run((0, 0))
    store.assert_empty()
    # Experts that received no token have no linear backward (and no grad, as in the reference).
    assert 0 < n_rec <= len(linear_weights)

    ref_p = dict(ref.named_parameters())
    diffs = {}
    for n, p in dfr.named_parameters():
        if ref_p[n].grad is None:
            assert p.grad is None, n
            continue
        diffs[n] = (p.grad - ref_p[n].grad).abs().max().item()
    worst = max(diffs, key=diffs.get)
    print(
        f"GPTModel ({'MoE SequentialMLP' if moe else 'dense'}, local spec): {n_rec} deferred "
        f"linears in mb1, max |grad| diff over {len(diffs)} params = {diffs[worst]:.3e} ({worst})"
    )
    assert diffs[worst] <= TOL


def test_grouped_mlp_is_reported_not_deferred():
    _cpu_mode()
    from megatron.core.transformer.moe.experts import GroupedMLP

    class Holder(torch.nn.Module):
        pass

    holder = Holder()
    holder.experts = GroupedMLP.__new__(GroupedMLP)  # construction needs grouped_gemm
    torch.nn.Module.__init__(holder.experts)
    assert wgrad.find_undeferred_weights(holder) == ["experts (GroupedMLP: grouped GEMM)"]


def test_patch_targets_megatron_backward():
    cls = mc_layers.LinearWithGradAccumulationAndAsyncCommunication
    assert wgrad.is_installed()
    assert cls.backward is wgrad._backward
    wgrad.uninstall()
    try:
        assert cls.backward is not wgrad._backward
        assert cls.backward.__qualname__.endswith("backward")
    finally:
        wgrad.install()


@pytest.mark.parametrize(
    "allreduce_dgrad, sequence_parallel",
    [(True, False), (False, True)],
    ids=["allreduce_dgrad", "sequence_parallel"],
)
def test_tp_communication_paths_on_a_size_1_group(allreduce_dgrad, sequence_parallel):
    """The dgrad all-reduce and the SP all-gather / reduce-scatter paths of the deferred backward,
    on a tp group of size 1 (collectives are identities; shapes and bookkeeping are exercised).
    The reference is the plain path (no communication)."""
    if sequence_parallel:
        _cpu_mode()  # megatron's forward all-gathers into its global buffer (CUDA-only otherwise)
    from megatron.core.tensor_parallel import linear_with_grad_accumulation_and_async_allreduce

    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(7)
    w_ref = torch.nn.Parameter(torch.randn(6, 4))
    b_ref = torch.nn.Parameter(torch.randn(6))
    w = torch.nn.Parameter(w_ref.detach().clone())
    b = torch.nn.Parameter(b_ref.detach().clone())
    xs = _inputs(s=5, b=2, h=4, seed=7)
    store = wgrad.WeightGradStore()
    for i, x in enumerate(xs):
        x_ref = x.clone().requires_grad_(True)
        y = linear_with_grad_accumulation_and_async_allreduce(
            x_ref, w_ref, b_ref, False, False, False, tp_group=group
        )
        _loss(y, i).backward()
        x_d = x.clone().requires_grad_(True)
        y = linear_with_grad_accumulation_and_async_allreduce(
            x_d, w, b, False, allreduce_dgrad, sequence_parallel, tp_group=group
        )
        with store.deferring(i):
            _loss(y, i).backward()
        assert torch.equal(x_d.grad, x_ref.grad)
    assert w.grad is None
    store.run(1)
    store.run(0)
    assert (w.grad - w_ref.grad).abs().max().item() <= TOL
    assert (b.grad - b_ref.grad).abs().max().item() <= TOL
