"""One torchrun worker of ``test_launch_placement.py``: what ``launcher.main`` does with
``--pair-placement`` (``placement.apply_from_launcher``), then gloo initialised with the
rewritten ``RANK`` as Megatron does, and every rank's (slot, rank, LOCAL_RANK, GROUP_RANK)
gathered; global rank 0 writes them to the JSON file named by argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_dualpipe.launch import placement as launch_placement

if __name__ == "__main__":
    out, script_args = sys.argv[1], sys.argv[2:]
    before = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")}
    launch_placement.apply_from_launcher(script_args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # Megatron passes rank=args.rank (RANK)
    mine = torch.tensor([int(before["RANK"]), rank, dist.get_rank(), int(os.environ["LOCAL_RANK"]),
                         int(before["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        keys = ("slot", "rank", "dist_rank", "local_rank", "local_rank_before", "group_rank")
        with open(out, "w") as f:
            json.dump([dict(zip(keys, t.tolist())) for t in every], f)
    dist.destroy_process_group()
