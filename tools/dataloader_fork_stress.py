"""Issue 27's hang, one suspect tested: do data-loader workers forked from a rank whose gloo group is
live and whose other threads run (a store waiter like the abort listener, a P2P ping-pong with the
peer) ever fail to answer? Megatron's way: 3 loaders of 2 persistent workers each, per iteration of
this loop. A worker that never answers shows as the loader's own timeout, counted and printed.

    python tools/dataloader_fork_stress.py [ITERATIONS]   # 2 ranks; 6 forks per rank per iteration

2026-11-27, this 2-core machine, megatron-core 0.19.2 imported: 1500 iterations, 9000 forks per rank,
0 stuck, 689 s (docs/benchmarks.md, "CI after the GPU check").
"""
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"tokens": torch.arange(65, dtype=torch.int64) + i}


def _ping_pong(peer: int, stop: threading.Event) -> None:
    t = torch.zeros(64)
    while not stop.is_set():
        first, second = (dist.send, dist.recv) if dist.get_rank() == 0 else (dist.recv, dist.send)
        first(t, peer)
        second(t, peer)


def _rank(rank: int, world: int, iterations: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        import megatron.core  # noqa: F401  (a rank's size and threads, roughly)
    except ImportError:
        pass
    store = dist.distributed_c10d._get_default_store()
    threading.Thread(target=store.get, args=("never",), daemon=True).start()
    stop = threading.Event()
    threading.Thread(target=_ping_pong, args=(1 - rank, stop), daemon=True).start()
    stuck, start = 0, time.time()
    for it in range(iterations):
        loaders = [torch.utils.data.DataLoader(Tokens(), batch_size=2, num_workers=2, persistent_workers=True,
                                               pin_memory=True, timeout=20) for _ in range(3)]
        for loader in loaders:
            try:
                next(iter(loader))
            except RuntimeError as e:  # "DataLoader timed out after 20 seconds"
                stuck += 1
                print(f"rank {rank} iteration {it}: {e}", flush=True)
        del loaders
        if it % 100 == 0 or it == iterations - 1:
            print(f"rank {rank}: {it + 1} iterations, {6 * (it + 1)} forks, {stuck} stuck, "
                  f"{time.time() - start:.0f} s", flush=True)
    stop.set()
    os._exit(0)


if __name__ == "__main__":
    mp.start_processes(_rank, args=(2, int(sys.argv[1]) if len(sys.argv) > 1 else 300, 29671), nprocs=2,
                       start_method="fork")
