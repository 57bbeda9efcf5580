"""megatron_dualpipe.mcore.{groups,model,grads}: bd groups, the two-chunk model, gradient finalize.

Multi-process on CPU/gloo (run_workers). Each configuration runs once (module-scoped fixtures)
and returns plain numbers / numpy arrays; the tests compare them across ranks in the parent.
"""
from __future__ import annotations

import numpy as np
import pytest

from harness.megatron_env import run_workers

SEED = 1234


# ------------------------------------------------------------------------------------------
# worker side


def _spec(num_layers, tied):
    """The tiny GPT these tests build (the proof harness's, which the selftest builds too)."""
    from megatron_dualpipe.proof.models import ModelSpec

    return ModelSpec(layers=num_layers, tied=tied)


def _recording_provider(spec, seen_pp_ranks, v_layout=False):
    """The proof harness's provider, noting what parallel_state says while each chunk is built."""
    from megatron.core import parallel_state

    from megatron_dualpipe.proof.models import provider

    build = provider(spec, v_layout)

    def recorded(*, pre_process, post_process, pg_collection=None, vp_stage=None):
        seen_pp_ranks.append(parallel_state.get_pipeline_model_parallel_rank())
        return build(pre_process=pre_process, post_process=post_process, pg_collection=pg_collection,
                     vp_stage=vp_stage)

    return recorded


def _chunk_summary(chunk):
    from megatron_dualpipe.mcore.model import chunk_info

    layers = chunk.decoder.layers
    tied_flags = {}
    for name, p in chunk.named_parameters():
        tied_flags[name] = (bool(getattr(p, "shared", False)), bool(getattr(p, "shared_embedding", False)))
    return dict(
        first_layer=int(layers[0].layer_number) if len(layers) else None,
        num_layers=len(layers),
        pre=bool(chunk.pre_process),
        post=bool(chunk.post_process),
        info=dict(chunk_info(chunk)),
        flags=tied_flags,
        params={n: p.detach().clone() for n, p in chunk.named_parameters()},
    )


def _hand_grad(rank, d, shape):
    """Gradient put on parameter copies: depends on the rank and chunk (and the shape)."""
    import torch

    n = int(np.prod(shape)) if len(shape) else 1
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 1e-3 + (10 * rank + d + 1))


def _set_hand_grads(model, rank):
    for d, chunk in enumerate(model):
        for p in chunk.parameters():
            p.grad = _hand_grad(rank, d, tuple(p.shape))


def _grads(model):
    return [{n: p.grad.detach().clone() for n, p in c.named_parameters()} for c in model]


def _worker(rank, world_size, port, pp, num_layers):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dualpipe.mcore import finalize as G
    from megatron_dualpipe.mcore import groups
    from megatron_dualpipe.mcore import model as M
    from harness.megatron_env import destroy_distributed, init_distributed_cpu
    from megatron_dualpipe.proof.models import full_state_dict, provider
    from megatron_dualpipe.proof.names import full_key, load_stage_from_full
    from megatron_dualpipe.proof.tiny_gpt import seed_all

    init_distributed_cpu(rank, world_size, port, pp=pp)
    out = {"num_layers": num_layers}
    try:
        # Accessors fail clearly before build.
        try:
            groups.get_bd_group()
            out["error_before_build"] = None
        except groups.BDGroupsNotInitializedError as e:
            out["error_before_build"] = str(e)
        groups.build_bd_groups()
        out["initialized"] = groups.bd_groups_initialized()
        rev = groups.get_reversed_pp_group()
        out["pp_ranks"] = groups.get_pp_global_ranks()
        out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        out["rev_rank"] = rev.rank()
        out["rev_ranks"] = dist.get_process_group_ranks(rev)
        out["mirror"] = groups.get_bd_mirror_rank()
        out["bd_ranks"] = groups.get_bd_ranks()
        bd = groups.get_bd_group()
        out["bd_group_ranks"] = dist.get_process_group_ranks(bd) if bd is not None else None
        t = torch.tensor([float(rank + 1)])
        if bd is not None:
            dist.all_reduce(t, group=bd)
        out["bd_sum"] = float(t)
        t = torch.tensor([float(2 ** rank)])
        dist.all_reduce(t, group=rev)
        out["rev_sum"] = float(t)

        # ---- DualPipe (bidirectional), tied and untied
        for tied in (True, False):
            key = "bd_tied" if tied else "bd_untied"
            full = full_state_dict(_spec(num_layers, tied))
            seed_all(SEED + 17 * rank)  # different per rank: only the broadcast makes copies equal
            seen = []
            recorded = _recording_provider(_spec(num_layers, tied), seen)
            model = M.build_two_direction_model(recorded, layout_kind="bidirectional")
            config = model[0].config
            res = {"chunks": [_chunk_summary(c) for c in model], "seen_pp_ranks": seen,
                   "pp_rank_after": parallel_state.get_pipeline_model_parallel_rank()}
            # Load the full model into model[0] everywhere, broadcast again: model[1] must then
            # be the full model's weights of the mirrored stage.
            load_stage_from_full(model[0], full)
            M.broadcast_mirrors(model)
            offset1 = model[1].decoder.layers[0].layer_number - 1
            mism = []
            for name, p in model[1].named_parameters():
                fk = full_key(name, offset1, full)
                if not torch.equal(p.detach(), full[fk]):
                    mism.append((name, fk))
            res["mirror_vs_full_mismatch"] = mism
            res["mirror_num_params"] = len(list(model[1].parameters()))
            # Hand-set gradients, bd all-reduce + fold, and finalize (unwrapped: stock skipped)
            _set_hand_grads(model, rank)
            G.allreduce_bd_grads(model)
            G.fold_tied_embedding_grads(model)
            res["grads"] = _grads(model)
            _set_hand_grads(model, rank)
            tokens = torch.tensor(float(rank + 1))
            res["tokens"] = float(G.finalize_dualpipe_grads(model, tokens))
            res["grads_finalize"] = _grads(model)
            # Custom finalize_func: sees the placeholder embd group and pos_embd None
            seen = {}

            def recorder(m, nt, pg_collection=None, force_all_reduce=False):
                from megatron.core.utils import get_pg_size

                seen.update(embd_size=get_pg_size(pg_collection.embd), pos_embd=pg_collection.pos_embd,
                            pp_is_physical=pg_collection.pp is parallel_state.get_pipeline_model_parallel_group(),
                            nt=float(nt), force=force_all_reduce)

            G.finalize_dualpipe_grads(model, torch.tensor(1.0), finalize_func=recorder, force_all_reduce=True)
            res["recorder"] = seen
            # Megatron's stock embedding-grad reduction with embd=None asserts (why the
            # placeholder exists); with the placeholder it is skipped.
            import importlib

            fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

            try:
                fmg._allreduce_word_embedding_grads(model, config, None, parallel_state.get_pipeline_model_parallel_group())
                res["embd_none_ok"] = True
            except AssertionError:
                res["embd_none_ok"] = False
            before = _grads(model)
            fmg._allreduce_word_embedding_grads(model, config, G.NO_EMBEDDING_GROUP,
                                                parallel_state.get_pipeline_model_parallel_group())
            res["placeholder_untouched"] = all(
                torch.equal(before[d][n], g) for d, gs in enumerate(_grads(model)) for n, g in gs.items()
            )
            out[key] = res

        # ---- DualPipeV, tied
        seed_all(SEED + 17 * rank)
        seen = []
        recorded = _recording_provider(_spec(num_layers, True), seen, v_layout=True)
        model = M.build_two_direction_model(recorded, layout_kind="v")
        res = {"chunks": [_chunk_summary(c) for c in model], "seen_pp_ranks": seen}
        _set_hand_grads(model, rank)
        G.finalize_dualpipe_grads(model, None)
        res["grads"] = _grads(model)
        out["v_tied"] = res

        # V with a config lacking the virtual pipeline: clear error
        try:
            M.build_two_direction_model(provider(_spec(num_layers, False)), layout_kind="v")
            out["v_bad_config"] = None
        except ValueError as e:
            out["v_bad_config"] = str(e)

        groups.destroy_bd_groups()
        out["after_destroy"] = groups.bd_groups_initialized()
        return out
    finally:
        groups.destroy_bd_groups()
        destroy_distributed()


def _dp_worker(rank, world_size, port):
    """dp=2, pp=2 (world 4): bd pairs; DDP-wrapped chunks through megatron's stock finalize."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dualpipe.mcore import finalize as G
    from megatron_dualpipe.mcore import groups
    from megatron_dualpipe.mcore import model as M
    from harness.megatron_env import destroy_distributed, init_distributed_cpu
    from megatron_dualpipe.proof.models import provider
    from megatron_dualpipe.proof.tiny_gpt import seed_all

    init_distributed_cpu(rank, world_size, port, pp=2)
    out = {}
    try:
        groups.build_bd_groups()
        out["pp_ranks"] = groups.get_pp_global_ranks()
        out["dp_ranks"] = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        out["mirror"] = groups.get_bd_mirror_rank()
        out["bd_group_ranks"] = dist.get_process_group_ranks(groups.get_bd_group())
        out["rev_rank"] = groups.get_reversed_pp_group().rank()
        out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        seed_all(SEED + 17 * rank)
        model = M.build_two_direction_model(provider(_spec(8, True)))
        out["chunks"] = [_chunk_summary(c) for c in model]
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
        wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in model]
        for c in wrapped:
            c.zero_grad_buffer()
        for d, c in enumerate(wrapped):
            for p in c.module.parameters():
                p.main_grad.copy_(_hand_grad(rank, d, tuple(p.shape)))
        G.finalize_dualpipe_grads(wrapped, None)
        out["ddp_grads"] = [{n: p.main_grad.detach().clone() for n, p in c.module.named_parameters()} for c in wrapped]
        return out
    finally:
        groups.destroy_bd_groups()
        destroy_distributed()


# ------------------------------------------------------------------------------------------
# parent side


@pytest.fixture(scope="module")
def pp4():
    return run_workers(_worker, world_size=4, args=(4, 8), timeout=150)


@pytest.fixture(scope="module")
def pp2():
    return run_workers(_worker, world_size=2, args=(2, 8), timeout=120)


@pytest.fixture(scope="module")
def pp3():
    """Odd pipeline: the middle rank is its own bd partner (local copy / local sum)."""
    return run_workers(_worker, world_size=3, args=(3, 6), timeout=150)


@pytest.fixture(scope="module")
def dp2pp2():
    return run_workers(_dp_worker, world_size=4, timeout=150)


@pytest.mark.parametrize("which", ["pp4", "pp2", "pp3"])
def test_groups(which, request):
    res = request.getfixturevalue(which)
    pp = len(res)
    for r, out in enumerate(res):
        assert "build_bd_groups" in out["error_before_build"]
        assert out["initialized"] and out["after_destroy"] is False
        assert out["pp_ranks"] == list(range(pp)) and out["pp_rank"] == r
        assert out["rev_rank"] == pp - 1 - r
        assert out["rev_ranks"] == list(reversed(range(pp)))
        assert out["mirror"] == pp - 1 - r
        assert out["bd_ranks"] == sorted({r, pp - 1 - r})
        if r == pp - 1 - r:  # middle of an odd pipeline: no group
            assert out["bd_group_ranks"] is None and out["bd_sum"] == r + 1
        else:
            assert out["bd_group_ranks"] == sorted([r, pp - 1 - r])
            assert out["bd_sum"] == (r + 1) + (pp - r)
        assert out["rev_sum"] == 2 ** pp - 1


def test_groups_dp2(dp2pp2):
    # order tp-cp-ep-dp-pp: pipeline groups [0, 2] and [1, 3]
    for r, out in enumerate(dp2pp2):
        pp_ranks = [r % 2, r % 2 + 2]
        assert out["pp_ranks"] == pp_ranks
        assert out["mirror"] == (pp_ranks[1] if r == pp_ranks[0] else pp_ranks[0])
        assert out["bd_group_ranks"] == pp_ranks
        assert out["rev_rank"] == 1 - out["pp_rank"]


def _expected_bd_chunk(pp, r, d, num_layers):
    stage = r if d == 0 else pp - 1 - r
    return dict(stage=stage, first_layer=stage * num_layers // pp + 1, num_layers=num_layers // pp,
                pre=stage == 0, post=stage == pp - 1)


@pytest.mark.parametrize("which", ["pp4", "pp2", "pp3"])
@pytest.mark.parametrize("key", ["bd_tied", "bd_untied"])
def test_dualpipe_chunks(which, key, request):
    res = request.getfixturevalue(which)
    pp = len(res)
    tied = key == "bd_tied"
    for r, out in enumerate(res):
        for d in (0, 1):
            c = out[key]["chunks"][d]
            e = _expected_bd_chunk(pp, r, d, out["num_layers"])
            assert (c["first_layer"], c["num_layers"], c["pre"], c["post"]) == (
                e["first_layer"], e["num_layers"], e["pre"], e["post"]), (r, d, c)
            assert c["info"] == dict(layout="bidirectional", direction=d, stage=e["stage"], num_stages=pp)
            # parallel_state answers for the mirrored stage while model[1] is built, then is restored
            assert out[key]["seen_pp_ranks"] == [r, pp - 1 - r] and out[key]["pp_rank_after"] == r
            names = set(c["params"])
            assert ("embedding.word_embeddings.weight" in names) == e["pre"]
            assert ("output_layer.weight" in names) == (e["post"] and not (tied and e["pre"]))
            for name, (shared, shared_emb) in c["flags"].items():
                if d == 1:
                    assert shared, (r, name)  # every mirrored param is marked
                else:
                    # megatron itself marks only the last stage's tied output weight
                    assert shared == (tied and name == "output_layer.weight"), (r, name)
                if tied and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    assert shared_emb


@pytest.mark.parametrize("which", ["pp4", "pp2", "pp3"])
@pytest.mark.parametrize("key", ["bd_tied", "bd_untied"])
def test_broadcast_makes_mirrors_equal(which, key, request):
    res = request.getfixturevalue(which)
    pp = len(res)
    for r in range(pp):
        home = res[r][key]["chunks"][0]["params"]
        mirror = res[pp - 1 - r][key]["chunks"][1]["params"]
        assert home.keys() == mirror.keys()
        for n in home:
            np.testing.assert_array_equal(home[n], mirror[n], err_msg=f"{key} stage {r} {n}")
    # ranks were seeded differently: independent builds of a stage would differ
    a = res[0][key]["chunks"][0]["params"]["decoder.layers.0.mlp.linear_fc1.weight"]
    b = res[pp - 1][key]["chunks"][1]["params"]["decoder.layers.0.mlp.linear_fc1.weight"]
    c = res[pp - 1][key]["chunks"][0]["params"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    if key == "bd_tied":
        emb = res[0][key]["chunks"][0]["params"]["embedding.word_embeddings.weight"]
        copies = [
            res[0][key]["chunks"][1]["params"]["output_layer.weight"],
            res[pp - 1][key]["chunks"][0]["params"]["output_layer.weight"],
            res[pp - 1][key]["chunks"][1]["params"]["embedding.word_embeddings.weight"],
        ]
        assert np.abs(emb).sum() > 0
        for c in copies:
            np.testing.assert_array_equal(emb, c)
    for out in res:
        assert out[key]["mirror_vs_full_mismatch"] == []
        assert out[key]["mirror_num_params"] > 0


def _expected_grad(res, key, pp, r, d, name, tied):
    """Sum of the hand-set gradients of every copy of the logical parameter."""
    shape = res[r][key]["chunks"][d]["params"][name].shape
    hg = lambda rank, dd: _hand_grad(rank, dd, shape).numpy()  # noqa: E731
    stage = r if d == 0 else pp - 1 - r
    home, mirror = stage, pp - 1 - stage  # model[0] on `home`, model[1] on `mirror`
    total = hg(home, 0) + hg(mirror, 1)
    if tied and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        # embedding copies: rank 0 m0, rank pp-1 m1; output copies: rank pp-1 m0, rank 0 m1
        total = hg(0, 0) + hg(pp - 1, 1) + hg(pp - 1, 0) + hg(0, 1)
    return total


@pytest.mark.parametrize("which", ["pp4", "pp2", "pp3"])
@pytest.mark.parametrize("key", ["bd_tied", "bd_untied"])
def test_bd_grads_and_fold(which, key, request):
    res = request.getfixturevalue(which)
    pp = len(res)
    tied = key == "bd_tied"
    for r, out in enumerate(res):
        for field in ("grads", "grads_finalize"):
            for d in (0, 1):
                for name, g in out[key][field][d].items():
                    exp = _expected_grad(res, key, pp, r, d, name, tied)
                    np.testing.assert_allclose(g, exp, rtol=0, atol=1e-5, err_msg=f"{field} r{r} d{d} {name}")
        assert out[key]["tokens"] == pp * (pp + 1) / 2
        assert out[key]["recorder"] == dict(embd_size=1, pos_embd=None, pp_is_physical=True, nt=float(pp), force=True)
        assert out[key]["placeholder_untouched"]
    # megatron-core 0.16.1: embd=None falls back to parallel_state's embedding group and
    # asserts on its members (ranks 0 and pp-1), hence the size-1 placeholder
    assert res[0][key]["embd_none_ok"] is False


@pytest.mark.parametrize("which", ["pp4", "pp2", "pp3"])
def test_dualpipev_chunks_and_grads(which, request):
    res = request.getfixturevalue(which)
    pp = len(res)
    per = res[0]["num_layers"] // (2 * pp)
    for r, out in enumerate(res):
        v = out["v_tied"]
        for d in (0, 1):
            c = v["chunks"][d]
            stage = r if d == 0 else 2 * pp - 1 - r
            assert (c["first_layer"], c["num_layers"]) == (stage * per + 1, per), (r, d)
            assert c["pre"] == (stage == 0) and c["post"] == (stage == 2 * pp - 1)
            assert c["info"] == dict(layout="v", direction=d, stage=stage, num_stages=2 * pp)
            assert v["seen_pp_ranks"] == [r, pp - 1 - r]
            for name, (shared, _) in c["flags"].items():
                assert shared == (r == 0 and d == 1 and name == "output_layer.weight"), (r, d, name)
            for name, g in v["grads"][d].items():
                shape = c["params"][name].shape
                exp = _hand_grad(r, d, shape).numpy()
                if r == 0 and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    exp = _hand_grad(0, 0, shape).numpy() + _hand_grad(0, 1, shape).numpy()
                np.testing.assert_allclose(g, exp, rtol=0, atol=1e-5)
        assert "virtual_pipeline_model_parallel_size" in out["v_bad_config"]
    c0, c1 = res[0]["v_tied"]["chunks"]
    np.testing.assert_array_equal(c0["params"]["embedding.word_embeddings.weight"], c1["params"]["output_layer.weight"])
    assert np.abs(c1["params"]["output_layer.weight"]).sum() > 0


def test_ddp_stock_finalize_dp2(dp2pp2):
    pp, dp = 2, 2
    # global rank r: dp index r % 2? pipeline groups [0,2], [1,3]: pp rank = r // 2
    for r, out in enumerate(dp2pp2):
        i = r // 2
        for d in (0, 1):
            stage = i if d == 0 else pp - 1 - i
            for name, g in out["ddp_grads"][d].items():
                shape = g.shape
                # copies of this stage: m0 on pp rank `stage`, m1 on pp rank pp-1-stage, in
                # both dp replicas (global rank = pp_rank * 2 + dp_index); DP averages
                tot = 0
                for dpi in range(dp):
                    tot = tot + _hand_grad(stage * 2 + dpi, 0, shape).numpy() + _hand_grad((pp - 1 - stage) * 2 + dpi, 1, shape).numpy()
                if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    tot = 0
                    for dpi in range(dp):
                        for rr in (0, 2):
                            tot = tot + _hand_grad(rr + dpi, 0, shape).numpy() + _hand_grad(rr + dpi, 1, shape).numpy()
                exp = tot / dp
                np.testing.assert_allclose(g, exp, rtol=1e-6, atol=1e-5, err_msg=f"r{r} d{d} {name}")
