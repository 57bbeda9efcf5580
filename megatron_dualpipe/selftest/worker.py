"""What every rank of the selftest runs: the stages in order, each rank's findings gathered on rank 0,
which judges them, rewrites the report and tells every rank whether to go on. A stage is a module with
``NAME``, ``run(ctx) -> payload`` (every rank) and ``judge(ctx, payloads) -> StageResult`` (rank 0);
one that raises is a FAIL naming the rank, printed at once in case its peers never reach the gathering.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
import traceback
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from . import result as R
from .options import SelftestConfig
from .watchdog import SETUP_LIMIT_S, StageWatchdog


@dataclasses.dataclass
class Context:
    """One rank's view: settings, where it sits in the parallel groups, where files go."""

    cfg: SelftestConfig
    rank: int
    world: int
    device: torch.device
    pp_rank: int
    tp_rank: int
    dp_rank: int
    files: List[str] = dataclasses.field(default_factory=list)  # written so far (rank 0), relative to out

    @property
    def coord(self):
        return (self.pp_rank, self.tp_rank, self.dp_rank)

    def path(self, name: str) -> str:
        return os.path.join(self.cfg.out, name)


#: What every rank imports before its first stage (megatron-core: ~3 s of CPU per process), and the
#: forkserver's fast exit.
PRELOAD = ("megatron.core.parallel_state", "megatron_dualpipe.proof.models", __name__, f"{__package__}.forkserver_exit")


#: Imported by the CPU forkserver before megatron-core (the CPU mode's stand-ins, :mod:`.stand_ins_first`).
STAND_INS_FIRST = f"{__package__}.stand_ins_first"


def preload(gpu: bool) -> None:
    """Start the forkserver that :func:`..bench.launch.spawn` forks the ranks from with :data:`PRELOAD`
    imported, so that megatron-core is imported once, not by every rank (4 ranks on 2 cores: 6 s).
    Not with GPUs: an import that asked CUDA anything would leave the forked ranks unable to use it."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    if not gpu and "forkserver" in mp.get_all_start_methods():
        mp.get_context("forkserver").set_forkserver_preload(
            ["megatron_dualpipe.launch.own_session", STAND_INS_FIRST, "torch", "torch.distributed", *PRELOAD])
        forkserver.ensure_running()


def _stages():
    from . import deepseek_v3, environment, equality, memory, nohang, overlap, speed

    return [environment, equality, deepseek_v3, nohang.OddMicrobatches, overlap, speed, memory, nohang.RankRaises]


def _setup(cfg: SelftestConfig, rank: int, world: int, device) -> Context:
    from megatron.core import parallel_state as ps

    from .. import cpu as cpu_mode
    from ..mcore.groups import build_bd_groups
    from ..proof.groups import init_model_parallel

    cpu_mode.enable()  # without a GPU also torch.compile eager: no C++ compiled on every rank
    init_model_parallel(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, timeout_minutes=max(1, round(cfg.deadline_s / 60)))
    build_bd_groups()
    gc.freeze()  # megatron-core's ~3,000 modules: a full collection walked them all (0.5 s each here)
    return Context(cfg, rank, world, device, ps.get_pipeline_model_parallel_rank(),
                   ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())


def _stall_if_injected(stage, ctx: Context) -> None:
    """The test-only fault ``stall:STAGE`` (:mod:`.faults`): rank 1 never ends STAGE."""
    from .faults import stalls

    if stalls(stage.NAME, ctx.rank):
        while True:
            time.sleep(3600)


def _run_stage(stage, ctx: Context):
    try:
        _stall_if_injected(stage, ctx)
        return stage.run(ctx), None
    except Exception as e:  # noqa: BLE001 - becomes the stage's FAIL, naming the rank
        text = f"{type(e).__name__}: {e}"
        print(f"megatron-dualpipe selftest: rank {ctx.rank}: stage {stage.NAME!r} raised {text.splitlines()[0]}",
              file=sys.stderr, flush=True)
        if os.environ.get("MEGATRON_DUALPIPE_SELFTEST_TRACEBACK"):
            text += "\n" + traceback.format_exc()
        return None, text


def worker(rank: int, world: int, device, cfg: SelftestConfig) -> Optional[List[dict]]:
    """Every rank: run the stages; rank 0 returns the results (as dicts), the others None."""
    started = time.perf_counter()
    watchdog = StageWatchdog(rank, cfg.stage_limit_s, cfg.deadline_s)
    watchdog.enter("setting up megatron-core's parallel groups", limit_s=max(cfg.stage_limit_s, SETUP_LIMIT_S))
    ctx = _setup(cfg, rank, world, device)
    results: List[R.StageResult] = []
    for stage in _stages():
        t0 = time.perf_counter()
        watchdog.enter(f"running stage {stage.NAME!r}")
        payload, error = _run_stage(stage, ctx)
        watchdog.enter(f"gathering the findings of stage {stage.NAME!r} (waiting for the other ranks to end it)")
        gathered: List[Any] = [None] * world if rank == 0 else []
        dist.gather_object((payload, error), gathered if rank == 0 else None, dst=0)
        stop = [False]
        if rank == 0:
            watchdog.enter(f"judging stage {stage.NAME!r}")
            errors = {r: e for r, (_, e) in enumerate(gathered) if e is not None}
            res = R.failed_on(stage.NAME, errors) if errors else stage.judge(ctx, [p for p, _ in gathered])
            res.seconds = time.perf_counter() - t0
            results.append(res)
            print("\n".join([res.line(), *(f"    {line}" for line in res.lines)]), flush=True)
            if res.status == R.FAIL:
                for line in res.details[:20]:
                    print(f"    {line}", flush=True)
            R.write(cfg.out, cfg.command, results, time.perf_counter() - started, ctx.files)
            stop = [res.status == R.FAIL and res.hard]
        watchdog.enter(f"waiting for rank 0's verdict on stage {stage.NAME!r}")
        dist.broadcast_object_list(stop, src=0)
        if stop[0]:
            break
    watchdog.stop()
    return [dataclasses.asdict(r) for r in results] if rank == 0 else None
