"""Bring every direction's loss entries to the last pipeline rank, where Megatron's training loop reads them.

DualPipe's direction 1 and all of DualPipeV end on rank 0. Each transfer is an op of the rank's program (``loss
D -> P`` / ``loss D <- P``): a header of keys, shapes and dtypes (its length, then its pickled bytes), then the
tensors in one batched P2P, on their device. Every wait has a deadline and checks the abort signal, naming both
ranks and what was awaited; on an accelerator the receiver polls ``is_completed()`` before the host reads the
header, so the deadline holds there too.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, List

import torch
import torch.distributed as dist

from ..executor import abort
from ..executor.streams import waits_order_stream
from ..schedule.layout import Layout


class LossGatherTimeoutError(RuntimeError):
    """The loss gather did not complete within its deadline."""


def send_losses(entries, rank: int, peer: int, global_ranks, group, device, timeout_s: float) -> None:
    """A direction's loss entries to pipeline rank ``peer`` (the program's ``loss D -> P`` op)."""
    _send_entries(entries, _Peer(rank, peer, global_ranks[peer], group, timeout_s), device)


def receive_losses(rank: int, peer: int, global_ranks, group, device, timeout_s: float) -> list:
    """A direction's loss entries from pipeline rank ``peer`` (the program's ``loss D <- P`` op)."""
    return _recv_entries(_Peer(rank, peer, global_ranks[peer], group, timeout_s), device)


def losses_on_last_rank(loss_store, layout: Layout, rank: int, received: dict) -> List[Any]:
    """Every direction's loss entries, in direction order, on rank pp-1 (``[]`` elsewhere): its own, and those
    the program's ``loss`` ops received ({direction: entries})."""
    if rank != layout.pp - 1:
        return []
    # the directions whose last stage ends the model (not DualPipeV's first chunk: its micro-batches go on up the V)
    ends = [(d, layout.stages(d)[-1]) for d in layout.directions if layout.is_last(d, layout.stages(d)[-1])]
    return [e for d, final in ends for e in (loss_store[d] if layout.rank_of(d, final) == rank else received[d])]


#: What megatron-core's ``MTPLossLoggingHelper`` tracker sums per MTP layer over an iteration: the
#: losses under "values" at 0.16.1; losses, correct and total predictions at 0.19.
MTP_TRACKER_KEYS = ("values", "loss_values", "correct_values", "total_values")


def send_mtp_tracker(rank: int, peer: int, global_ranks, group, device, timeout_s: float) -> None:
    """Add what the MTP loss tracker summed here to rank ``peer``'s (pp-1) and zero it here (counted once
    whatever the log interval). Megatron-LM prints ``mtp_1 loss`` from the last pipeline rank's
    ``MTPLossLoggingHelper.tracker``, and DualPipe (direction 1) and DualPipeV compute MTP on rank 0."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = {k: tracker[k] for k in MTP_TRACKER_KEYS if k in tracker}
    _send_entries([values], _Peer(rank, peer, global_ranks[peer], group, timeout_s), device)
    for v in values.values():
        v.zero_()


def receive_mtp_tracker(rank: int, peer: int, global_ranks, group, device, timeout_s: float) -> None:
    """The other end of :func:`send_mtp_tracker`; the tracker gets the data-parallel group to average over
    (DualPipeV's rank pp-1 computes no MTP, so nothing set it)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    (got,) = _recv_entries(_Peer(rank, peer, global_ranks[peer], group, timeout_s), device)
    for k, v in got.items():
        tracker[k] = tracker[k] + v if k in tracker else v.clone()
    if got and tracker.get("avg_group") is None:
        tracker["avg_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)


def _header(entries) -> list:
    head = []
    for e in entries:
        if isinstance(e, dict) and all(isinstance(v, torch.Tensor) for v in e.values()):
            head.append(("dict", [(k, tuple(v.shape), v.dtype) for k, v in e.items()]))
        elif isinstance(e, torch.Tensor):
            head.append(("tensor", [(None, tuple(e.shape), e.dtype)]))
        else:
            head.append(("object", e))
    return head


class _Peer:
    """The other end of one loss-gather transfer, and the waits on it."""

    def __init__(self, rank: int, peer: int, global_peer: int, group, timeout_s: float):
        self.rank, self.peer, self.global_peer, self.group, self.timeout_s = rank, peer, global_peer, group, timeout_s

    def exchange(self, op, tensors, what: str, host_reads: bool = False) -> None:
        """One batched P2P of ``tensors`` with the peer, waited with a deadline. ``host_reads``: the host reads
        the result next (on an accelerator: poll until complete, then wait)."""
        if not tensors:
            return
        works = dist.batch_isend_irecv([dist.P2POp(op, t, self.global_peer, self.group) for t in tensors])
        waiting = (f"pipeline rank {self.rank} (global {dist.get_rank()}) in the loss gather: the "
                   f"{'send of' if op is dist.isend else 'receive of'} {what} "
                   f"{'to' if op is dist.isend else 'from'} pipeline rank {self.peer} (global {self.global_peer})")
        stream = waits_order_stream(tensors[0])
        for w in works:
            start = time.monotonic()
            while stream and host_reads and not w.is_completed():
                abort.raise_if_failed(waiting)
                if time.monotonic() - start > self.timeout_s:
                    raise LossGatherTimeoutError(f"{waiting}: did not complete within {self.timeout_s:g} s")
                time.sleep(0.01)
            abort.wait_work(w, self.timeout_s, waiting, LossGatherTimeoutError, on_host=not stream)


def _send_entries(entries, peer: _Peer, device) -> None:
    head = torch.frombuffer(bytearray(pickle.dumps(_header(entries))), dtype=torch.uint8).to(device)
    peer.exchange(dist.isend, [torch.tensor([head.numel()], dtype=torch.int64, device=device)], "the header's length")
    peer.exchange(dist.isend, [head], "the header")
    tensors = [t.detach().contiguous() for e in entries
               for t in (e.values() if isinstance(e, dict) else [e]) if isinstance(t, torch.Tensor)]
    peer.exchange(dist.isend, tensors, f"{len(tensors)} loss tensors")


def _recv_entries(peer: _Peer, device) -> List[Any]:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    peer.exchange(dist.irecv, [size], "the header's length", host_reads=True)
    head_bytes = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    peer.exchange(dist.irecv, [head_bytes], "the header", host_reads=True)
    head = pickle.loads(bytes(head_bytes.cpu().tolist()))
    bufs = [torch.empty(shape, dtype=dtype, device=device) for kind, spec in head if kind != "object"
            for _, shape, dtype in spec]
    peer.exchange(dist.irecv, bufs, f"{len(bufs)} loss tensors")
    out, it = [], iter(bufs)
    for kind, spec in head:
        if kind == "dict":
            out.append({k: next(it) for k, _, _ in spec})
        elif kind == "tensor":
            out.append(next(it))
        else:
            out.append(spec)
    return out

