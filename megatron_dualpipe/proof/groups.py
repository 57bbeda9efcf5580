"""megatron-core's parallel groups for a proof, on the process group already started (gloo on the
CPU for the tests, NCCL or gloo for the selftest)."""
from __future__ import annotations

from typing import Optional

from .tiny_gpt import seed_all


def init_model_parallel(*, tp: int = 1, pp: int = 1, ep: int = 1, vpp: Optional[int] = None,
                        timeout_minutes: int = 2, seed: int = 1234) -> None:
    """Build megatron-core's model-parallel groups (no gloo side groups); seed torch's generator
    and the model-parallel RNG tracker with ``seed`` (:func:`.tiny_gpt.seed_all`)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_minutes, create_gloo_process_groups=False)
    seed_all(seed)
