"""mcore.step_options: the options that decide a job's collectives after the schedule, read from
the model config, the DDP config, the chunks' copy-sum mark and the tensor-parallel size.

Each field is checked against a job that has it and one that has not: a field read from the wrong
attribute would leave its collectives out of the plan check (the MoE and fp16 ones, the shared
shard group's reduce-scatters), unnoticed.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dualpipe.mcore import step_options as SO
from megatron_dualpipe.mcore.copies.dp_first import DP_FIRST_ATTR
from megatron_dualpipe.schedule.copy_sum import DP_FIRST

PLAIN = dict(sequence_parallel=False, qk_layernorm=False, num_moe_experts=None, fp16=False,
             moe_router_enable_expert_bias=False, moe_router_load_balancing_type="aux_loss",
             calculate_per_token_loss=False, mtp_num_layers=None)


class _Chunk(torch.nn.Module):
    def __init__(self, ddp=None, tied=False, mark=None):
        super().__init__()
        self.module = torch.nn.Linear(1, 1)
        self.module.share_embeddings_and_output_weights = tied
        if ddp is not None:
            self.ddp_config = SimpleNamespace(**ddp)
        if mark:
            setattr(self, mark, True)


def _options(monkeypatch, tp=1, ddp=None, tied=False, mark=None, **config):
    monkeypatch.setattr(SO.parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(SO, "_megatron_lm_args", lambda: None)
    model = [_Chunk(ddp, tied, mark), _Chunk(ddp, tied, mark)]
    return SO.step_options(model, SimpleNamespace(**{**PLAIN, **config}), drift_check=False, advise=False)


@pytest.mark.parametrize("field,job,value", [
    ("tp_grads", dict(tp=2, sequence_parallel=True), True),
    ("tp_grads", dict(tp=1, sequence_parallel=True), False),
    ("tp_grads", dict(tp=2, qk_layernorm=True), True),
    ("moe", dict(num_moe_experts=4), True),
    ("fp16", dict(fp16=True), True),
    ("distributed_optimizer", dict(ddp=dict(use_distributed_optimizer=True, overlap_param_gather=False)), True),
    ("overlap_param_gather", dict(ddp=dict(use_distributed_optimizer=True, overlap_param_gather=True)), True),
    ("expert_bias", dict(moe_router_enable_expert_bias=True), True),
    ("quantile_balancing", dict(moe_router_load_balancing_type="quantile_balancing"), True),
    ("quantile_balancing", dict(moe_router_load_balancing_type=["aux_loss", "quantile_balancing"]), True),
    ("per_token_loss", dict(calculate_per_token_loss=True), True),
    ("tied_embeddings", dict(tied=True), True),
    ("tied_embeddings", dict(mtp_num_layers=1), True),
    ("copy_sum", dict(mark=DP_FIRST_ATTR), DP_FIRST),
    ("moe_logged", dict(num_moe_experts=4), ("load_balancing_loss",)),
    ("moe_logged", dict(num_moe_experts=4, moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=1e-3),
     ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")),  # Megatron-LM's own `in` on the string
    ("moe_logged", dict(num_moe_experts=4, moe_router_load_balancing_type=["global_aux_loss"]),
     ("global_load_balancing_loss",)),
    ("mtp", dict(mtp_num_layers=1), True),
    ("timing_level", dict(timers=SimpleNamespace(_log_level=1)), 1),  # megatron-core alone: its timers' level
    ("l1_barrier", dict(barrier_with_L1_time=False), False),
])
def test_each_field_is_read_from_the_job(monkeypatch, field, job, value):
    plain = _options(monkeypatch)
    got = _options(monkeypatch, **job)
    print(f"{field}: {getattr(plain, field)!r} without, {getattr(got, field)!r} with {job}")
    assert getattr(got, field) == value
    assert getattr(plain, field) != value or not value


def test_without_megatron_lm_the_zero_count_is_checked(monkeypatch):
    """megatron-core alone cannot tell --log-num-zeros-in-grad: its collectives count as issued."""
    assert _options(monkeypatch).log_zeros
    monkeypatch.setattr(SO.parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(SO, "_megatron_lm_args", lambda: SimpleNamespace(log_num_zeros_in_grad=False))
    assert not SO.step_options([_Chunk(), _Chunk()], SimpleNamespace(**PLAIN), drift_check=True,
                               advise=True).log_zeros


def _with_args(monkeypatch, **args):
    monkeypatch.setattr(SO.parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(SO, "_megatron_lm_args", lambda: SimpleNamespace(**args))
    return SO.step_options([_Chunk(), _Chunk()], SimpleNamespace(**PLAIN), drift_check=False, advise=False)


@pytest.mark.parametrize("field,args,value", [
    ("rerun", dict(rerun_mode="disabled"), False),
    ("rerun", dict(rerun_mode="validate_results"), True),
    ("rerun", dict(rerun_mode="report_determinism_stats"), True),
    ("params_norm", dict(log_params_norm=True), True),
    ("params_norm", dict(log_params_norm=False), False),
    ("exit_signal", dict(exit_signal_handler=True), True),
    ("exit_signal", dict(exit_signal_handler=False), False),
    ("exit_duration", dict(exit_duration_in_mins=30), True),
    ("exit_duration", dict(exit_duration_in_mins=None), False),
    ("async_save", dict(async_save=True), True),
    ("async_save", dict(async_save=False), False),
    ("timing_level", dict(timing_log_level=1), 1),
    ("timing_level", dict(timing_log_level=0), 0),
    ("timers_written", dict(log_timers_to_tensorboard=True), True),
    ("timers_written", dict(log_timers_to_tensorboard=False), False),
    ("qk_logits", dict(qk_clip=True), True),
    ("qk_logits", dict(log_max_attention_logit=True), True),
    ("qk_logits", dict(qk_clip=False, log_max_attention_logit=False), False),
])
def test_megatron_lms_arguments_are_read(monkeypatch, field, args, value):
    """The rerun state machine's all-reduce, --log-params-norm's, the exit checks', from Megatron-LM's
    arguments; without them (megatron-core alone) they count as issued."""
    got = getattr(_with_args(monkeypatch, **args), field)
    print(f"{field}: {got!r} with {args}")
    assert got == value
    assert getattr(_options(monkeypatch), field) or field == "timing_level"  # no timers in PLAIN's config


def _megatron_lm_config(relative: str):
    """A Megatron-LM config module (dataclasses, no Megatron-LM import) from MEGATRON_LM_PATH."""
    import importlib.util
    import os

    root = os.environ.get("MEGATRON_LM_PATH")
    paths = [os.path.join(root, "megatron", "training", sub, relative) for sub in ("config", "")] if root else []
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None:
        pytest.skip(f"no Megatron-LM checkout with {relative} (MEGATRON_LM_PATH)")
    spec = importlib.util.spec_from_file_location(f"_mlm_{relative[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_argument_names_are_megatron_lms():
    """The attributes read above are Megatron-LM's (its parser makes one per config field), and its
    default rerun mode is one that all-reduces every iteration."""
    import dataclasses

    rerun = {f.name: f.default for f in dataclasses.fields(_megatron_lm_config("resilience_config.py")
                                                            .RerunStateMachineConfig)}
    logger = {f.name: f.default for f in dataclasses.fields(_megatron_lm_config("training_config.py").LoggerConfig)}
    print(f"rerun_mode default {rerun['rerun_mode']!r}; log_params_norm default {logger['log_params_norm']!r}; "
          f"log_num_zeros_in_grad default {logger['log_num_zeros_in_grad']!r}")
    assert rerun["rerun_mode"] != "disabled" and logger["log_params_norm"] is False
    training = {f.name for f in dataclasses.fields(_megatron_lm_config("training_config.py").TrainingConfig)}
    assert {"exit_signal_handler", "exit_duration_in_mins"} <= training
    checkpoint = {f.name for f in dataclasses.fields(_megatron_lm_config("training_config.py").CheckpointConfig)}
    assert "async_save" in checkpoint
    assert {"timing_log_level", "log_timers_to_tensorboard", "log_max_attention_logit"} <= set(logger)
