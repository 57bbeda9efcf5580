"""The checkpoint package (megatron_dualpipe/megatron_lm/checkpoint/): its (schedule, format) table,
the refusal of optimizer state across the DualPipeV and 1F1B layouts, and its import shape (no
private imports across its modules, no import circle among the Megatron-LM modules), and DualPipeV's
one-line refusal of another layout's dp_reshardable state, and the grad-buffer offsets the fully reshardable
save is given. No run: the save / load runs themselves are tests/megatron_lm/test_megatron_lm_cpu.py and
tests/megatron_lm/test_megatron_lm_dualpipe.py."""
import ast
import pathlib
from types import SimpleNamespace

import pytest

from megatron_dualpipe.launch import validation as launch_validation
from megatron_dualpipe.megatron_lm.checkpoint import strategies as st
from megatron_dualpipe.megatron_lm.refusal import Refusal
from megatron_dualpipe.schedule import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = ROOT / "megatron_dualpipe" / "megatron_lm"


@pytest.mark.parametrize("schedule", registry.NAMES)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist", "fsdp_dtensor"])
def test_every_schedule_and_format_has_one_strategy(schedule, fmt):
    save, load = st.save_strategy(schedule, fmt), st.load_strategy(schedule, fmt)
    print(f"\n{schedule:14s} {fmt:12s} save: {save.__name__:26s} load: {load.__name__}")
    if schedule not in (registry.DUALPIPE, registry.DUALPIPEV):
        assert (save, load) == (st.save_as_is, st.load_as_is)  # Megatron's own layout already
    if schedule == registry.DUALPIPE:
        assert load is not st.load_as_is  # the mirrors are always synced after a load


def _calls(strategy, *, file=None):
    seen = []

    def orig(*a, **kw):
        seen.append(a)
        return "result"

    args = SimpleNamespace(no_save_optim=True, no_load_optim=True, finetune=False)
    if strategy.__name__.startswith("save"):
        assert strategy(orig, args, 7, ["m0", "m1"], None, "extra") == "result"
    else:
        assert strategy(orig, args, ["m0", "m1"], None, file, "sched", "load", True) == "result"
    return seen


def test_pass_through_strategies_hand_megatron_the_same_arguments():
    assert _calls(st.save_as_is) == [(7, ["m0", "m1"], None, "extra")]
    assert _calls(st.load_as_is) == [(["m0", "m1"], None, "sched", "load", True)]
    # dualpipev reading its own two-chunk file: as it is.
    assert _calls(st.load_into_v_stages, file=({"model0", "model1", "model"}, registry.DUALPIPEV)) == \
        [(["m0", "m1"], None, "sched", "load", True)]


@pytest.mark.parametrize("schedule,saved,keys,refused", [
    (registry.DUALPIPEV, registry.ONE_F_ONE_B, {"model"}, True),
    (registry.ONE_F_ONE_B, registry.DUALPIPEV, {"model", "model0", "model1"}, True),
    (registry.DUALPIPE, registry.DUALPIPEV, {"model", "model0", "model1"}, True),
    (registry.DUALPIPEV, registry.DUALPIPEV, {"model", "model0", "model1"}, False),
    (registry.DUALPIPE, registry.ONE_F_ONE_B, {"model"}, False),
])
def test_optimizer_state_across_layouts_is_refused_naming_no_load_optim(schedule, saved, keys, refused):
    args = SimpleNamespace(no_load_optim=False, finetune=False)
    if refused:
        from megatron_dualpipe.megatron_lm.refusal import Refusal

        with pytest.raises(Refusal, match="--no-load-optim") as err:  # said once by the launcher, no traceback
            st.refuse_optimizer_across_layouts(args, object(), schedule, (keys, saved))
        print(f"\n{err.value}")
    else:
        st.refuse_optimizer_across_layouts(args, object(), schedule, (keys, saved))
    # without optimizer state the weights load (remapped where needed)
    st.refuse_optimizer_across_layouts(SimpleNamespace(no_load_optim=True, finetune=False), object(), schedule,
                                       (keys, saved))


def _imports(path):
    """(module imported relative to the megatron_lm package, names) for each import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.parent.relative_to(LM.parent).parts  # ("megatron_lm", ...) or ("megatron_lm", "checkpoint")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[:len(package) - node.level + 1])
            target = ".".join(base + ([node.module] if node.module else []))
            yield target, [a.name for a in node.names]


def test_no_private_imports_across_the_megatron_lm_modules():
    private = [f"{p.relative_to(ROOT)}: from {t} import {n}" for p in LM.rglob("*.py") for t, names in _imports(p)
               for n in names if n.startswith("_")]
    print(f"\nprivate imports: {private}")
    assert private == []


def test_no_import_circle_among_the_megatron_lm_modules():
    graph = {}
    for p in LM.rglob("*.py"):
        name = ".".join(p.relative_to(LM.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = set()
        for target, names in _imports(p):
            for n in names:  # "from . import x" imports the module x
                graph[name].add(f"{target}.{n}" if f"{target}.{n}".replace(".", "/") in _modules() else target)
    graph = {k: {t for t in v if t in graph and t != k} for k, v in graph.items()}

    def cycle_from(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, path + [nxt])
                if found:
                    return found
        return None

    cycles = [c for c in (cycle_from(m, m, [m]) for m in graph) if c]
    print(f"\n{len(graph)} modules; circles: {cycles}")
    assert cycles == []


def _modules():
    return {".".join(p.relative_to(LM.parent).with_suffix("").parts).replace(".", "/") for p in LM.rglob("*.py")}


def test_dualpipev_torch_dist_refuses_dp_reshardable_state_of_another_layout_in_one_line():
    """DCP's shape mismatch for the distributed optimizer's buffer-keyed state (what Megatron's load
    raised when dualpipev read 1f1b's dp_reshardable checkpoint: seen through pretrain_gpt.py at
    core_v0.19.0) becomes one line naming the fix; any other error passes through unchanged."""
    from torch.distributed.checkpoint.api import CheckpointException

    mismatch = ValueError("Global shape mismatch for loaded (torch.Size([104064])) and expected ((54080,)) tensor "
                          "for key optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
                          "torch.float32).bucket_idx_0.param")

    def orig(error):
        def load(*a, **kw):
            raise error
        return load

    load = st.load_strategy(registry.DUALPIPEV, "torch_dist")
    with pytest.raises(NotImplementedError) as refused:
        load(orig(CheckpointException("plan", {0: (mismatch, None)})), None, ["m0", "m1"], None, None)
    print(f"\nrefused: {refused.value}")
    assert "\n" not in str(refused.value)
    # a refusal the launcher says once, not a traceback per rank (tests/cli/test_launch_validation.py)
    assert isinstance(refused.value, Refusal) and launch_validation.is_refusal(refused.value)
    assert "--dist-ckpt-optim-fully-reshardable" in str(refused.value) and "--no-load-optim" in str(refused.value)
    other = CheckpointException("plan", {0: (ValueError("Global shape mismatch for key decoder.layers.0.x"), None)})
    with pytest.raises(CheckpointException):
        load(orig(other), None, ["m0", "m1"], None, None)
    with pytest.raises(KeyboardInterrupt):
        load(orig(KeyboardInterrupt()), None, ["m0", "m1"], None, None)


def test_offsets_without_the_padding_between_buckets():
    """megatron-core pads a bucket's end to a multiple of 128 under the distributed optimizer and gives the
    tied embedding a bucket of its own after the rest of the first stage; the state it gathers for the fully
    reshardable save leaves that padding out. Bucket 0 here holds 192 elements, padded to 256: bucket 1 (the
    embedding) starts at 256 in the buffer and at 192 in the gathered state (the save under dualpipe and
    dualpipev, Megatron-LM's and Bridge's: ``optimizers.exact_offsets``)."""
    from megatron_dualpipe.megatron_lm.checkpoint.optimizers import _unpadded_offsets

    norm, weight, embedding = object(), object(), object()
    buckets = [SimpleNamespace(grad_data=SimpleNamespace(numel=lambda: 256), numel_unpadded=192),
               SimpleNamespace(grad_data=SimpleNamespace(numel=lambda: 16384), numel_unpadded=16384)]
    index = {norm: (0, 64, 0), weight: (64, 192, 0), embedding: (256, 256 + 16384, 1)}
    buffer = SimpleNamespace(buckets=buckets, param_index_map=index)
    assert _unpadded_offsets(buffer) == {norm: (0, 64, 0), weight: (64, 192, 0),
                                         embedding: (192, 192 + 16384, 1)}
