"""Bad inputs fail fast and clearly; a stuck peer produces a timeout, never a silent hang.

* Configuration errors: `forward_backward_dualpipe` is called on ONE rank of a 2-rank (or
  3-rank) pipeline while the other ranks do nothing, with every torch.distributed
  communication function wrapped by a counter. Each bad call must raise `DualPipeConfigError`
  at once, with the counter still 0, and its message must name the fix.
* Shapes that change between micro-batches: the executor passes tensors of one shape
  (seq_length x micro_batch_size x hidden). A forward producing another shape raises a clear
  ValueError on its own rank; its peers stop within seconds (the shared abort signal) with
  `PeerFailedError` naming themselves, what they waited for and the failing rank.
* A stalled peer: one rank never enters the schedule; the other raises `P2PTimeoutError` after
  `p2p_timeout` seconds, naming its pipeline rank, the peer and what it waited for.
* A bd partner that fails between the structure check and the copy of the weights (a third rank
  failed meanwhile; seen in the selftest's last stage under load): the other partner, already in
  the broadcast, stops through the abort signal within seconds, naming what it copied.

Workers catch the errors and return them as data; a stalled rank waits for a flag file with
its own deadline, and `run_workers` terminates anything left, so no test can hang the suite.
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models
from megatron_dualpipe.proof.data import forward_step
from megatron_dualpipe.proof.nohang import attempt, peers_stopped

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

LAYERS = 2
SPEC = models.ModelSpec(layers=LAYERS)
SEQ, MBS, HIDDEN = SPEC.seq, SPEC.mbs, SPEC.hidden
TIMEOUT_S = 3.0  # p2p_timeout of the timeout tests

# Every torch.distributed function that communicates (or creates groups, which does).
COMM_FUNCS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "all_reduce", "reduce",
    "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter", "send_object_list",
    "recv_object_list", "broadcast_object_list", "all_gather_object", "gather_object", "new_group",
    "new_subgroups",
)


class CommCounter:
    """Wraps the communication functions of torch.distributed and counts their calls."""

    def __init__(self):
        self.calls = []
        self.saved = {}

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        # Patch both namespaces: P2POp checks `op in (c10d.isend, c10d.irecv)`, and c10d's own
        # functions call each other through its globals.
        for name in COMM_FUNCS:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None:
                continue

            def wrapped(*a, __name=name, __fn=fn, **k):
                self.calls.append(__name)
                return __fn(*a, **k)

            for mod in (dist, c10d):
                if getattr(mod, name, None) is fn:
                    self.saved[(mod, name)] = fn
                    setattr(mod, name, wrapped)
        return self

    def __exit__(self, *exc):
        for (mod, name), fn in self.saved.items():
            setattr(mod, name, fn)
        return False


# ---------------------------------------------------------------------------------------------
# 1. Configuration errors, before any communication
# ---------------------------------------------------------------------------------------------

class Chunk(torch.nn.Module):
    """A stand-in model chunk: validation reads only its `config`."""

    def __init__(self, ddp_config=None, **config_attrs):
        super().__init__()
        self.config = models.config_of(SPEC)
        if ddp_config is not None:  # as megatron-core's DistributedDataParallel holds it
            self.ddp_config = ddp_config
        for k, v in config_attrs.items():  # set afterwards: TransformerConfig checks some combinations
            setattr(self.config, k, v)
        self.w = torch.nn.Parameter(torch.zeros(1))


def _fail_fn(*a, **k):
    raise AssertionError("forward_step_func must not run for a bad configuration")


def _bad_calls(pp):
    """(case, kwargs for forward_backward_dualpipe, setup, teardown) for a pipeline of size pp."""
    from megatron.core import parallel_state as ps

    def call(model=None, **kw):
        base = dict(forward_step_func=_fail_fn, data_iterator=iter([]), model=model or [Chunk(), Chunk()],
                    num_microbatches=2 * pp, seq_length=SEQ, micro_batch_size=MBS, schedule="dualpipe",
                    p2p_timeout=TIMEOUT_S)
        base.update(kw)
        return base

    from megatron.core.distributed import DistributedDataParallelConfig

    partial = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                            num_distributed_optimizer_instances=2)
    vp = (lambda: ps.set_virtual_pipeline_model_parallel_world_size(2),
          lambda: ps.set_virtual_pipeline_model_parallel_world_size(None))
    if pp % 2:
        return [("odd_pipeline_size", call(), None, None)]  # otherwise valid
    return [
        ("virtual_pipeline", call(), *vp),
        ("too_few_microbatches", call(num_microbatches=pp - 1), None, None),
        ("zero_microbatches", call(num_microbatches=0), None, None),
        ("adjust_tensor_shapes_fn", call(adjust_tensor_shapes_fn=lambda *a: a), None, None),
        ("variable_seq_lengths", call(model=[Chunk(variable_seq_lengths=True), Chunk(variable_seq_lengths=True)]),
         None, None),
        ("overlap_p2p_comm", call(model=[Chunk(overlap_p2p_comm=True), Chunk(overlap_p2p_comm=True)]), None, None),
        ("fp8_delayed_recipe", call(model=[Chunk(fp8="e4m3", fp8_recipe="delayed"),
                                           Chunk(fp8="e4m3", fp8_recipe="delayed")]), None, None),
        ("partial_recompute_per_microbatch", call(model=[Chunk(num_microbatches_with_partial_activation_checkpoints=1),
                                                         Chunk(num_microbatches_with_partial_activation_checkpoints=1)]),
         None, None),
        ("one_chunk_for_dualpipe", call(model=[Chunk()]), None, None),
        ("three_chunks_for_dualpipev", call(model=[Chunk(), Chunk(), Chunk()], schedule="dualpipev"), None, None),
        ("two_chunks_for_zb_h1", call(schedule="zb-h1"), None, None),
        ("p2p_communicator", call(p2p_communicator=object()), None, None),
        ("te_biases_deferred", call(model=[Chunk(delay_wgrad_compute=True, add_bias_linear=True),
                                           Chunk(delay_wgrad_compute=True, add_bias_linear=True)]), None, None),
        # a megatron-core API caller: the DDP config, not Megatron-LM's args (issue 35, finding 6)
        ("partial_distributed_optimizer_with_overlap", call(model=[Chunk(ddp_config=partial), Chunk(ddp_config=partial)]),
         None, None),
        ("data_iterator_list", call(data_iterator=[iter([]), iter([])]), None, None),
        # TE's backward_dw assigns param.grad: without DDP's hooks a micro-batch's would replace the last one's
        ("te_deferral_without_ddp_hooks", call(model=[_te_deferring(), _te_deferring()]), None, None),
    ]


def _te_deferring():
    """A chunk built with delay_wgrad_compute whose weight a Transformer Engine module defers (TE marks
    such parameters), not in megatron DDP."""
    chunk = Chunk(delay_wgrad_compute=True, add_bias_linear=False)
    chunk.w.skip_backward_post_hook = True
    return chunk


def _try(fn):
    """Run fn; return (exception type name, message, seconds, communication calls)."""
    with CommCounter() as counter:
        t0 = time.monotonic()
        try:
            fn()
            err = (None, None)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            err = (type(e).__name__, str(e))
        elapsed = time.monotonic() - t0
    return err[0], err[1], elapsed, list(counter.calls)


def _config_errors_worker(rank, world, port, caller):
    """Only rank `caller` makes the bad calls; the others wait at the final barrier."""
    import torch.distributed as dist
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe, get_forward_backward_func

    me.init_distributed_cpu(rank, world, port, pp=world, timeout_minutes=1)
    try:
        out = {}
        if rank == caller:
            for name, kwargs, setup, teardown in _bad_calls(world):
                if setup:
                    setup()
                try:
                    out[name] = _try(lambda: forward_backward_dualpipe(**kwargs))
                finally:
                    if teardown:
                        teardown()
            if world == 2:
                out["unknown_schedule"] = _try(lambda: get_forward_backward_func("dual-pipe"))
                # The valid names are accepted (returning a function communicates nothing).
                for name in ("1f1b", "dualpipe", "dualpipev", "executor-1f1b", "zb-h1"):
                    assert callable(get_forward_backward_func(name))
        dist.barrier()  # every rank arrives here: nothing was left half-sent
        return out
    finally:
        me.destroy_distributed()


# case -> substrings the message must contain (what is wrong, and the fix)
EXPECTED = {
    "odd_pipeline_size": ["even pipeline size", "got 3", "--pipeline-model-parallel-size", "dualpipev"],
    "virtual_pipeline": ["virtual pipeline", "--num-layers-per-virtual-pipeline-stage"],
    "too_few_microbatches": ["at least 2 micro-batches", "pp=2", "got 1", "--global-batch-size to at least 2"],
    "zero_microbatches": ["at least one micro-batch", "got 0"],
    "adjust_tensor_shapes_fn": ["adjust_tensor_shapes_fn"],
    "variable_seq_lengths": ["variable_seq_lengths", "turn off", "seq_length x micro_batch_size"],
    "overlap_p2p_comm": ["--overlap-p2p-communication", "turn off"],
    "fp8_delayed_recipe": ["--fp8-recipe delayed", "amax history", "use --fp8-recipe tensorwise"],
    "partial_recompute_per_microbatch": ["num_microbatches_with_partial_activation_checkpoints", "set it to None"],
    "one_chunk_for_dualpipe": ["2 model chunks", "got 1", "build_two_direction_model"],
    "three_chunks_for_dualpipev": ["2 model chunks", "got 3", "build_two_direction_model"],
    "two_chunks_for_zb_h1": ["one model chunk", "got 2"],
    "p2p_communicator": ["p2p_communicator"],
    "te_biases_deferred": ["--add-bias-linear", "B, B, W, W", "add --disable-bias-linear"],
    "partial_distributed_optimizer_with_overlap": ["--num-distributed-optimizer-instances", "6.0 and 6.5",
                                                   "num_distributed_optimizer_instances", "remove --overlap-grad-reduce"],
    "data_iterator_list": ["one data iterator", "list of 2"],
    "te_deferral_without_ddp_hooks": ["delay_wgrad_compute", "assigns each weight gradient",
                                      "DistributedDataParallelConfig(delay_wgrad_compute=True)"],
    "unknown_schedule": ["'dual-pipe'", "1f1b, executor-1f1b, zb-h1, dualpipe, dualpipev"],
}
# A fix is named: an imperative after a colon ("...: remove --x", "...: raise --y", ...).
FIX = re.compile(r":\s*(?:[^:]*\b)?(remove|turn off|raise|set|change|use|build|choose|pass|run)\b", re.I)


@pytest.fixture(scope="module")
def config_errors():
    t0 = time.monotonic()
    [two, _] = me.run_workers(_config_errors_worker, 2, args=(0,), timeout=60)
    t1 = time.monotonic()
    # pp=3 (odd): the middle rank alone calls dualpipe.
    [_, three, _] = me.run_workers(_config_errors_worker, 3, args=(1,), timeout=60)
    print(f"\nconfig-error workers: pp=2 {t1 - t0:.1f} s, pp=3 {time.monotonic() - t1:.1f} s")
    return {**two, **three}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_config_error_is_immediate_and_names_the_fix(config_errors, case):
    kind, msg, elapsed, comm = config_errors[case]
    print(f"\n{case} ({elapsed * 1e3:.1f} ms, {len(comm)} communication calls): {kind}: {msg}")
    assert kind == "DualPipeConfigError", f"{case}: {kind}: {msg}"
    assert comm == [], f"{case}: communicated before failing: {comm}"
    assert elapsed < 20, f"{case}: took {elapsed:.1f} s (the group's timeout: 60 s)"  # no wait on a peer
    for part in EXPECTED[case]:
        assert part in msg, f"{case}: {part!r} not in {msg!r}"
    assert FIX.search(msg), f"{case}: the message names no fix: {msg!r}"


# ---------------------------------------------------------------------------------------------
# Shared by the runtime tests: a real 2-rank DualPipe of tiny GPTModels
# ---------------------------------------------------------------------------------------------

def _build(layers=LAYERS):
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model

    build_bd_groups()
    spec = models.ModelSpec(layers=layers)
    model = build_two_direction_model(models.provider(spec), layout_kind="bidirectional")
    for chunk in model:
        chunk.config.finalize_model_grads_func = lambda *a, **k: None
    return model


def _wait_for(path, deadline_s):
    end = time.monotonic() + deadline_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)
    return os.path.exists(path)


def _flag(path):
    with open(path, "w") as f:
        f.write("done")


def _run(model, batches, m, p2p_timeout=TIMEOUT_S):
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe

    return forward_backward_dualpipe(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                                     num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, schedule="dualpipe",
                                     p2p_timeout=p2p_timeout)


# ---------------------------------------------------------------------------------------------
# 2. A micro-batch of another shape
# ---------------------------------------------------------------------------------------------

def _shape_worker(rank, world, port, flag_dir, peers_wait_s):
    """Global micro-batch 1 (direction 0's second) is short: rank 0's forward F0.1 makes an
    activation of the wrong shape. Rank 0 waits until its peers have reported before it exits,
    so that they see its abort signal rather than a closed connection. Returns how the rank
    stopped (:class:`megatron_dualpipe.proof.nohang.Stop`)."""
    me.init_distributed_cpu(rank, world, port, pp=world, timeout_minutes=1)
    model = _build(layers=world)
    m = 2 * world
    stop = attempt(lambda: _run(model, SPEC.batches(m, short={1}), m, p2p_timeout=peers_wait_s))
    _flag(os.path.join(flag_dir, f"rank{rank}"))
    for r in range(world):
        _wait_for(os.path.join(flag_dir, f"rank{r}"), 30)
    return stop  # no destroy: a half-completed P2P batch leaves the gloo group unusable


@pytest.mark.parametrize("world", [2, 4])
def test_microbatch_of_another_shape_stops_every_peer_within_seconds(tmp_path, world):
    """Rank 0 raises a ValueError naming the fix; every peer stops waiting for it within seconds
    (the shared abort signal), not after its P2P deadline (set to 120 s here, 600 s by default),
    with a PeerFailedError naming itself, what it waited for and rank 0's error."""
    wait_s = 120.0
    t0 = time.monotonic()
    stops = me.run_workers(_shape_worker, world, args=(str(tmp_path), wait_s), timeout=wait_s)
    print(f"\nworkers {time.monotonic() - t0:.1f} s")
    for r, stop in enumerate(stops):
        print(f"rank {r} after {stop.seconds:.2f} s: {(stop.error or 'finished')[:400]}")
    failed = stops[0]
    assert failed.kind == "ValueError", failed
    for part in ("pipeline rank 0", "action F0.1", "micro-batch 1 of direction 0", f"shape {(SEQ - 4, MBS, HIDDEN)}",
                 f"shape {(SEQ, MBS, HIDDEN)}", "all micro-batches must have seq_length x micro_batch_size",
                 "--seq-length/--micro-batch-size or pad the data"):
        assert part in failed.error, f"{part!r} not in {failed.error!r}"
    for r, stop in enumerate(stops[1:], start=1):
        assert stop.kind == "PeerFailedError", (r, stop)
        for part in (f"pipeline rank {r}", "stopped waiting because global rank 0 failed: ValueError",
                     "action F0.1"):
            assert part in stop.error, f"rank {r}: {part!r} not in {stop.error!r}"
        assert "receive of" in stop.error or "send of" in stop.error, stop.error  # what it waited for, from whom
    last = max(stop.at - failed.at for stop in stops[1:])
    print(f"pp={world}: from rank 0's exception to the last peer's named error: {last:.2f} s "
          f"(their P2P deadline: {wait_s:g} s)")
    problems = peers_stopped(dict(enumerate(stops)), 0, wait_s / 4, failed_at=failed.at)
    assert not problems, problems


# ---------------------------------------------------------------------------------------------
# 3. A stalled peer
# ---------------------------------------------------------------------------------------------

def _stall_worker(rank, world, port, flag_dir, joins_first_collective=True):
    """Rank 1 builds its model and then never runs the schedule's P2P (with
    ``joins_first_collective`` it takes part in the executor's first all-reduce on the pipeline
    group, then stalls): it waits for rank 0's flag (at most 30 s) and exits. Rank 0 runs the
    schedule with p2p_timeout=TIMEOUT_S."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    me.init_distributed_cpu(rank, world, port, pp=world, timeout_minutes=1)
    model = _build()
    if rank == 1:
        if joins_first_collective:
            dist.all_reduce(torch.zeros(1), group=parallel_state.get_pipeline_model_parallel_group())
        return ("stalled", _wait_for(os.path.join(flag_dir, "rank0"), 30))
    with CommCounter() as counter:
        t0 = time.monotonic()
        try:
            _run(model, SPEC.batches(2 * world), 2 * world)
            result = (None, None, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001
            result = (type(e).__name__, str(e), time.monotonic() - t0)
    _flag(os.path.join(flag_dir, "rank0"))
    return result + (len(counter.calls),)


def test_stalled_peer_times_out_with_a_clear_message(tmp_path):
    from megatron_dualpipe.schedule.comm import describe
    from megatron_dualpipe.schedule.lowering.program import build_program

    t0 = time.monotonic()
    r0, r1 = me.run_workers(_stall_worker, 2, args=(str(tmp_path),), timeout=60)
    print(f"\nworkers {time.monotonic() - t0:.1f} s")
    kind, msg, elapsed, ncomm = r0
    print(f"rank 0 after {elapsed:.2f} s (p2p_timeout {TIMEOUT_S:g} s, {ncomm} communication calls): {kind}: {msg}")
    assert r1 == ("stalled", True), r1  # the stalled rank was released and exited by itself
    assert kind == "P2PTimeoutError", r0
    assert ncomm > 0  # the counter does see the executor's communication
    # Rank 0's first batch: send direction 0's activation, receive direction 1's, from rank 1.
    first = build_program("dualpipe", 2, 4).plans[0].batches[0]
    assert first.recvs and all(t.peer == 1 for t in first.recvs)
    for part in (["pipeline rank 0 (global 0)", f"within {TIMEOUT_S:g} s", "MEGATRON_DUALPIPE_P2P_TIMEOUT"]
                 + [f"receive of {describe(t.label)} from pipeline rank 1" for t in first.recvs]
                 + [f"send of {describe(t.label)} to pipeline rank 1" for t in first.sends]):
        assert part in msg, f"{part!r} not in {msg!r}"
    # gloo's Work.wait(timeout) honours the timeout: the error comes after ~TIMEOUT_S (plus the
    # first forwards), not after the process group's own 1-minute timeout.
    assert TIMEOUT_S - 0.1 <= elapsed < TIMEOUT_S + 10, f"timed out after {elapsed:.2f} s"


def test_peer_that_never_enters_the_schedule_times_out_in_the_first_collective(tmp_path):
    r0, r1 = me.run_workers(_stall_worker, 2, args=(str(tmp_path), False), timeout=60)
    kind, msg, elapsed, _ = r0
    print(f"\nrank 0 after {elapsed:.2f} s: {kind}: {msg}")
    assert r1 == ("stalled", True), r1
    assert kind == "P2PTimeoutError", r0
    for part in ("pipeline rank 0 (global 0) before its first point-to-point batch",
                 "all-reduce on the pipeline group (global ranks [0, 1])", "has not entered the schedule"):
        assert part in msg, f"{part!r} not in {msg!r}"
    assert elapsed < TIMEOUT_S + 10, f"timed out after {elapsed:.2f} s"


def _partner_leaves_worker(rank, world, port, flag_dir):
    """pp=2, one bd pair, the process group's timeout 1 minute. Rank 1 passes the structure check
    of the first stage with rank 0, then fails just before joining the broadcast of its weights
    (its ``dist.broadcast`` signals the abort and raises), as a partner does whose layout wait saw
    a third rank's failure after publishing its own layout. It stays alive until rank 0 has
    reported, so that rank 0 sees the abort signal, not a closed connection."""
    import torch.distributed as dist

    from megatron_dualpipe.executor import abort

    me.init_distributed_cpu(rank, world, port, pp=world, timeout_minutes=1)
    if rank == 1:
        def leave(*a, **k):
            abort.signal("RuntimeError: rank 1 left before the broadcast")
            raise RuntimeError("rank 1 left before the broadcast")

        dist.broadcast = leave
    t0 = time.monotonic()
    try:
        _build(layers=world)
        result = (None, None, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        result = (type(e).__name__, str(e), time.monotonic() - t0)
    if rank == 0:
        _flag(os.path.join(flag_dir, "rank0"))
    else:
        _wait_for(os.path.join(flag_dir, "rank0"), 90)
    return result


def test_partner_failing_before_the_weight_broadcast_stops_the_other_within_seconds(tmp_path):
    """Before the broadcast waited the way the executor waits, rank 0 sat in it for the process
    group's whole timeout (an hour in the selftest) and then blamed gloo."""
    r0, r1 = me.run_workers(_partner_leaves_worker, 2, args=(str(tmp_path),), timeout=100)
    for r, (kind, msg, elapsed) in enumerate((r0, r1)):
        print(f"\nrank {r} after {elapsed:.2f} s: {kind}: {msg}")
    assert r1[0] == "RuntimeError" and "left before the broadcast" in r1[1], r1
    kind, msg, elapsed = r0
    assert kind == "PeerFailedError", r0
    for part in ("global rank 0 in the broadcast of the", "stage 0 from global rank 0 to global rank 1",
                 "stopped waiting because global rank 1 failed"):
        assert part in msg, f"{part!r} not in {msg!r}"
    assert elapsed < 20, f"rank 0 took {elapsed:.1f} s to stop (the group's timeout is 60 s)"


def _dead_peer_worker(rank, world, port):
    """Plain gloo, no megatron: rank 1 exits 0.5 s after joining; rank 0 waits for a tensor
    from it with a 20 s timeout."""
    import datetime

    import torch.distributed as dist
    from megatron_dualpipe.executor.p2p import P2P

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        time.sleep(0.5)
        return "exited"  # the process ends without sending: its sockets close
    p2p = P2P(dist.group.WORLD, [0, 1], 0, timeout_s=20, describe=lambda l: f"activation of micro-batch {l[2]}")
    t0 = time.monotonic()
    try:
        label = ("act", 0, 0, 1)
        p2p.post([], [(1, torch.empty(4), label)], "before action 0 (F0.0)")
        p2p.receive(label, "before action 0 (F0.0)")
        return None, None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - t0


def test_dead_peer_is_reported_as_a_failure_not_a_timeout():
    r0, r1 = me.run_workers(_dead_peer_worker, 2, timeout=40, preimport=())
    kind, msg, elapsed = r0
    print(f"\nrank 0 after {elapsed:.2f} s (p2p_timeout 20 s): {kind}: {msg}")
    assert r1 == "exited"
    assert kind == "P2PTimeoutError", r0
    assert elapsed < 15, f"a dead peer took {elapsed:.1f} s to notice"
    for part in ("pipeline rank 0 (global 0) before action 0 (F0.0)", "before the 20 s timeout",
                 "a peer probably exited or crashed", "receive of activation of micro-batch 0 from pipeline rank 1"):
        assert part in msg, f"{part!r} not in {msg!r}"
