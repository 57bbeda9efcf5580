"""Stage ``environment``: versions, devices, links, the point-to-point latency and bandwidth of pipeline
neighbours and bd pairs, and where each bd pair sits (DualPipe sums over it every iteration).
"""
from __future__ import annotations

import importlib.metadata
import platform
import shutil
import socket
import subprocess
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps

from .. import __version__
from ..bench.measure import half_round_trip_s
from .result import FAIL, PASS, StageResult

NAME = "environment"


def _version(dist_name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> Dict[str, Optional[str]]:
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = "unavailable"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "megatron-core": _version("megatron-core") or _version("megatron_core"),
            "transformer-engine": _version("transformer-engine") or _version("transformer_engine"),
            "megatron-dualpipe": __version__}


def _device_name(device: torch.device) -> str:
    cpu = f"CPU ({platform.processor() or platform.machine()})"
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu


def _links() -> Optional[str]:
    """``nvidia-smi topo -m`` (how the GPUs of this node are connected), if there is one."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        return subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def pipeline_pairs(pp_ranks: List[int]) -> List[tuple]:
    """(kind, a, b) global ranks: pipeline neighbours, then bd pairs (each once)."""
    pp = len(pp_ranks)
    pairs = [("neighbours", pp_ranks[i], pp_ranks[i + 1]) for i in range(pp - 1)]
    pairs += [("bd pair", pp_ranks[i], pp_ranks[pp - 1 - i]) for i in range(pp // 2)]
    return pairs


def run(ctx) -> dict:
    group_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    first_pipeline = [group_ranks if ctx.rank == 0 else None]
    dist.broadcast_object_list(first_pipeline, src=0)
    small = torch.zeros(8, device=ctx.device)
    big_mib = 4 if ctx.device.type == "cpu" else 64
    big = torch.zeros(big_mib * (1 << 18), device=ctx.device)  # float32: 4 bytes each
    rounds = 10 if ctx.cfg.quick else 50
    measured = []
    for kind, a, b in pipeline_pairs(first_pipeline[0]):
        if ctx.rank in (a, b):
            peer = b if ctx.rank == a else a
            lat = half_round_trip_s(ctx.rank, peer, small, rounds, ctx.device)
            t = half_round_trip_s(ctx.rank, peer, big, max(3, rounds // 10), ctx.device)
            if ctx.rank == a:
                measured.append({"kind": kind, "ranks": (a, b), "latency_us": lat * 1e6,
                                 "bandwidth_gbs": big.numel() * 4 / t / 1e9})
        dist.barrier()
    local = ctx.device.index if ctx.device.type == "cuda" else None
    return {"host": socket.gethostname(), "device": _device_name(ctx.device), "local": local,
            "versions": versions() if ctx.rank == 0 else None, "links": _links() if local == 0 else None,
            "pairs": measured, "backend": dist.get_backend(), "coord": ctx.coord}


def judge(ctx, payloads: List[dict]) -> StageResult:
    v = payloads[0]["versions"]
    hosts = [p["host"] for p in payloads]
    pairs = sorted((pr for p in payloads for pr in p["pairs"]), key=lambda x: (x["kind"] != "neighbours", x["ranks"]))
    details = ["versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
               f"backend {payloads[0]['backend']}, {len(payloads)} ranks on {len(set(hosts))} node(s); "
               f"tp={ctx.cfg.tp} pp={ctx.cfg.pp} ep={ctx.cfg.ep} dp={ctx.cfg.ep}"]
    for r, p in enumerate(payloads):
        details.append(f"rank {r}: {p['host']}, {p['device']}, (pp, tp, dp) = {tuple(p['coord'])}")
    for p in payloads:
        if p["links"]:
            details += [f"links on {p['host']} (nvidia-smi topo -m):", *p["links"].splitlines()]
    cross = []
    for pr in pairs:
        a, b = pr["ranks"]
        where = "same node" if hosts[a] == hosts[b] else "different nodes"
        if pr["kind"] == "bd pair" and hosts[a] != hosts[b]:
            cross.append(f"{a}-{b}")
        details.append(f"{pr['kind']} {a} <-> {b} ({where}): latency {pr['latency_us']:.1f} us, "
                       f"bandwidth {pr['bandwidth_gbs']:.2f} GB/s")
    expected = len(pipeline_pairs(list(range(ctx.cfg.pp))))
    if len(pairs) != expected:
        return StageResult(NAME, FAIL, f"measured {len(pairs)} of {expected} rank pairs", details)
    worst_lat = max(pairs, key=lambda x: x["latency_us"])
    worst_bw = min(pairs, key=lambda x: x["bandwidth_gbs"])
    bd = "all bd pairs on one node" if not cross else f"bd pairs across nodes: {', '.join(cross)}"
    summary = (f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, megatron-core {v['megatron-core']}, "
               f"TE {v['transformer-engine']}; {payloads[0]['device']}; P2P latency up to "
               f"{worst_lat['latency_us']:.0f} us ({worst_lat['ranks'][0]}-{worst_lat['ranks'][1]}), bandwidth down to "
               f"{worst_bw['bandwidth_gbs']:.2f} GB/s; {bd}")
    return StageResult(NAME, PASS, summary, details, numbers={"versions": v, "pairs": pairs, "hosts": hosts})
