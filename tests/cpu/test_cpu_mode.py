"""megatron-core runs on CPU/gloo with `megatron_dualpipe.cpu.enable()`, and `disable()` undoes it.

Each test spawns fresh processes (gloo on 127.0.0.1) so that megatron-core's global state never
leaks between tests. The pipeline test runs megatron-core's *own* 1F1B schedule and compares it
with a plain single-process loop over the full model, which makes it an independent reference
for our executor's tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dualpipe import cpu as cpu_mode
from megatron_dualpipe.proof import models, names, reference, tiny_gpt
from megatron_dualpipe.proof.compare import Gap
from megatron_dualpipe.proof.data import forward_step, masked_loss_func as loss_func
from megatron_dualpipe.proof.models import ModelSpec
from harness import megatron_env as me

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode tests; on a GPU machine CPU mode is never active"
)

#: The shape of the data (the proof harness's tiny GPT: vocabulary 64, 16 tokens, 2 samples).
DATA = ModelSpec(layers=2)
SEQ, MBS, VOCAB, M = DATA.seq, DATA.mbs, DATA.vocab, 4
RTOL = 1e-5


def reference_run(model, batches):
    """Plain loop: per micro-batch loss / M, backward. Returns the per-micro-batch losses."""
    losses = []
    for b in batches:
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss, _ = loss_func(b["loss_mask"], out)
        (loss / len(batches)).backward()
        losses.append(loss.detach().clone())
    return losses


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(name, got, want, rtol=RTOL):
    """The proof harness's equality check, printed: max|diff| over max|want| within ``rtol``."""
    gap = Gap()
    gap.add(got, want)
    print(f"  {gap.line(name)}")
    assert gap.rel <= rtol, gap.line(name)


# ----------------------------------------------------------------------------------------------
# Workers (module level so that spawn can import them)


def _dense_single_worker(rank, world_size, port):
    me.init_distributed_cpu(rank, world_size, port)
    try:
        assert cpu_mode.active()
        config = tiny_gpt.tiny_gpt_config(num_layers=2)
        batches = DATA.batches(2)
        runs = []
        for _ in range(2):
            tiny_gpt.seed_all(1234)
            model = tiny_gpt.build_tiny_gpt(config, share_embeddings_and_output_weights=True)
            losses = reference_run(model, batches)
            runs.append((losses, grads(model), [n for n, _ in model.named_parameters()]))
        # Manual recomputation of the loss from the logits.
        b = batches[0]
        with torch.no_grad():
            logits = model(b["tokens"], b["position_ids"], None)  # [b, s, v]
            per_token = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, VOCAB), b["labels"].reshape(-1), reduction="none"
            )
            manual = (per_token * b["loss_mask"].reshape(-1)).sum() / b["loss_mask"].sum()
        return runs, manual
    finally:
        me.destroy_distributed()


def _architecture(users: bool):
    """(config fields, GPTModel arguments): GPT-2's defaults, or the architecture users train
    (RoPE, SwiGLU, RMSNorm: ``proof.models.users_architecture``)."""
    if not users:
        return {}, {}
    arch = models.users_architecture(models.ModelSpec(layers=1))
    return dict(arch.config), dict(arch.model)


def _full_model_worker(rank, world_size, port, num_layers, tied, moe_kwargs, users=False):
    """pp=1 reference: initial state dict, per-micro-batch losses, gradients."""
    me.init_distributed_cpu(rank, world_size, port)
    try:
        fields, arguments = _architecture(users)
        config = tiny_gpt.tiny_gpt_config(num_layers=num_layers, **moe_kwargs, **fields)
        model = tiny_gpt.build_tiny_gpt(config, share_embeddings_and_output_weights=tied, **arguments)
        state = reference.weights(model)
        losses = reference_run(model, DATA.batches(M))
        return state, losses, grads(model)
    finally:
        me.destroy_distributed()


def _pipeline_worker(rank, world_size, port, num_layers, tied, full_state, users=False):
    """Megatron-core's 1F1B (`get_forward_backward_func()`) over pp=world_size stages."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    me.init_distributed_cpu(rank, world_size, port, pp=world_size)
    try:
        fields, arguments = _architecture(users)
        config = tiny_gpt.tiny_gpt_config(num_layers=num_layers, **fields)
        model = tiny_gpt.build_tiny_gpt(config, share_embeddings_and_output_weights=tied, **arguments)
        if users:  # the rotary embedding of the CPU mode runs, not learned positions
            assert model.position_embedding_type == "rope" and model.rotary_pos_emb is not None
        # With tied embeddings the last stage's output weight was zero-filled and then
        # all-reduced from the first stage at construction (the `Tensor.cuda` redirection).
        tied_copy = None
        if tied and (model.pre_process or model.post_process):
            tied_copy = model.shared_embedding_or_output_weight().detach().clone()
        full_state = {k: torch.from_numpy(v) for k, v in full_state.items()}
        names.load_stage_from_full(model, full_state)
        func = get_forward_backward_func()
        assert func.__name__ == "forward_backward_pipelining_without_interleaving"
        out = func(
            forward_step_func=forward_step,
            data_iterator=iter(DATA.batches(M)),
            model=[model],
            num_microbatches=M,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        losses = [d["lm loss"] for d in out] if parallel_state.is_pipeline_last_stage() else None
        return losses, names.stage_grads_as_full(model, full_state), tied_copy
    finally:
        me.destroy_distributed()


def _moe_ep_worker(rank, world_size, port, dispatcher, full_state):
    """MoE with expert parallelism ep=world_size (dp=world_size): rank r runs micro-batch r."""
    me.init_distributed_cpu(rank, world_size, port, ep=world_size)
    try:
        config = tiny_gpt.tiny_gpt_config(
            num_layers=2, num_moe_experts=4, moe_token_dispatcher_type=dispatcher
        )
        model = tiny_gpt.build_tiny_gpt(config)
        own = model.state_dict()
        per_rank = config.num_moe_experts // world_size
        full_state = {k: torch.from_numpy(v) for k, v in full_state.items()}
        with torch.no_grad():
            for key, tensor in own.items():
                if "_extra_state" not in key:
                    tensor.copy_(full_state[_global_expert_key(key, rank * per_rank)])
        b = DATA.batches(world_size, seed=11)[rank]
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss, _ = loss_func(b["loss_mask"], out)
        loss.backward()
        return loss.detach(), {
            _global_expert_key(n, rank * per_rank): g for n, g in grads(model).items()
        }
    finally:
        me.destroy_distributed()


def _moe_reference_worker(rank, world_size, port, dispatcher, n_data):
    """ep=1 reference for `_moe_ep_worker`: per-micro-batch losses and gradients."""
    me.init_distributed_cpu(rank, world_size, port)
    try:
        config = tiny_gpt.tiny_gpt_config(
            num_layers=2, num_moe_experts=4, moe_token_dispatcher_type=dispatcher
        )
        model = tiny_gpt.build_tiny_gpt(config)
        losses, per_mb = reference.per_microbatch(model, DATA.batches(n_data, seed=11))
        return reference.weights(model), list(zip(losses, per_mb))
    finally:
        me.destroy_distributed()


def _ddp_worker(rank, world_size, port, overlap_grad_reduce):
    """Megatron DDP (dp=world_size) + finalize_model_grads vs a plain model on all the data."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    me.init_distributed_cpu(rank, world_size, port)
    try:
        config = tiny_gpt.tiny_gpt_config(num_layers=2)
        batches = DATA.batches(world_size, seed=5)
        tiny_gpt.seed_all(1234)
        plain = tiny_gpt.build_tiny_gpt(config, share_embeddings_and_output_weights=True)
        for b in batches:  # reference: the average over all ranks' micro-batches
            out = plain(b["tokens"], b["position_ids"], None, labels=b["labels"])
            (loss_func(b["loss_mask"], out)[0] / world_size).backward()
        tiny_gpt.seed_all(1234)
        model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=overlap_grad_reduce),
            module=tiny_gpt.build_tiny_gpt(config, share_embeddings_and_output_weights=True),
        )
        model.zero_grad_buffer()
        b = batches[rank]
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss_func(b["loss_mask"], out)[0].backward()
        finalize_model_grads([model])
        got = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
        return got, grads(plain)
    finally:
        me.destroy_distributed()


def _global_expert_key(key, expert_offset):
    marker = ".local_experts."
    if marker not in key:
        return key
    head, tail = key.split(marker, 1)
    index, rest = tail.split(".", 1)
    return f"{head}{marker}{int(index) + expert_offset}.{rest}"


# ----------------------------------------------------------------------------------------------
# Tests


def test_dense_gpt_forward_backward_single_process():
    (runs, manual), = me.run_workers(_dense_single_worker, world_size=1)
    (losses_a, grads_a, names), (losses_b, grads_b, _) = runs
    assert all(np.isfinite(l) for l in losses_a)
    np.testing.assert_array_equal(np.array(losses_a), np.array(losses_b))  # deterministic
    assert set(grads_a) == set(names), "every parameter gets a gradient"
    for name, g in grads_a.items():
        assert np.all(np.isfinite(g)), name
        assert np.any(g != 0), f"zero gradient for {name}"
        np.testing.assert_array_equal(g, grads_b[name])
    assert_close("loss vs cross-entropy of the logits", losses_a[0], manual)


@pytest.mark.parametrize(
    "pp,num_layers,tied,users", [(2, 4, False, False), (2, 4, True, False), (4, 4, False, False), (2, 4, False, True)],
    ids=["pp2", "pp2-tied", "pp4", "pp2-rope-swiglu-rmsnorm"]
)
def test_megatron_1f1b_matches_single_process(pp, num_layers, tied, users):
    """Megatron's own 1F1B in the CPU mode equals one process running the whole model; the last
    case with the architecture users train (RoPE: megatron-core's rotary embedding asks for
    ``torch.cuda.current_device()``, which the CPU mode answers)."""
    ((state, ref_losses, ref_grads),) = me.run_workers(
        _full_model_worker, world_size=1, args=(num_layers, tied, {}, users)
    )
    results = me.run_workers(_pipeline_worker, world_size=pp, args=(num_layers, tied, state, users))
    print(f"\npp={pp} tied={tied}{' RoPE + SwiGLU + RMSNorm' if users else ''}: megatron 1F1B vs single-process loop")
    last_losses = results[-1][0]
    assert all(r[0] is None for r in results[:-1])
    assert_close("per-micro-batch loss", np.array(last_losses), np.array(ref_losses))
    pipe_grads = {}
    for _, stage_grads, _ in results:
        for key, g in stage_grads.items():
            pipe_grads[key] = pipe_grads[key] + g if key in pipe_grads else g
    assert set(pipe_grads) == set(ref_grads)
    for key in sorted(ref_grads):
        assert_close(key, pipe_grads[key], ref_grads[key])
    if tied:
        np.testing.assert_array_equal(results[0][2], results[-1][2])


def test_moe_allgather_single_process():
    ((state, results),) = me.run_workers(
        _moe_reference_worker, world_size=1, args=("allgather", 2)
    )
    for loss, g in results:
        assert np.isfinite(loss)
        experts = [k for k in g if ".local_experts." in k]
        assert len(experts) > 0 and all(np.all(np.isfinite(v)) for v in g.values())
        assert any(np.any(g[k] != 0) for k in experts)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_expert_parallel_matches_single_process(dispatcher):
    ep = 2
    ((state, ref),) = me.run_workers(_moe_reference_worker, world_size=1, args=(dispatcher, ep))
    results = me.run_workers(_moe_ep_worker, world_size=ep, args=(dispatcher, state))
    print(f"\nMoE {dispatcher} ep={ep} vs single process")
    for rank, (loss, rank_grads) in enumerate(results):
        assert_close(f"rank {rank} loss", loss, ref[rank][0])
        for key, g in sorted(rank_grads.items()):
            if ".local_experts." in key:
                # an expert receives tokens from every rank: its gradient sums both losses
                want = sum(r[1][key] for r in ref)
            else:
                want = ref[rank][1][key]
            assert_close(f"rank {rank} {key}", g, want)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_megatron_ddp_finalize_grads_matches_single_process(overlap):
    results = me.run_workers(_ddp_worker, world_size=2, args=(overlap,))
    print(f"\nmegatron DDP dp=2 overlap_grad_reduce={overlap} vs plain model on all data")
    for rank, (got, want) in enumerate(results):
        assert set(got) == set(want)
        for key in sorted(want):
            assert_close(f"rank {rank} {key}", got[key], want[key])


# ----------------------------------------------------------------------------------------------
# enable / disable: exactly the listed attributes change, and every one gets its object back


def _megatron_attributes():
    """{"module.name": object} for every megatron module's globals and the attributes of the
    classes it defines ("module.Class.name")."""
    import sys

    snap = {}
    for modname, module in list(sys.modules.items()):
        if module is None or not (modname == "megatron" or modname.startswith("megatron.")):
            continue
        for key, value in list(vars(module).items()):
            snap[f"{modname}.{key}"] = value
            if isinstance(value, type) and value.__module__ == modname and value.__qualname__ == key:
                for attr, obj in list(vars(value).items()):
                    snap[f"{modname}.{key}.{attr}"] = obj
    return snap


def _differ(a, b, replaced=()):
    """Keys whose objects differ, leaving out the attributes *of* a replaced object."""
    missing = object()
    inside = tuple(t + "." for t in replaced)
    return sorted(k for k in set(a) | set(b) if a.get(k, missing) is not b.get(k, missing)
                  and not k.startswith(inside))


def enable_disable_report(megatron_lm):
    """Enable twice, disable once; what changed in every megatron module at each step."""
    import importlib

    parts = [p for p in cpu_mode.PARTS if megatron_lm or p == "megatron-core"]
    from megatron_dualpipe.hooks.mechanism import megatron_core_version

    version = megatron_core_version()
    # Entries for other megatron-core versions are listed but not applied (their modules may not exist).
    listed = [r for p in parts for r in cpu_mode.redirections(p) if version in r.versions]
    for r in listed:
        importlib.import_module(r.module)
    assert not cpu_mode.active()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker()  # a tracker built before CPU mode (of the CUDA class)
    torch_methods = (torch.Tensor.cuda, torch.nn.Module.cuda)
    before = _megatron_attributes()
    assert cpu_mode.enable(megatron_lm=megatron_lm) is True
    during = _megatron_attributes()
    assert cpu_mode.enable(megatron_lm=megatron_lm) is True  # idempotent: nothing changes again
    again = _megatron_attributes()
    states = {r.target: state for _, r, state in cpu_mode.status()}
    cpu_mode.disable()
    after = _megatron_attributes()
    return dict(
        listed=sorted(r.target for r in listed), changed=_differ(before, during, [r.target for r in listed]),
        changed_again=_differ(during, again), not_restored=_differ(before, after),
        states=states, active_after=cpu_mode.active(),
        torch_methods_same=(torch.Tensor.cuda, torch.nn.Module.cuda) == torch_methods,
    )


def _enable_disable_worker(rank, world_size, port):
    return enable_disable_report(megatron_lm=False)


def check_enable_disable_report(report, parts):
    # An only-if-missing entry whose attribute this megatron-core defines itself is "not needed".
    not_needed = sorted(t for t in report["listed"] if report["states"][t] == "not needed")
    listed = [t for t in report["listed"] if t not in not_needed]
    changed = report["changed"]
    if not_needed:
        print(f"\nnot needed with this megatron-core: {', '.join(not_needed)}")
    print(f"\n{len(listed)} redirections listed ({', '.join(parts)}); {len(changed)} attributes changed "
          f"by enable(); {len(report['not_restored'])} differ from the original object after disable()")
    assert changed == listed, f"changed but not listed: {sorted(set(changed) - set(listed))}; " \
                              f"listed but unchanged: {sorted(set(listed) - set(changed))}"
    assert report["changed_again"] == [], report["changed_again"]
    assert report["not_restored"] == [], report["not_restored"]
    assert {report["states"][t] for t in listed} == {"active"}, report["states"]
    assert not report["active_after"] and report["torch_methods_same"]


def test_enable_disable_restores_every_megatron_core_attribute():
    [report] = me.run_workers(_enable_disable_worker, world_size=1)
    check_enable_disable_report(report, ["megatron-core"])


def test_enable_disable_restores_every_megatron_lm_attribute():
    import json
    import os
    import subprocess
    import sys

    path = os.environ.get("MEGATRON_LM_PATH")
    if not path or not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        pytest.skip("set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0")
    for mod in ("six", "regex", "yaml", "pydantic"):
        pytest.importorskip(mod, reason="Megatron-LM's training code needs six regex pyyaml pydantic")
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)  # harness
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.path.dirname(tests), tests, here]))
    script = ("import json, test_cpu_mode\n"
              "from megatron_dualpipe.megatron_lm import triton_stub\n"
              "triton_stub.preimport_triton_users()\n"
              "from megatron_dualpipe import hooks\n"
              "hooks.install(['python'])  # typing.override for core_v0.19.0 on Python 3.11\n"
              "import megatron.training.training\n"
              "print('REPORT' + json.dumps(test_cpu_mode.enable_disable_report(megatron_lm=True)))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_enable_disable_report(json.loads(lines[-1][len("REPORT"):]), ["megatron-core", "megatron-lm"])


def _cli_worker(rank, world_size, port):
    import contextlib
    import io

    from megatron_dualpipe.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["cpu-mode", "--enable", "--json"])
    return code, out.getvalue()


def test_cli_cpu_mode_enable_switches_on_and_back_off():
    """`megatron-dualpipe cpu-mode --enable` in a fresh process: all active, then all restored."""
    import json

    [(code, out)] = me.run_workers(_cli_worker, world_size=1)
    doc = json.loads(out)
    states = {r["part"]: set() for r in doc["redirections"]}
    for r in doc["redirections"]:
        states[r["part"]].add(r["state"])
    print(f"\ncpu-mode --enable: {states}; restore mismatches: {doc['restore_mismatches']}")
    assert code == 0 and doc["restore_mismatches"] == []
    assert states["megatron-lm"] == {"inactive"}
    from megatron_dualpipe.hooks.mechanism import megatron_core_version

    version = megatron_core_version()
    for row, r in zip([d for d in doc["redirections"] if d["part"] == "megatron-core"],
                      cpu_mode.redirections("megatron-core")):
        # "not needed": an only-if-missing redirection whose attribute this version already has
        expected = ("active", "not needed") if version in r.versions else (f"not for megatron-core {version}",)
        assert row["target"] == r.target and row["state"].startswith(expected), (row, expected)
        assert row["state"] != "not needed" or r.only_if_missing, row


def test_every_redirection_says_why():
    for part in cpu_mode.PARTS:
        for r in cpu_mode.redirections(part):
            assert len(r.why) > 15, r.target
    targets = [r.target for part in cpu_mode.PARTS for r in cpu_mode.redirections(part)]
    assert len(targets) == len(set(targets)), "a target is listed twice"


def test_never_active_next_to_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_mode.enable() is False
    assert cpu_mode.enable(megatron_lm=True) is False
    with pytest.raises(RuntimeError, match="forced on a machine where CUDA is available"):
        cpu_mode.enable(force=True)
