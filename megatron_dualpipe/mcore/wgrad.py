"""Zero-bubble weight-gradient splitting (B/W) for megatron-core's local linear layers.

A DualPipe "B" step computes only input gradients; its weight gradients are recorded and computed
later by a "W" step. Usage, once per process::

    wgrad.install()                      # patch megatron-core once (reversible: uninstall())
    store = wgrad.WeightGradStore()      # one per executor; passed around, never global

    with store.deferring((chunk, mb)):   # B step: input grads now, weight grads recorded
        backward_step(...)
    ...
    store.run((chunk, mb))               # W step, for any recorded key, in any order
    ...
    store.assert_empty()                 # end of the iteration: nothing may be left over

What is deferred
    Every backward through ``LinearWithGradAccumulationAndAsyncCommunication`` (megatron-core's
    ``tensor_parallel/layers.py``), i.e. the weight gradient of every ``ColumnParallelLinear`` and
    ``RowParallelLinear``: with ``get_gpt_layer_local_spec`` that is ``linear_qkv``,
    ``linear_proj``, ``linear_fc1``, ``linear_fc2``, the output layer, and, for MoE with
    ``moe_grouped_gemm=False``, the ``SequentialMLP`` experts (they are ``MLP`` modules made of the
    same two classes) and the shared experts. Not deferred (computed in B as usual, cheap or out of
    reach): biases (see below), norms, embeddings, the router, frozen weights
    (``linear_with_frozen_weight``), the legacy ``GroupedMLP`` (``moe_grouped_gemm=True`` with the
    local spec: its ``gg.ops.gmm`` has no split backward), and Transformer Engine modules (they
    have their own ``delay_wgrad_compute``: a chunk built with it defers through its modules'
    queues, :class:`TEQueues`, whose pops ``mcore.stage_compute`` records under the B's key).
    ``find_undeferred_weights`` lists the linear-like modules of a model whose weight gradients
    the local patch will *not* defer; ``DeferralAudit`` finds, whatever the layer kind, the weight
    tensors that actually got their gradient in B (the executor logs it once).

Bias gradients stay in B: a column sum of the output gradient is cheap, and keeping it in B leaves
the bias parameter's autograd path (and DDP hook) exactly as without deferral.

How it hooks into megatron-core
    ``install()`` replaces the static ``backward`` of
    ``LinearWithGradAccumulationAndAsyncCommunication`` once. PyTorch looks that method up on the
    class when a node runs, so graphs built before ``install()`` are covered too. The replacement
    reads one module-level slot: the store (and key) of the ``deferring()`` block in force.
    Without one (or for the output layer's own ``defer_embedding_wgrad_compute`` buffer) it calls
    megatron-core's original backward unchanged, so outside ``deferring()`` nothing differs.
    The slot is the one process-wide piece of state, and deliberately not thread-local: on a GPU
    the autograd engine runs backward nodes on its per-device worker threads, which do not see the
    caller's thread-locals. Hence only one ``deferring()`` block may be open at a time per process
    (checked).

    In B, the replacement does what megatron-core's backward does except the weight-gradient GEMM:
    input gradient, the async TP all-reduce (``allreduce_dgrad``) or the sequence-parallel
    reduce-scatter, the bias gradient; it returns ``None`` as the weight's gradient and records a
    closure holding the (2-D, contiguous) output gradient and the input.

    In W (``store.run(key)``), each closure computes the weight gradient and hands it on exactly
    as the original backward would have:

    - without ``gradient_accumulation_fusion``: it feeds ``grad_output.T @ input`` to the weight's
      own gradient accumulator via ``torch.autograd.backward(weight, grad)``. So ``param.grad`` is
      set or accumulated by PyTorch's ``AccumulateGrad``, and every hook on that accumulator runs,
      including megatron DDP's backward post-hook, which adds ``param.grad`` into
      ``param.main_grad`` and clears ``param.grad``. ``main_grad`` ends up the same as without
      deferral.
    - with ``gradient_accumulation_fusion``: it accumulates into ``weight.main_grad`` (APEX's
      ``wgrad_gemm_accum_fp32/fp16`` when importable, else ``main_grad += grad_output.T @ input``),
      then, if the weight has ``grad_added_to_main_grad`` (i.e. it is DDP-managed), sets it and
      feeds the same dummy gradient megatron-core feeds, so the DDP hook runs and skips the add.

    In B the weight's accumulator still runs (with no gradient), so DDP's hook fires once in B as
    a no-op (``param.grad`` is None) and once in W. With ``overlap_grad_reduce=True`` its
    ``param.grad is not None`` assertion fails in B: the bucket's grad-ready accounting would
    need moving to W (as the TE path does). Use ``overlap_grad_reduce=False`` with deferral, or
    call ``check_ddp_compatible(model)`` up front.

Tensor parallelism
    tp > 1 without sequence parallelism needs nothing extra (the closure keeps the local input).
    With sequence parallelism B all-gathers the input into a buffer of its own (not megatron's
    shared global buffer, which the next layer reuses) and the closure keeps it until W: W needs
    no collective, at the cost of tp x the layer's input shard in memory per pending W. Only the
    tp=1, no-sequence-parallel, no-fusion path is exercised on this machine.

Caveats
    - A closure keeps ``grad_output`` and the input alive until W; nothing may modify them in place
      in between (megatron-core does not). PyTorch's gradient buffers do not: they only accumulate
      in place into a tensor whose storage nobody else references.
    - W runs on the caller's current stream, outside the autocast state of B (megatron-core trains
      without autocast). If W runs on another CUDA stream than B, the caller must order them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Set, Tuple

import torch

__all__ = [
    "WeightGradStore",
    "install",
    "uninstall",
    "is_installed",
    "installed",
    "find_undeferred_weights",
    "check_ddp_compatible",
    "offers_te_backward_dw",
    "TEQueues",
    "DeferralAudit",
]


class _Active:
    """The one hook point between ``WeightGradStore.deferring`` and the patched backward."""

    __slots__ = ("sink", "key", "store")

    def __init__(self) -> None:
        self.sink: Optional[List[Callable[[], None]]] = None
        self.key: Hashable = None
        self.store: Optional["WeightGradStore"] = None


_ACTIVE = _Active()


class _Patch:
    """What ``install()`` replaced, so that ``uninstall()`` can put it back."""

    __slots__ = ("cls", "original", "original_fn", "deferred")

    def __init__(self) -> None:
        self.cls: Any = None
        self.original: Any = None  # the original staticmethod object
        self.original_fn: Any = None  # its function
        self.deferred: Any = None  # megatron's custom_bwd(_deferred_backward)


_PATCH = _Patch()

# Bound at install() from megatron-core, so the hot path does no imports or attribute lookups
# through megatron modules.
_mc: Dict[str, Any] = {}


class WeightGradStore:
    """Deferred weight-gradient work, keyed (e.g. by ``(chunk, mb)``), not a FIFO.

    An instance is passed to whoever runs B and W steps; there is no class-level state.
    """

    def __init__(self) -> None:
        self._pending: Dict[Hashable, List[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """While active, backward passes through megatron-core's local linears record their
        weight-gradient work under ``key`` instead of doing it.

        Entering registers ``key`` even if no linear is traversed, so ``run(key)`` is always valid
        after a B step. Entering again with a pending key appends to it. Blocks do not nest and at
        most one is open per process (the patched backward reads a process-wide slot).
        """
        if _PATCH.cls is None:
            raise RuntimeError(
                "megatron_dualpipe.mcore.wgrad is not installed: call wgrad.install() once before "
                "WeightGradStore.deferring()"
            )
        if _ACTIVE.sink is not None:
            raise RuntimeError(
                f"cannot defer weight gradients under key {key!r}: a deferring() block for key "
                f"{_ACTIVE.key!r} is already open (blocks do not nest; one per process)"
            )
        sink = self._pending.setdefault(key, [])
        _ACTIVE.sink, _ACTIVE.key, _ACTIVE.store = sink, key, self
        try:
            yield
        finally:
            _ACTIVE.sink, _ACTIVE.key, _ACTIVE.store = None, None, None

    def record(self, key: Hashable, fn: Callable[[], None]) -> None:
        """Add a weight-gradient closure under ``key`` (e.g. a TE ``backward_dw`` call)."""
        self._pending.setdefault(key, []).append(fn)

    def run(self, key: Hashable) -> int:
        """Run (and forget) every closure recorded under ``key``, in recording order.

        Returns how many ran. Raises ``KeyError`` naming the pending keys if ``key`` has nothing
        recorded (never deferred, or already run).
        """
        fns = self._pending.pop(key, None)
        if fns is None:
            raise KeyError(
                f"no deferred weight gradients under key {key!r} (never deferred, or already "
                f"run); pending keys: {self.pending()!r}"
            )
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
            raise RuntimeError(
                f"WeightGradStore has {len(self._pending)} key(s) whose weight gradients were "
                f"never computed (W step missing): {leftovers}"
            )

    def clear(self) -> None:
        """Drop all pending work (e.g. after a failed iteration), freeing the kept tensors."""
        self._pending.clear()

    def __len__(self) -> int:
        return len(self._pending)

    def __repr__(self) -> str:
        return f"WeightGradStore(pending={self.pending()!r})"


# ----------------------------------------------------------------------------------------------
# The patched backward


def _backward(ctx, grad_output):
    """Replacement for ``LinearWithGradAccumulationAndAsyncCommunication.backward``."""
    sink = _ACTIVE.sink
    # megatron-core 0.19's GTP (gtp_remat_size > 1) re-gathers and reduce-scatters the weight
    # around the GEMMs: left to the original backward, like the grad_output_buffer path.
    if sink is None or ctx.grad_output_buffer is not None or getattr(ctx, "gtp_remat_size", 1) > 1:
        return _PATCH.original_fn(ctx, grad_output)
    return _PATCH.deferred(ctx, grad_output, sink)


def _deferred_backward(ctx, grad_output, sink):
    """megatron-core's backward minus the weight-gradient GEMM, which goes to ``sink``.

    Mirrors ``tensor_parallel/layers.py`` 0.16.1 lines 495-626 (wgrad_compute=True path; the
    same at 0.19 apart from GTP, which :func:`_backward` leaves to the original). One gradient is
    returned per forward input: 9 at 0.16.1, 10 at 0.19 (``gtp_remat_size`` was added).
    """
    untouched = (None,) * (len(ctx.needs_input_grad) - 3)  # the non-tensor forward arguments
    input, weight = ctx.saved_tensors
    main_grad = ctx.main_grad
    tp_group = ctx.tp_group
    if ctx.gradient_accumulation_fusion:
        if main_grad is None:
            raise RuntimeError(
                "gradient_accumulation_fusion is on but the weight had no main_grad at forward"
            )
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
        sub_grad_input = torch.empty(
            list(input.size()), dtype=input.dtype, device=grad_input.device, requires_grad=False
        )
        handle = _mc["reduce_scatter"](sub_grad_input, grad_input, group=tp_group, async_op=True)

    grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    sink.append(
        _WeightGrad(weight, grad_output, total_input, main_grad, ctx.gradient_accumulation_fusion)
    )

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
        self.weight = weight
        self.grad_output = grad_output
        self.total_input = total_input
        self.main_grad = main_grad
        self.fusion = fusion

    def __call__(self) -> None:
        with torch.no_grad():  # as inside the autograd engine, where the undeferred backward runs
            self._compute()

    def _compute(self) -> None:
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
            shape = weight.main_grad.shape
            device = weight.main_grad.device
            if getattr(weight, "zero_out_wgrad", False):
                dummy = torch.zeros(shape, dtype=total_input.dtype, device=device)
            else:
                dummy = torch.empty(shape, dtype=total_input.dtype, device=device)
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


# ----------------------------------------------------------------------------------------------
# install / uninstall


def deferrable_backward(original):
    """The hooks manifest's replacement of ``LinearWithGradAccumulationAndAsyncCommunication.backward``
    (``original``: the class's function): :func:`_backward`, which defers inside ``deferring()``
    and runs the original otherwise. Binds what the hot path needs from megatron-core."""
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
    _PATCH.original = stored
    _PATCH.original_fn = stored.__func__
    _PATCH.cls = cls
    return staticmethod(_backward)


_PART = "zero bubble"  # hooks/manifest.py


def install() -> None:
    """Patch megatron-core's local linear backward (idempotent; the ``zero bubble`` part of the
    hooks manifest). Cheap; call once per process."""
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
    _PATCH.cls = _PATCH.original = _PATCH.original_fn = _PATCH.deferred = None
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


# ----------------------------------------------------------------------------------------------
# Checks


def find_undeferred_weights(model: torch.nn.Module) -> List[str]:
    """Names of trainable modules whose weight GEMMs the store will *not* defer.

    Reports the legacy ``GroupedMLP`` (grouped GEMM) and Transformer Engine modules (use
    :class:`TEQueues`). Norms, embeddings and routers are not reported: they stay in B by
    design. Call once when building the executor, not per step.
    """
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
        raise ValueError(
            "deferred local weight gradients need DistributedDataParallelConfig("
            "overlap_grad_reduce=False): DDP's grad-ready hook would fire in B, before W "
            "computed the gradient"
        )


# ----------------------------------------------------------------------------------------------
# Transformer Engine path (on the CPU through the CPU mode's stand-in)


def offers_te_backward_dw(model_chunk: torch.nn.Module) -> bool:
    """True if ``model_chunk`` was built with ``config.delay_wgrad_compute`` (TE modules defer).
    Pass the unwrapped model (GPTModel)."""
    config = getattr(model_chunk, "config", None)
    return bool(getattr(config, "delay_wgrad_compute", False))


def _te_queue(module):
    """The first-in first-out queue of deferred weight-gradient contexts a Transformer Engine module
    built with ``delay_wgrad_compute`` keeps (``module.wgrad_store.context``), or None."""
    store = getattr(module, "wgrad_store", None)
    queue = getattr(store, "context", None)
    return queue if queue is not None and callable(getattr(module, "backward_dw", None)) else None


class TEQueues:
    """Every Transformer Engine module of a chunk that queues its weight gradients, whatever holds it.

    TE's backward pushes one context per module and per backward onto that module's queue, and
    ``backward_dw()`` pops the oldest. megatron-core calls ``backward_dw()`` through its layers
    (attention, MLP, MoE, MLA), and a walk of ``decoder.layers`` missed what megatron-core's own
    walk skips or does not hold there: MTP layers, overlapped shared experts, latent-MoE
    projections (issue 35, finding 1): their gradients were missing and their queues grew every
    iteration. Here the modules are found once per chunk by the queue itself; a backward's W pops
    exactly what that backward pushed (:meth:`pushed_since`), and :meth:`check_empty` at the end
    of each iteration names any module left with contexts."""

    def __init__(self, chunk: torch.nn.Module):
        self.modules = [(name, m, q) for name, m in chunk.named_modules() for q in [_te_queue(m)] if q is not None]

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


# ----------------------------------------------------------------------------------------------
# What W actually holds, whatever the layer kind


class DeferralAudit:
    """Which weight tensors a B step computed the gradient of itself instead of leaving it to W.

    The splitter defers megatron-core's local linears and, through ``backward_dw``, Transformer
    Engine layers built with ``delay_wgrad_compute``; any other layer (a plain
    ``torch.nn.Linear``, a custom GEMM, TE without ``delay_wgrad_compute``) computes its weight
    gradient in B, and zero bubble is then partly inactive without any error. The executor
    watches the first B of each model chunk once (a gradient hook per weight tensor, removed
    right after) and logs :meth:`report`.

    A *weight tensor* is a trainable parameter with two or more dimensions, except embedding
    tables and MoE routers (a cheap scatter and a tiny GEMM that stay in B by design); biases and
    norms (1-D) do not count. A weight tensor whose gradient reaches it during B is *not
    deferred*; every other weight tensor of the chunk is work that W holds.
    """

    def __init__(self) -> None:
        self._seen: Dict[Hashable, Tuple[str, Dict[str, int], Set[str]]] = {}

    def wants(self, chunk: Hashable) -> bool:
        """True until a B of ``chunk`` has been watched."""
        return chunk not in self._seen

    @contextlib.contextmanager
    def watching(self, chunk: Hashable, label: str, module: torch.nn.Module) -> Iterator[None]:
        """Around one B of ``chunk`` (``module`` unwrapped): record which weight tensors get a
        gradient in it. A Transformer Engine module that queued its weight gradient in this B
        deferred it, whatever reached autograd (with ``main_grad`` fusion, megatron's dummy)."""
        weights = _weight_tensors(module)
        in_b: Set[str] = set()
        queues = TEQueues(module)
        before = queues.sizes()

        def hook(name: str) -> Callable:
            def got(grad):
                if grad is not None:
                    in_b.add(name)
            return got

        handles = [p.register_hook(hook(n)) for n, p in weights.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        for i, _ in queues.pushed_since(before):
            name, queued, _ = queues.modules[i]
            in_b.difference_update(f"{name}.{p}" if name else p for p, _ in queued.named_parameters())
        for name, buffered in _deferring_by_megatron(module):
            in_b.difference_update(f"{name}.{p}" if name else p for p, _ in buffered.named_parameters())
        self._seen[chunk] = (label, {n: p.numel() for n, p in weights.items()}, in_b)

    def report(self, limit: int = 8) -> Optional[str]:
        """None if every watched weight tensor was deferred; else one line saying how much W holds."""
        total = held = total_el = held_el = 0
        missing: List[Tuple[str, int]] = []
        for label, sizes, in_b in self._seen.values():
            for name, n in sizes.items():
                total, total_el = total + 1, total_el + n
                if name in in_b:
                    missing.append((f"{label}: {name}", n))
                else:
                    held, held_el = held + 1, held_el + n
        if not missing:
            return None
        shown = ", ".join(f"{name} ({n} elements)" for name, n in missing[:limit])
        more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
        return (f"zero bubble partly inactive: W holds the weight gradients of {held} of {total} weight "
                f"tensors ({100.0 * held_el / max(total_el, 1):.0f}% of weight elements); not deferred "
                f"(computed in B): {shown}{more}. Only megatron-core's local ColumnParallelLinear/"
                f"RowParallelLinear and Transformer Engine layers built with delay_wgrad_compute defer "
                f"their weight gradients")


def _deferring_by_megatron(module: torch.nn.Module):
    """(name, module) of the linears megatron-core defers itself: the output layer with
    ``--defer-embedding-wgrad-compute`` keeps its inputs and output gradients in its buffers and
    computes its weight gradient at their drain (below the ``wgrad_deferral_limit``), not in B."""
    return [(name, m) for name, m in module.named_modules()
            if getattr(m, "embedding_activation_buffer", None) is not None
            and getattr(getattr(m, "config", None), "defer_embedding_wgrad_compute", False)]


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
