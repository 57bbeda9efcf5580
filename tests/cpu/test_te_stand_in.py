"""The CPU mode's Transformer Engine stand-in (``cpu/stand_ins/transformer_engine``) keeps TE's contract.

Each layer is checked against an independent reference written here in plain torch (autograd on the
same math), and the ``delay_wgrad_compute`` protocol as TE's source defines it: a backward leaves the
weight's gradient untouched and queues its work on the module's own first-in first-out store,
``backward_dw()`` pops the oldest entry and *assigns* ``param.grad`` (or accumulates into
``main_grad`` with ``fuse_wgrad_accumulation``). The stand-in is imported under its own name here (no
finder, no megatron-core); tests/cpu/test_te_stand_in_megatron.py runs megatron-core's TE spec on it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_dualpipe.cpu.stand_ins.transformer_engine import pytorch as te
from megatron_dualpipe.cpu.stand_ins.transformer_engine._version import claimed_version, version_tuple
from megatron_dualpipe.cpu.stand_ins.transformer_engine.common import recipe
from megatron_dualpipe.proof.compare import Gap

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode tests; on a GPU machine CPU mode is never active"
)

RTOL = 1e-6


def close(name, got, want, rtol=RTOL):
    """Print how far ``got`` is from ``want`` (relative to the largest reference value) and check it."""
    gap = Gap()
    gap.add(got.detach(), want.detach())
    print(f"  {gap.line(name)}")
    assert gap.rel <= rtol, gap.line(name)


def linear(delay=False, bias=False, fuse=False, return_bias=False, din=8, dout=6, seed=0):
    torch.manual_seed(seed)
    return te.Linear(din, dout, bias=bias, return_bias=return_bias, delay_wgrad_compute=delay,
                     fuse_wgrad_accumulation=fuse, params_dtype=torch.float32, device="cpu")


def batch(seed, rows=5, din=8, dout=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, din, generator=g, requires_grad=True), torch.randn(rows, 2, dout, generator=g)


def reference_wgrad(x, dy):
    """dW = dY^T X, independently of the stand-in's GEMM."""
    return torch.einsum("sbo,sbi->oi", dy, x.detach())


# ----------------------------------------------------------------------------------------------------
# delay_wgrad_compute


def test_deferred_weight_gradients_come_out_first_in_first_out():
    """Two backwards, then two backward_dw(): nothing before, the first backward's gradient, then the
    second's (TE assigns .grad, it does not add), and the input gradients already in B."""
    layer = linear(delay=True)
    (x1, dy1), (x2, dy2) = batch(1), batch(2)
    for x, dy in ((x1, dy1), (x2, dy2)):
        layer(x).backward(dy)
        close("dgrad in B", x.grad, dy @ layer.weight.detach())
    assert layer.weight.grad is None, "the weight got its gradient in B"
    assert layer.wgrad_store.size() == 2
    layer.backward_dw()
    close("W 1 = backward 1", layer.weight.grad, reference_wgrad(x1, dy1))
    layer.backward_dw()
    close("W 2 = backward 2", layer.weight.grad, reference_wgrad(x2, dy2))
    with pytest.raises(RuntimeError, match="Pop empty queue"):
        layer.backward_dw()


def test_without_deferral_the_weight_gradient_accumulates_in_b():
    layer = linear(delay=False)
    (x1, dy1), (x2, dy2) = batch(1), batch(2)
    layer(x1).backward(dy1)
    layer(x2).backward(dy2)
    close("B accumulates", layer.weight.grad, reference_wgrad(x1, dy1) + reference_wgrad(x2, dy2))
    layer.backward_dw()  # a no-op without deferral
    assert not layer.need_backward_dw()


def test_fused_accumulation_goes_into_main_grad_at_w_only():
    """fuse_wgrad_accumulation: main_grad untouched in B, added to in W (copied for a first
    micro-batch); megatron's dummy gradient to autograd and grad_added_to_main_grad set."""
    layer = linear(delay=True, fuse=True)
    start = torch.randn(6, 8)
    layer.weight.main_grad = start.clone()
    layer.weight.grad_added_to_main_grad = False
    (x1, dy1), (x2, dy2) = batch(1), batch(2)
    layer(x1, is_first_microbatch=False).backward(dy1)
    layer(x2, is_first_microbatch=False).backward(dy2)
    close("main_grad before W", layer.weight.main_grad, start)
    assert layer.weight.grad_added_to_main_grad is True
    layer.backward_dw()
    close("main_grad after W 1", layer.weight.main_grad, start + reference_wgrad(x1, dy1))
    layer.backward_dw()
    close("main_grad after W 2", layer.weight.main_grad,
          start + reference_wgrad(x1, dy1) + reference_wgrad(x2, dy2))
    layer(x1, is_first_microbatch=True).backward(dy1)
    layer.backward_dw()
    close("first micro-batch overwrites", layer.weight.main_grad, reference_wgrad(x1, dy1))


def test_fused_accumulation_without_megatrons_attribute_gives_autograd_nothing():
    layer = linear(delay=False, fuse=True)
    layer.weight.main_grad = torch.zeros(6, 8)
    x, dy = batch(3)
    layer(x).backward(dy)
    assert layer.weight.grad is None
    close("main_grad in B", layer.weight.main_grad, reference_wgrad(x, dy))


def test_deferred_bias_gradient_goes_with_the_weight_and_a_returned_bias_cannot():
    """A bias added in the GEMM gets its gradient in W (TE fuses it into the wgrad GEMM). A returned
    bias (return_bias=True) gets it from the caller's graph; if it is None at W, TE fails: so does this."""
    layer = linear(delay=True, bias=True)
    x, dy = batch(4)
    layer(x).backward(dy)
    assert layer.bias.grad is None
    layer.backward_dw()
    close("bias grad in W", layer.bias.grad, dy.sum(dim=(0, 1)))
    returned = linear(delay=True, bias=True, return_bias=True)
    out, b = returned(x)
    (out + b).backward(dy)
    returned.backward_dw()  # the caller's graph gave the bias its gradient in B: kept
    close("returned bias grad", returned.bias.grad, dy.sum(dim=(0, 1)))
    out, b = returned(x)
    out.backward(dy)  # this backward gives the bias nothing
    returned.bias.grad = None
    with pytest.raises(AttributeError, match="Transformer Engine fails here too"):
        returned.backward_dw()


def test_backward_dw_runs_the_wgrad_hooks_after_assigning():
    layer = linear(delay=True)
    seen = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(layer.weight.grad.clone()))
    assert layer.weight.skip_backward_post_hook is True
    x, dy = batch(5)
    layer(x).backward(dy)
    assert not seen
    layer.backward_dw()
    assert len(seen) == 1
    close("hook sees W's gradient", seen[0], reference_wgrad(x, dy))


# ----------------------------------------------------------------------------------------------------
# GroupedLinear


def test_grouped_linear_splits_rows_per_expert_and_defers_every_expert():
    torch.manual_seed(0)
    layer = te.GroupedLinear(3, 8, 6, bias=True, delay_wgrad_compute=True, params_dtype=torch.float32,
                             device="cpu")
    splits = [4, 0, 3]
    x = torch.randn(7, 8, requires_grad=True)
    dy = torch.randn(7, 6)
    weights = [getattr(layer, f"weight{i}").detach().clone().requires_grad_() for i in range(3)]
    biases = [getattr(layer, f"bias{i}").detach().clone().requires_grad_() for i in range(3)]
    xr = x.detach().clone().requires_grad_()
    want = torch.cat([F.linear(part, w, b) for part, w, b in zip(torch.split(xr, splits), weights, biases)])
    want.backward(dy)
    out = layer(x, splits)
    close("grouped forward", out, want)
    out.backward(dy)
    close("grouped dgrad in B", x.grad, xr.grad)
    assert all(getattr(layer, f"weight{i}").grad is None for i in range(3))
    layer.backward_dw()
    for i in range(3):
        close(f"expert {i} weight grad", getattr(layer, f"weight{i}").grad, weights[i].grad)
        close(f"expert {i} bias grad", getattr(layer, f"bias{i}").grad, biases[i].grad)


def test_grouped_linear_on_an_empty_queue_does_what_the_claimed_release_does():
    """TE 2.14 made GroupedLinear.backward_dw return on an empty queue; 2.11 raises (as Linear still does)."""
    layer = te.GroupedLinear(2, 4, 4, bias=False, delay_wgrad_compute=True, device="cpu")
    print(f"  claimed Transformer Engine {claimed_version()}")
    if version_tuple() >= (2, 14):
        layer.backward_dw()
    else:
        with pytest.raises(RuntimeError, match="Pop empty queue"):
            layer.backward_dw()


# ----------------------------------------------------------------------------------------------------
# Numerics of the other layers


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_equals_norm_then_linear(normalization):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(8, 12, eps=1e-5, normalization=normalization, bias=True,
                               params_dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.uniform_(-0.5, 0.5)
    ref = copy.deepcopy(layer)
    x, dy = torch.randn(5, 2, 8, requires_grad=True), torch.randn(5, 2, 12)
    xr = x.detach().clone().requires_grad_()
    if normalization == "LayerNorm":
        normed = F.layer_norm(xr, (8,), ref.layer_norm_weight, ref.layer_norm_bias, 1e-5)
    else:
        normed = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * ref.layer_norm_weight
    want = normed @ ref.weight.t() + ref.bias
    want.backward(dy)
    got = layer(x)
    got.backward(dy)
    close(f"{normalization}Linear forward", got, want)
    close("input grad", x.grad, xr.grad)
    for name, param in layer.named_parameters():
        close(f"{name} grad", param.grad, dict(ref.named_parameters())[name].grad, rtol=1e-5)


@pytest.mark.parametrize("qkv_format,groups", [("sbhd", 4), ("bshd", 2)])
def test_dot_product_attention_equals_torch_sdpa(qkv_format, groups):
    """Causal attention with grouped-query heads against torch's scaled_dot_product_attention."""
    torch.manual_seed(0)
    s, b, h, d = 6, 2, 4, 8
    attn = te.DotProductAttention(h, d, num_gqa_groups=groups, qkv_format=qkv_format, attn_mask_type="causal")
    q, k, v = torch.randn(s, b, h, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rep = h // groups
    want = F.scaled_dot_product_attention(qb.permute(1, 2, 0, 3), kb.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
                                          vb.repeat_interleave(rep, 2).permute(1, 2, 0, 3), is_causal=True)
    want = want.permute(2, 0, 1, 3).reshape(s, b, h * d)
    dy = torch.randn_like(want)
    want.backward(dy)
    if qkv_format == "bshd":
        got = attn(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    else:
        got = attn(q, k, v)
    got.backward(dy)
    close("attention forward", got, want, rtol=1e-5)
    for name, mine, ref in (("dq", q, qb), ("dk", k, kb), ("dv", v, vb)):
        close(name, mine.grad, ref.grad, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Autocast, RNG tracker, checkpoint


RECIPES = [recipe.DelayedScaling(), recipe.Float8CurrentScaling(), recipe.MXFP8BlockScaling(),
           recipe.Float8BlockScaling(), recipe.NVFP4BlockScaling()]


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_every_recipe_enters_the_autocast_as_a_numerics_no_op(fp8_recipe):
    layer = linear(bias=True)
    x, _ = batch(6)
    plain = layer(x)
    outer = recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)
    with te.fp8_autocast(enabled=True, fp8_recipe=outer):
        with te.autocast(enabled=True, recipe=fp8_recipe):
            assert te.fp8.FP8GlobalStateManager.is_fp8_enabled()
            quantized = layer(x)
            assert layer.autocast_recipe is fp8_recipe
        assert te.fp8.FP8GlobalStateManager.get_fp8_recipe() is outer
    assert not te.fp8.FP8GlobalStateManager.is_fp8_enabled()
    close(f"{type(fp8_recipe).__name__} output", quantized, plain, rtol=0.0)
    layer(x)
    assert layer.autocast_recipe is None


def test_rng_tracker_forks_a_named_cpu_stream_and_checkpoint_replays_it():
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(7)
    with tracker.fork():
        first = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(7)
    close("the default stream is left as it was", after_fork, torch.rand(3), rtol=0.0)
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second), "the named stream did not advance"

    def block(x):
        with tracker.fork():
            return F.dropout(x, p=0.5, training=True) * 3.0

    x = torch.randn(64, requires_grad=True)
    states = tracker.get_states()
    plain = block(x)
    plain.sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    tracker.set_states(states)
    recomputed = te.checkpoint(block, x, get_rng_state_tracker=lambda: tracker)
    close("checkpoint forward (same dropout mask)", recomputed, plain, rtol=0.0)
    recomputed.sum().backward()
    close("checkpoint backward", x.grad, want_grad, rtol=0.0)


# ----------------------------------------------------------------------------------------------------
# The finder (stand_ins.install): in one fresh interpreter, sys.modules here untouched

_FINDER_CHECK = r"""
import importlib, sys
from megatron_dualpipe.cpu import stand_ins

OURS = "megatron_dualpipe.cpu.stand_ins.transformer_engine"

def importable(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False

def phase(tag):
    before = importable("transformer_engine")
    stood_in = stand_ins.install(["transformer_engine"])
    import transformer_engine
    print(tag, "before", before, "stood_in", stood_in, "version", transformer_engine.__version__)
    print(tag, "file", transformer_engine.__file__)
    print(tag, "same_package", transformer_engine is sys.modules.get(OURS))
    if stood_in:
        from transformer_engine.pytorch.module import linear
        print(tag, "same_submodule", linear is sys.modules.get(OURS + ".pytorch.module.linear"),
              "one_class", linear.Linear is transformer_engine.pytorch.Linear)
    stand_ins.uninstall()
    print(tag, "after_uninstall", importable("transformer_engine"),
          sorted(n for n in sys.modules if n.partition(".")[0] == "transformer_engine"))
    for name in [n for n in sys.modules if n.partition(".")[0] == "transformer_engine"]:
        del sys.modules[name]

phase("absent")
sys.path.insert(0, sys.argv[1])  # a (fake) real Transformer Engine appears
importlib.invalidate_caches()
phase("installed")
"""


@pytest.fixture(scope="module")
def finder_runs(tmp_path_factory):
    """What the finder did without a real Transformer Engine and with a (fake) one on sys.path."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real Transformer Engine is installed here")
    fake = tmp_path_factory.mktemp("real_te")
    (fake / "transformer_engine").mkdir()
    (fake / "transformer_engine" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    done = subprocess.run([sys.executable, "-c", _FINDER_CHECK, str(fake)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    seen = {}
    for line in done.stdout.splitlines():
        tag, key, rest = line.split(None, 2)
        seen.setdefault(tag, {})[key] = rest
    return seen, fake


def test_the_finder_stands_in_only_without_the_real_library(finder_runs):
    from importlib.metadata import version

    seen = finder_runs[0]["absent"]
    print(seen)
    claim = "2.17.0" if tuple(int(p) for p in version("megatron-core").split(".")[:2]) >= (0, 19) else "2.11.0"
    assert seen["before"] == f"False stood_in ['transformer_engine'] version {claim}"
    assert seen["same_package"] == "True"
    assert seen["same_submodule"] == "True one_class True", "a submodule was loaded twice, under two names"
    assert seen["after_uninstall"] == "False []"


def test_the_finder_never_shadows_an_installed_library(finder_runs):
    seen, fake = finder_runs[0]["installed"], finder_runs[1]
    print(seen)
    assert seen["before"] == "True stood_in [] version 9.9.9"
    assert seen["file"] == str(fake / "transformer_engine" / "__init__.py")
    assert seen["same_package"] == "False"
