"""A TCP port for a job's rendezvous on this machine, picked below the kernel's ephemeral range:
every outgoing connection draws from that range, and one took the port between the check and rank
0's listen once (EADDRINUSE in CI, 2026-11-27). Below it only explicit binds compete."""
from __future__ import annotations

import random
import socket

#: The lowest port picked; the highest is just below the ephemeral range.
LOWEST = 20000


def _ephemeral_start(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, below the ephemeral range where it leaves any."""
    pick = random.SystemRandom()
    end = _ephemeral_start()
    for _ in range(100 if end > LOWEST else 0):
        port = pick.randrange(LOWEST, end)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
