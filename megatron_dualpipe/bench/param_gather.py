"""The parameter all-gathers of ``--overlap-param-gather`` on synthetic stages over two replicas of
the pipeline, each iteration run three ways: ``none``, ``pre-hook`` (DDP's) and ``param_sync_func``
(``mcore.param_gather``'s) (``bench --param-gather-mb``; method and results: docs/benchmarks.md).
The gathers run on a thread of the rank, in issue order (as on one NCCL communicator), and the host
waits for them: CPU (gloo) only.
"""
from __future__ import annotations

import queue
import statistics
import threading
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..executor.p2p import P2P
from ..executor.runner import TensorSpec, run_rank
from ..schedule.lowering.collectives import chunks_with_real_forward
from ..schedule.lowering.program import build_program
from .synthetic import Spender, SyntheticCompute

NONE, PRE_HOOK, PARAM_SYNC = "none", "pre-hook", "param_sync_func"
MODES = (NONE, PRE_HOOK, PARAM_SYNC)


class ParamGathers:
    """One rank's synthetic parameters, one buffer per chunk, and their all-gathers over its
    data-parallel group (the rank's shard is its half of the buffer). The gathers run one after
    another in issue order, on a thread of their own, as one NCCL communicator runs its
    collectives on its stream (gloo's worker threads would run two at once, each at half the
    speed: the chunk needed first would wait for both)."""

    def __init__(self, chunks: Sequence[int], megabytes: float, group, device):
        n = max(2, int(megabytes * (1 << 20)) // 4 // 2 * 2)
        self.params = {c: torch.zeros(n, dtype=torch.float32, device=device) for c in chunks}
        self.group, self.me = group, dist.get_rank(group)
        self.done: Dict[int, threading.Event] = {}
        self.wait_s = 0.0
        self.log: List[tuple] = []  # ("start" | "wait" | "forward", chunk): one iteration's order
        self._queue: "queue.Queue" = queue.Queue()
        self._failure: List[BaseException] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            c, done = self._queue.get()
            if c is None:
                return
            try:
                halves = list(self.params[c].chunk(2))
                dist.all_gather(halves, halves[self.me].clone(), group=self.group)
            except BaseException as e:  # noqa: BLE001 - re-raised by the waiting thread
                self._failure.append(e)
            done.set()

    def start(self, c: int) -> None:
        self.log.append(("start", c))
        self.done[c] = threading.Event()
        self._queue.put((c, self.done[c]))

    def wait(self, c: int) -> None:
        self.log.append(("wait", c))
        t0 = time.perf_counter()
        self.done.pop(c).wait()
        self.wait_s += time.perf_counter() - t0
        if self._failure:
            raise RuntimeError("a synthetic parameter all-gather failed") from self._failure[0]

    def close(self) -> None:
        self._queue.put((None, None))

    def time_alone(self, rounds: int = 3) -> float:
        """Seconds for every chunk's gathers started together and waited, all ranks in step (median)."""
        times = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            for c in self.params:
                self.start(c)
            for c in list(self.done):
                self.wait(c)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


class GatheringCompute(SyntheticCompute):
    """Synthetic stages whose first forward of a chunk waits for its gathers (DDP's pre-hook), which
    ``mode`` pre-hook also starts there; ``none``: no gathers."""

    def __init__(self, *args, gathers: ParamGathers, mode: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.gathers, self.mode = gathers, mode
        self.gathered: set = set()

    def _before_forward(self, c: int) -> None:
        if c in self.gathered:
            return
        self.gathered.add(c)
        self.gathers.log.append(("forward", c))
        if self.mode == PRE_HOOK:
            self.gathers.start(c)
        if self.mode != NONE:
            self.gathers.wait(c)

    def forward(self, a, input_tensor):
        self._before_forward(a.dir)
        return super().forward(a, input_tensor)

    def forward_backward(self, f_action, b_action, input_tensor, output_grad):
        self._before_forward(f_action.dir)
        return super().forward_backward(f_action, b_action, input_tensor, output_grad)


def _groups(pp: int):
    """Every replica's pipeline group and every pipeline rank's data-parallel group (all ranks
    create all groups, in one order, as ``new_group`` requires)."""
    pipes = [dist.new_group(list(range(j * pp, (j + 1) * pp))) for j in range(2)]
    dps = [dist.new_group([r, pp + r]) for r in range(pp)]
    return pipes, dps


def _one_schedule(cfg, name: str, m: int, pp: int, rank: int, device, spender: Spender, groups) -> dict:
    """This rank's per-iteration wall and wait seconds of every mode, and its ``alone`` time."""
    pipes, dps = groups
    replica, r = divmod(rank, pp)
    program = build_program(name, pp, m)
    spec = TensorSpec(tuple(cfg.shape), torch.float32, device)
    p2p = P2P(pipes[replica], list(range(replica * pp, (replica + 1) * pp)), r, timeout_s=cfg.timeout_s)
    chunks = chunks_with_real_forward(program.actions[r], lambda a: False)  # synthetic: no fake micro-batches
    gathers = ParamGathers(chunks, cfg.param_gather_mb, dps[r], device)
    out = {mode: {"wall_s": [], "wait_s": [], "log": []} for mode in MODES}
    for it in range(cfg.warmup + cfg.iters):
        for mode in MODES:
            compute = GatheringCompute(cfg.costs, spender, cfg.shape, gathers=gathers, mode=mode)
            spender.start_iteration()
            gathers.wait_s, gathers.log = 0.0, []
            dist.barrier()
            t0 = time.perf_counter()
            if mode == PARAM_SYNC:
                for c in chunks:
                    gathers.start(c)
            run_rank(program, r, compute, p2p, spec)
            if it >= cfg.warmup:
                out[mode]["wall_s"].append(time.perf_counter() - t0)
                out[mode]["wait_s"].append(gathers.wait_s)
                out[mode]["log"] = list(gathers.log)
    out["alone_s"] = gathers.time_alone()
    gathers.close()
    return out


def worker(rank: int, world: int, device, cfg) -> dict:
    """One rank's figures for every (schedule, M): see the module docstring."""
    if device.type != "cpu":
        raise RuntimeError(f"bench --param-gather-mb waits for the gathers on the host, as gloo does; on {device.type} "
                           f"a wait only holds the stream, which it does not model yet: run it where no GPU is "
                           f"visible (CUDA_VISIBLE_DEVICES=) or leave out --param-gather-mb")
    pp = world // 2
    spender = Spender(cfg.mode, device, cfg.matmul_size)
    groups = _groups(pp)
    runs = {(name, m): _one_schedule(cfg, name, m, pp, rank, device, spender, groups)
            for m in cfg.microbatches[pp] for name in cfg.schedules}
    return {"runs": runs, "device": str(device), "backend": dist.get_backend()}


def summary(ranks: Sequence[dict], pp: int) -> List[dict]:
    """Per (schedule, M): each mode's median, exposed (minus ``none``'s) and host-wait ms; the slowest ``alone``."""
    rows = []
    for (name, m) in ranks[0]["runs"]:
        runs = [r["runs"][(name, m)] for r in ranks]
        wall = {mode: [max(run[mode]["wall_s"][i] for run in runs) * 1e3 for i in range(len(runs[0][mode]["wall_s"]))]
                for mode in MODES}
        row = {"schedule": name, "pp": pp, "m": m, "alone_ms": max(run["alone_s"] for run in runs) * 1e3}
        for mode in MODES:
            row[f"{mode}_ms"] = statistics.median(wall[mode])
            row[f"{mode}_wait_ms"] = max(statistics.median(run[mode]["wait_s"]) for run in runs) * 1e3
            row[f"{mode}_exposed_ms"] = statistics.median(w - n for w, n in zip(wall[mode], wall[NONE]))
        rows.append(row)
    return rows


def table(rows: Sequence[dict], megabytes: float, env: Optional[dict] = None) -> str:
    """The rows as text, against what the cost model assumes exposed (0 ms)."""
    head = (f"parameter all-gathers, {megabytes:g} MiB per chunk over 2 replicas (2 x pp processes"
            + (f", {env['backend']} on {env['device']}" if env else "") + "): exposed ms = iteration minus the "
            "iteration without gathers (median); cost model (advise): 0 exposed (no term for them)")
    lines = [head, "schedule        pp   M  none ms  alone ms  pre-hook: exposed (wait)  param_sync_func: exposed (wait)"
             "  hidden: pre-hook / param_sync_func"]
    for r in rows:
        pre, sync = r[f"{PRE_HOOK}_exposed_ms"], r[f"{PARAM_SYNC}_exposed_ms"]
        lines.append(f"{r['schedule']:<14} {r['pp']:>3} {r['m']:>3} {r['none_ms']:>8.1f} {r['alone_ms']:>9.1f}"
                     f"  {pre:>14.1f} ({r[f'{PRE_HOOK}_wait_ms']:.1f})"
                     f"  {sync:>21.1f} ({r[f'{PARAM_SYNC}_wait_ms']:.1f})"
                     f"  {r['alone_ms'] - pre:>9.1f} / {r['alone_ms'] - sync:.1f}")
    return "\n".join(lines)
