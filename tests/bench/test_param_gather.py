"""bench --param-gather-mb: two replicas of a pp=2 pipeline on synthetic stages, each chunk's
parameters all-gathered over the replicas. The three ways issue the gathers where they say: none
at all; at each chunk's first forward, waited at once (DDP's pre-hook alone); every chunk's before
the first action in the order of the first forwards, each waited at its chunk's first forward
(param_sync_func on the executor). The figures are printed; timings are not asserted (a loaded
machine), the order of the events is."""
from megatron_dualpipe.bench import launch, param_gather
from megatron_dualpipe.bench.measure import BenchConfig
from megatron_dualpipe.bench.synthetic import StageCosts


def test_the_three_ways_gather_where_they_say():
    cfg = BenchConfig(schedules=("dualpipe", "executor-1f1b"), microbatches={2: (4,)}, costs=StageCosts(4, 8, 4),
                      iters=2, warmup=0, param_gather_mb=0.5)
    ranks = launch.spawn(param_gather.worker, 4, (cfg,), timeout_s=300)
    rows = param_gather.summary(ranks, 2)
    print("\n" + param_gather.table(rows, cfg.param_gather_mb))
    assert [(r["schedule"], r["m"]) for r in rows] == [("dualpipe", 4), ("executor-1f1b", 4)]
    for rank, result in enumerate(ranks):
        for (name, _), run in result["runs"].items():
            logs = {mode: run[mode]["log"] for mode in param_gather.MODES}
            print(f"rank {rank} {name}: {logs}")
            forwards = [c for what, c in logs[param_gather.NONE]]
            assert logs[param_gather.NONE] == [("forward", c) for c in forwards] and forwards
            assert logs[param_gather.PRE_HOOK] == [e for c in forwards for e in (("forward", c), ("start", c),
                                                                                    ("wait", c))]
            assert logs[param_gather.PARAM_SYNC] == [("start", c) for c in forwards] + [
                e for c in forwards for e in (("forward", c), ("wait", c))]
            assert all(len(run[mode]["wall_s"]) == 2 for mode in param_gather.MODES)
