"""Zero-bubble weight-gradient splitting (B/W) for megatron-core's local linear layers.

A B step computes only input gradients; the weight-gradient GEMMs it skips are recorded and run by a
later W step. ``install()`` once per process; one :class:`WeightGradStore` per executor, never global::

    with store.deferring((chunk, mb)):   # B: input grads now, weight grads recorded
        backward_step(...)
    store.run((chunk, mb))               # W, for any recorded key, in any order
    store.assert_empty()                 # end of the iteration

Deferred: every backward through ``LinearWithGradAccumulationAndAsyncCommunication`` (the local spec's
linears, the output layer, SequentialMLP, shared experts). Biases stay in B (a cheap column sum, and their
autograd path and DDP hook untouched), as do norms, embeddings, routers and the legacy GroupedMLP; Transformer
Engine defers through its own ``delay_wgrad_compute`` queues (:class:`TEQueues`). :class:`DeferralAudit`
finds the weights that got their gradient in B anyway.

``install()`` replaces the class's static ``backward`` (looked up when a node runs, so graphs built before are
covered); it reads one process-wide slot, not thread-local because autograd runs backward nodes on its own
device threads: one ``deferring()`` block per process. In W the gradient reaches the weight as the original's
would (its ``AccumulateGrad``, or ``main_grad`` with ``gradient_accumulation_fusion``), on the caller's stream,
outside B's autocast; DDP's hook fires in B with no gradient, which ``overlap_grad_reduce`` asserts against
(:func:`check_ddp_compatible`). With sequence parallelism B gathers the input into its own buffer, kept to W.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Set, Tuple

import torch

__all__ = ["WeightGradStore", "install", "uninstall", "is_installed", "installed", "find_undeferred_weights",
           "check_ddp_compatible", "offers_te_backward_dw", "TEQueues", "DeferralAudit"]


#: The one hook point between ``WeightGradStore.deferring`` and the patched backward.
_ACTIVE = types.SimpleNamespace(sink=None, key=None)
#: What ``install()`` replaced (``cls``, the original staticmethod's ``original_fn``, megatron's
#: ``custom_bwd(_deferred_backward)`` as ``deferred``), so that ``uninstall()`` can put it back.
_PATCH = types.SimpleNamespace(cls=None, original_fn=None, deferred=None)

# Bound at install() from megatron-core, so the hot path looks nothing up in megatron's modules.
_mc: Dict[str, Any] = {}


class WeightGradStore:
    """Deferred weight-gradient work, keyed (e.g. by ``(chunk, mb)``), not a FIFO; no class-level state."""

    def __init__(self) -> None:
        self._pending: Dict[Hashable, List[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Record the local linears' weight-gradient work under ``key`` instead of doing it. ``key`` is
        registered even if no linear runs, so ``run(key)`` is valid after any B; blocks do not nest."""
        if _PATCH.cls is None:
            raise RuntimeError("megatron_dualpipe.mcore.wgrad is not installed: call wgrad.install() once before "
                               "WeightGradStore.deferring()")
        if _ACTIVE.sink is not None:
            raise RuntimeError(f"cannot defer weight gradients under key {key!r}: a deferring() block for key "
                               f"{_ACTIVE.key!r} is already open (blocks do not nest; one per process)")
        sink = self._pending.setdefault(key, [])
        _ACTIVE.sink, _ACTIVE.key = sink, key
        try:
            yield
        finally:
            _ACTIVE.sink, _ACTIVE.key = None, None

    def record(self, key: Hashable, fn: Callable[[], None]) -> None:
        """Add a weight-gradient closure under ``key`` (e.g. a TE ``backward_dw`` call)."""
        self._pending.setdefault(key, []).append(fn)

    def run(self, key: Hashable) -> int:
        """Run (and forget) the closures recorded under ``key``, in recording order; returns how many ran."""
        fns = self._pending.pop(key, None)
        if fns is None:
            raise KeyError(f"no deferred weight gradients under key {key!r} (never deferred, or already "
                           f"run); pending keys: {self.pending()!r}")
        for fn in fns:
            fn()
        return len(fns)

    def pending(self) -> List[Hashable]:
        """Keys with recorded, not yet run, weight-gradient work (in first-recorded order)."""
        return list(self._pending)

    def assert_empty(self) -> None:
        """Raise ``RuntimeError`` naming every leftover key (with its closure count)."""
        if self._pending:
            leftovers = ", ".join(f"{k!r} ({len(v)} closures)" for k, v in self._pending.items())
            raise RuntimeError(f"WeightGradStore has {len(self._pending)} key(s) whose weight gradients were "
                               f"never computed (W step missing): {leftovers}")

    def clear(self) -> None:
        """Drop all pending work (e.g. after a failed iteration), freeing the kept tensors."""
        self._pending.clear()


def _backward(ctx, grad_output):
    """Replacement for ``LinearWithGradAccumulationAndAsyncCommunication.backward``."""
    sink = _ACTIVE.sink
    # megatron-core 0.19's GTP (gtp_remat_size > 1) re-gathers and reduce-scatters the weight
    # around the GEMMs: left to the original backward, like the grad_output_buffer path.
    if sink is None or ctx.grad_output_buffer is not None or getattr(ctx, "gtp_remat_size", 1) > 1:
        return _PATCH.original_fn(ctx, grad_output)
    return _PATCH.deferred(ctx, grad_output, sink)


def _deferred_backward(ctx, grad_output, sink):
    """megatron-core's backward minus the weight-gradient GEMM, which goes to ``sink``: ``tensor_parallel/layers.py``
    0.16.1 lines 495-626 (the same at 0.19 but GTP). One gradient per forward input: 9 at 0.16.1, 10 at 0.19."""
    untouched = (None,) * (len(ctx.needs_input_grad) - 3)  # the non-tensor forward arguments
    input, weight = ctx.saved_tensors
    main_grad = ctx.main_grad
    tp_group = ctx.tp_group
    if ctx.gradient_accumulation_fusion:
        if main_grad is None:
            raise RuntimeError("gradient_accumulation_fusion is on but the weight had no main_grad at forward")
        weight.main_grad = main_grad

    handle = None
    if ctx.sequence_parallel:
        dim_size = list(input.size())
        dim_size[0] = dim_size[0] * tp_group.size()
        # Own buffer (not get_global_memory_buffer()): it is kept until W.
        total_input = torch.empty(dim_size, dtype=input.dtype, device=input.device)
        handle = _mc["all_gather"](total_input, input, group=tp_group, async_op=True)
    else:
        total_input = input

    grad_input = grad_output.matmul(weight)

    if handle is not None:
        handle.wait()
    grad_output, total_input = _mc["prepare"](grad_output, total_input)

    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        assert not ctx.allreduce_dgrad
        sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype, device=grad_input.device,
                                     requires_grad=False)
        handle = _mc["reduce_scatter"](sub_grad_input, grad_input, group=tp_group, async_op=True)

    grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    sink.append(_WeightGrad(weight, grad_output, total_input, main_grad, ctx.gradient_accumulation_fusion))

    if ctx.sequence_parallel:
        handle.wait()
        return (sub_grad_input, None, grad_bias, *untouched)
    if ctx.allreduce_dgrad:
        handle.wait()
    return (grad_input, None, grad_bias, *untouched)


class _WeightGrad:
    """One deferred weight-gradient GEMM and its hand-off; called by ``WeightGradStore.run``."""

    __slots__ = ("weight", "grad_output", "total_input", "main_grad", "fusion")

    def __init__(self, weight, grad_output, total_input, main_grad, fusion):
        self.weight, self.grad_output, self.total_input, self.main_grad, self.fusion = (
            weight, grad_output, total_input, main_grad, fusion)

    @torch.no_grad()  # as inside the autograd engine, where the undeferred backward runs
    def __call__(self) -> None:
        weight, grad_output, total_input = self.weight, self.grad_output, self.total_input
        self.grad_output = self.total_input = None  # free as soon as this returns
        if not self.fusion:
            # AccumulateGrad (+ its hooks, e.g. DDP's main_grad add) as in the undeferred backward.
            torch.autograd.backward(weight, grad_output.t().matmul(total_input))
            return
        weight.main_grad = self.main_grad
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
        else:
            _accumulate_wgrad(total_input, grad_output, weight.main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            new = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            dummy = new(weight.main_grad.shape, dtype=total_input.dtype, device=weight.main_grad.device)
            weight.grad_added_to_main_grad = True
            torch.autograd.backward(weight, dummy)
        # else: the original returned None for the weight, and its accumulator already ran in B.


def _accumulate_wgrad(total_input, grad_output, main_grad) -> None:
    kernel = _mc.get("fused_wgrad")
    if kernel is not None and main_grad.is_cuda:
        if main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    main_grad.add_(grad_output.t().matmul(total_input))


def deferrable_backward(original):
    """The hooks manifest's replacement of the linear's ``backward``; binds what the hot path needs."""
    from megatron.core import utils as mc_utils
    from megatron.core.tensor_parallel import layers

    cls = layers.LinearWithGradAccumulationAndAsyncCommunication
    stored = cls.__dict__["backward"]
    if not isinstance(stored, staticmethod):
        raise RuntimeError(f"unexpected {cls.__name__}.backward: {stored!r}")
    _mc["prepare"] = mc_utils.prepare_input_tensors_for_wgrad_compute
    _mc["all_gather"] = layers.dist_all_gather_func
    _mc["reduce_scatter"] = layers.dist_reduce_scatter_func
    _mc["fused_wgrad"] = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    # Same autocast handling as megatron-core's own backward.
    _PATCH.deferred = layers.custom_bwd(_deferred_backward)
    _PATCH.original_fn = stored.__func__
    _PATCH.cls = cls
    return staticmethod(_backward)


_PART = "zero bubble"  # hooks/manifest.py


def install() -> None:
    """Patch megatron-core's local linear backward (idempotent; the hooks manifest's ``zero bubble`` part)."""
    from .. import hooks

    hooks.install([_PART])


def uninstall() -> None:
    """Restore megatron-core's backward (idempotent). Refused inside a ``deferring()`` block."""
    if _PATCH.cls is None:
        return
    if _ACTIVE.sink is not None:
        raise RuntimeError(f"cannot uninstall inside deferring({_ACTIVE.key!r})")
    from .. import hooks

    hooks.uninstall([_PART])
    _PATCH.cls = _PATCH.original_fn = _PATCH.deferred = None
    _mc.clear()


def is_installed() -> bool:
    return _PATCH.cls is not None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the block; uninstalls on exit only if it was not installed before."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def find_undeferred_weights(model: torch.nn.Module) -> List[str]:
    """Names of the legacy ``GroupedMLP`` and Transformer Engine modules, whose weight GEMMs the local patch
    does not defer (norms, embeddings and routers stay in B by design and are not named)."""
    from megatron.core.transformer.moe import experts

    grouped_mlp = getattr(experts, "GroupedMLP", None)  # removed in megatron-core 0.19
    found = []
    for name, module in model.named_modules():
        if grouped_mlp is not None and isinstance(module, grouped_mlp):
            found.append(f"{name} (GroupedMLP: grouped GEMM)")
        elif type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions")):
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                found.append(f"{name} ({type(module).__name__}: Transformer Engine)")
    return found


def check_ddp_compatible(model: torch.nn.Module) -> None:
    """Raise if ``model`` is megatron DDP with ``overlap_grad_reduce`` (see module docstring)."""
    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is not None and getattr(ddp_config, "overlap_grad_reduce", False):
        raise ValueError("deferred local weight gradients need DistributedDataParallelConfig("
                         "overlap_grad_reduce=False): DDP's grad-ready hook would fire in B, before W "
                         "computed the gradient")


def offers_te_backward_dw(model_chunk: torch.nn.Module) -> bool:
    """True if the unwrapped ``model_chunk`` was built with ``config.delay_wgrad_compute`` (TE modules defer)."""
    return bool(getattr(getattr(model_chunk, "config", None), "delay_wgrad_compute", False))


class TEQueues:
    """Every Transformer Engine module of a chunk that queues its weight gradients, found by the queue itself.

    TE's backward pushes one context per module and backward, ``backward_dw()`` pops the oldest. A walk of
    ``decoder.layers`` missed MTP layers, overlapped shared experts and latent-MoE projections (issue 35,
    finding 1), so a W pops exactly what its B pushed (:meth:`pushed_since`)."""

    def __init__(self, chunk: torch.nn.Module):
        # (name, module, its first-in first-out queue of deferred contexts: ``module.wgrad_store.context``)
        self.modules = [(name, m, q) for name, m in chunk.named_modules()
                        for q in [getattr(getattr(m, "wgrad_store", None), "context", None)]
                        if q is not None and callable(getattr(m, "backward_dw", None))]

    def sizes(self) -> List[int]:
        return [q.qsize() for _, _, q in self.modules]

    def pushed_since(self, before: List[int]) -> List[Tuple[int, int]]:
        """(module index, contexts pushed) since ``before`` (a :meth:`sizes`), for the modules that grew."""
        return [(i, n - b) for i, (n, b) in enumerate(zip(self.sizes(), before)) if n > b]

    def pop(self, pushed: List[Tuple[int, int]]) -> None:
        """``backward_dw()`` as many times per module as it was pushed to (its oldest contexts)."""
        for i, count in pushed:
            module = self.modules[i][1]
            for _ in range(count):
                module.backward_dw()

    def check_empty(self) -> None:
        left = [f"{name or type(m).__name__} ({q.qsize()})" for name, m, q in self.modules if q.qsize()]
        if left:
            raise RuntimeError("Transformer Engine weight gradients left queued at the end of the iteration "
                               f"(a W step missed them; their gradients are missing): {', '.join(left)}")


class DeferralAudit:
    """Which weight tensors a B step computed the gradient of itself instead of leaving it to W.

    Any layer the splitter does not reach (a plain ``torch.nn.Linear``, TE without ``delay_wgrad_compute``)
    leaves zero bubble partly inactive without an error, so the executor watches the first B of each chunk
    once and logs :meth:`report`. A weight tensor: a trainable parameter of 2+ dimensions, except embeddings
    and routers, which stay in B by design."""

    def __init__(self) -> None:
        self._seen: Dict[Hashable, Tuple[str, Dict[str, int], Set[str]]] = {}

    def wants(self, chunk: Hashable) -> bool:
        """True until a B of ``chunk`` has been watched."""
        return chunk not in self._seen

    @contextlib.contextmanager
    def watching(self, chunk: Hashable, label: str, module: torch.nn.Module) -> Iterator[None]:
        """Around one B of ``chunk`` (``module`` unwrapped): record which weight tensors get a gradient in it.
        A TE module that queued its weight gradient deferred it, whatever reached autograd (megatron's dummy)."""
        weights = _weight_tensors(module)
        in_b: Set[str] = set()
        queues = TEQueues(module)
        before = queues.sizes()

        # A hook returning None leaves the gradient as it is.
        handles = [p.register_hook(lambda grad, n=n: None if grad is None else in_b.add(n)) for n, p in weights.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        # ... and the linears megatron-core defers itself: the output layer with --defer-embedding-wgrad-compute
        # computes its weight gradient at its buffers' drain, not in B
        deferred = [queues.modules[i][:2] for i, _ in queues.pushed_since(before)] + [
            (name, m) for name, m in module.named_modules()
            if getattr(m, "embedding_activation_buffer", None) is not None
            and getattr(getattr(m, "config", None), "defer_embedding_wgrad_compute", False)]
        for name, m in deferred:
            in_b.difference_update(f"{name}.{p}" if name else p for p, _ in m.named_parameters())
        self._seen[chunk] = (label, {n: p.numel() for n, p in weights.items()}, in_b)

    def report(self, limit: int = 8) -> Optional[str]:
        """None if every watched weight tensor was deferred; else one line saying how much W holds."""
        watched = [(f"{label}: {name}", n, name in in_b) for label, sizes, in_b in self._seen.values()
                   for name, n in sizes.items()]
        missing = [(name, n) for name, n, in_b in watched if in_b]
        if not missing:
            return None
        total, held = len(watched), len(watched) - len(missing)
        total_el, held_el = sum(n for _, n, _ in watched), sum(n for _, n, in_b in watched if not in_b)
        shown = ", ".join(f"{name} ({n} elements)" for name, n in missing[:limit])
        more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
        return (f"zero bubble partly inactive: W holds the weight gradients of {held} of {total} weight "
                f"tensors ({100.0 * held_el / max(total_el, 1):.0f}% of weight elements); not deferred "
                f"(computed in B): {shown}{more}. Only megatron-core's local ColumnParallelLinear/"
                f"RowParallelLinear and Transformer Engine layers built with delay_wgrad_compute defer "
                f"their weight gradients")


#: Module kinds whose weights stay in B by design (matched in the class name).
_KEPT_IN_B = ("Embedding", "Router")


def _weight_tensors(module: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    out: Dict[str, torch.nn.Parameter] = {}
    seen: Set[int] = set()
    for mod_name, mod in module.named_modules():
        if any(kind in type(mod).__name__ for kind in _KEPT_IN_B):
            continue
        for p_name, p in mod.named_parameters(recurse=False):
            if p.requires_grad and p.dim() >= 2 and id(p) not in seen:
                seen.add(id(p))
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = p
    return out
