"""Pure generators: (layout, M, rank) -> the ordered actions of one pipeline rank.

Which schedule uses which generator, and the rules on pp and M, are in :mod:`.registry`.
DualPipe and DualPipeV share :func:`dualpipe_rank`, DeepSeek's reference ``step()`` loop by loop
(the ``# Step k`` headers are the reference's); they differ in four numbers and in how the
reference's "phase" maps to a direction (:class:`_Recorder`).
"""
from __future__ import annotations

from collections import deque
from typing import List

from .actions import B, BW, F, W, Action
from .layout import Layout

# -- 1F1B and ZB-H1 ---------------------------------------------------------------------------

def one_f_one_b_rank(layout: Layout, m: int, rank: int, zero_bubble: bool = False) -> List[Action]:
    """Megatron's non-interleaved 1F1B; with ``zero_bubble``, ZB-H1.

    Warm-up runs pp-1-rank forwards; the steady state alternates F and backward; the cool-down
    runs the remaining backwards. ZB-H1 splits each backward into B and W and lets rank r keep
    r weight gradients pending, so the last ranks fill their cool-down idle time with W
    (the Zero Bubble paper's handcrafted ZB-H1, same peak activations as 1F1B).
    """
    stage = rank
    warmup = min(layout.pp - 1 - rank, m)
    acts: List[Action] = [Action(F, 0, i, stage) for i in range(warmup)]
    pending_w: deque = deque()
    bwd_op = B if zero_bubble else BW

    def backward(i: int) -> None:
        acts.append(Action(bwd_op, 0, i, stage))
        if zero_bubble:
            pending_w.append(i)
            if len(pending_w) > rank:
                acts.append(Action(W, 0, pending_w.popleft(), stage))

    for i in range(m - warmup):
        acts.append(Action(F, 0, warmup + i, stage))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    while pending_w:
        acts.append(Action(W, 0, pending_w.popleft(), stage))
    return acts


# -- Megatron's interleaved 1F1B (virtual pipeline) -------------------------------------------

def interleaved_1f1b_rank(layout: Layout, m: int, rank: int, overlap: bool = False) -> List[Action]:
    """Megatron's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``) on ``rank``.

    Its schedule table: micro-batches in groups of pp (``microbatch_group_size_per_vp_stage``), every
    chunk running the whole group before the next chunk starts it. The k-th forward runs the table's
    k-th (micro-batch, chunk), the k-th backward that micro-batch in chunk chunks-1-c: 2(pp-1-rank) +
    (chunks-1) x pp warm-up forwards, steady F/B steps, the remaining backwards. With ``overlap``
    (``--overlap-moe-expert-parallel-comm``) every steady step is one fused F&B unit, after one more
    warm-up forward (so that every fused step's forward and backward are independent).
    """
    pp, v = layout.pp, layout.chunks
    table = [(mb, c) for first in range(0, m, pp) for c in range(v) for mb in range(first, min(first + pp, m))]
    total = len(table)
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp + int(overlap), total)

    def forward(k: int, fused: bool = False) -> Action:
        mb, c = table[k]
        return Action(F, c, mb, c * pp + rank, fused)

    def backward(k: int) -> Action:
        mb, c = table[k]
        c = v - 1 - c
        return Action(BW, c, mb, c * pp + rank)

    acts = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        acts.append(forward(k + warmup, overlap))
        acts.append(backward(k))
    acts.extend(backward(k) for k in range(total - warmup, total))
    return acts


# -- DualPipe and DualPipeV -------------------------------------------------------------------

class _Recorder:
    """Records the reference's compute calls as actions: phase p of a rank in DualPipe's second
    half is direction 1-p (``phase ^= is_in_second_half``), in DualPipeV the direction; micro-batches
    are numbered per direction as met, deferred weight gradients popped first-in first-out (the
    reference's WeightGradStore)."""

    def __init__(self, layout: Layout, rank: int, flip: bool):
        self.layout, self.rank, self.flip = layout, rank, int(flip)
        self.acts: List[Action] = []
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.deferred: deque = deque()

    def forward(self, phase: int, overlap: bool = False) -> None:
        d = phase ^ self.flip
        self.acts.append(Action(F, d, self.next_f[d], self.layout.stage_on(self.rank, d), overlap))
        self.next_f[d] += 1

    def backward(self, phase: int, zero_bubble: bool = False) -> None:
        d = phase ^ self.flip
        a = Action(B if zero_bubble else BW, d, self.next_b[d], self.layout.stage_on(self.rank, d))
        self.next_b[d] += 1
        self.acts.append(a)
        if zero_bubble:
            self.deferred.append(a)

    def forward_backward(self, phase_f: int, phase_b: int) -> None:
        self.forward(phase_f, overlap=True)
        self.backward(phase_b)

    def weight(self) -> None:
        b = self.deferred.popleft()
        self.acts.append(Action(W, b.dir, b.mb, b.stage))


def _dualpipe_steps(rec: _Recorder, n: int, r: int, per_direction: int, middle: bool) -> None:
    """DeepSeek's ``step()``: ``n`` ranks per half, half-rank ``r``, ``per_direction``
    micro-batches per direction (the reference calls them "chunks").

    For DualPipe n = pp/2, r = min(rank, pp-1-rank), per_direction = M/2 and ``middle`` is a
    rank next to the fold; for DualPipeV n = pp, r = rank, per_direction = M and ``middle`` is
    the last rank.
    """
    # Step 1: nF0
    for _ in range((n - r - 1) * 2):
        rec.forward(0)
    # Step 2: nF0F1
    for _ in range(r + 1):
        rec.forward(0)
        rec.forward(1)
    # Step 3: nB1W1F1 (Use zero bubble)
    for _ in range(n - r - 1):
        rec.backward(1, zero_bubble=True)
        rec.weight()
        rec.forward(1)
    # Step 4 (Main step): nF0B1F1B0
    for i in range(per_direction - 2 * n + r + 1):
        if i == 0 and middle:
            # The reference does not overlap these two, to shorten the bubble at the fold.
            rec.forward(0)
            rec.backward(1)
        else:
            rec.forward_backward(0, 1)
        rec.forward_backward(1, 0)
    # Step 5: nB1F1B0
    for _ in range(n - r - 1):
        rec.backward(1)
        rec.forward_backward(1, 0)
    # Step 6: nB1B0 (The second half of the chunks use zero bubble)
    steps = r + 1
    zero_bubble = False
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zero_bubble = True
        rec.backward(1, zero_bubble)
        if i == steps // 2 and r % 2 == 0:
            zero_bubble = True
        rec.backward(0, zero_bubble)
    # Step 7: nWB0 (Use zero bubble)
    for _ in range(n - r - 1):
        rec.weight()
        rec.backward(0, zero_bubble=True)
    # Step 8: nW
    for _ in range(r + 1):
        rec.weight()
    assert not rec.deferred, "every deferred weight gradient must have run"


def dualpipe_rank(layout: Layout, m: int, rank: int) -> List[Action]:
    half = layout.mirrored and layout.pp // 2
    n, r = (half, min(rank, layout.partner(rank))) if half else (layout.pp, rank)
    rec = _Recorder(layout, rank, flip=bool(half) and rank >= half)
    _dualpipe_steps(rec, n, r, m // 2 if half else m, middle=(r == n - 1))
    return rec.acts

