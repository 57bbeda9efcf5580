"""`mcore/data.py` without processes: lazy in-order reading, the split of the global batch
between the directions, and the padding to a schedule's micro-batch count."""
import pytest

from megatron_dualpipe.mcore.data import MicrobatchSource
from megatron_dualpipe.schedule.registry import get


def split_microbatches(schedule, m):
    return get(schedule).split(m)


def global_index(schedule, m, d, mb):
    return get(schedule).global_index(m, d, mb)


def padded_microbatches(schedule, pp, m, forward_only=False):
    return get(schedule).padded_microbatches(pp, m, forward_only)


class CountingIterator:
    """Yields 0, 1, 2, ... and records every `next` call."""

    def __init__(self, n):
        self.n, self.calls = n, []

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.calls) == self.n:
            raise StopIteration
        self.calls.append(len(self.calls))
        return {"sample": self.calls[-1]}


def test_source_reads_lazily_in_order_each_item_once():
    it = CountingIterator(10)
    src = MicrobatchSource(it)
    assert it.calls == [] and src.reads == 0  # nothing read up front
    assert next(src.view(2))["sample"] == 2  # asking for 2 reads 0, 1, 2 in order, no further
    assert it.calls == [0, 1, 2] and src.reads == 3
    assert next(src.view(0))["sample"] == 0  # buffered: no new read
    assert next(src.view(2))["sample"] == 2
    assert it.calls == [0, 1, 2]
    assert next(src.view(3))["sample"] == 3
    assert it.calls == [0, 1, 2, 3] and src.reads == 4
    # Any order of requests reads the underlying iterator once per item, in order.
    for g in (7, 5, 6, 4):
        assert next(src.view(g))["sample"] == g
    assert it.calls == list(range(8))


def test_view_yields_its_microbatch_once():
    src = MicrobatchSource(iter(["a", "b"]))
    view = src.view(1)
    assert iter(view) is view
    assert next(view) == "b"
    with pytest.raises(StopIteration):
        next(view)
    assert src.reads == 2


def test_source_without_data():
    assert MicrobatchSource(None).view(0) is None  # middle stages: forward_step gets None


def test_source_past_the_end_raises_stop_iteration():
    src = MicrobatchSource(iter([1]))
    with pytest.raises(StopIteration):
        src.get(1)


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "1f1b", "executor-1f1b", "zb-h1"])
@pytest.mark.parametrize("m", range(1, 14))
def test_split_and_global_index_cover_every_microbatch_once(schedule, m):
    per_dir = split_microbatches(schedule, m)
    assert sum(per_dir) == m
    seen = [global_index(schedule, m, d, mb) for d, n in enumerate(per_dir) for mb in range(n)]
    assert sorted(seen) == list(range(m)), (schedule, m, per_dir, seen)
    if schedule == "dualpipe":
        # Direction 0 takes the first ceil(M/2) micro-batches, direction 1 the rest, in order.
        assert per_dir == [(m + 1) // 2, m // 2]
        assert seen == list(range(m))
    else:
        assert per_dir == [m]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_padded_microbatches_dualpipev(pp):
    for m in range(pp, 2 * pp):  # [pp, 2pp): padded up to 2pp
        assert padded_microbatches("dualpipev", pp, m) == 2 * pp
    for m in range(2 * pp, 4 * pp + 2):  # enough: no padding, odd or even
        assert padded_microbatches("dualpipev", pp, m) == m


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_padded_microbatches_dualpipe(pp):
    for m in range(pp, 2 * pp):
        assert padded_microbatches("dualpipe", pp, m) == 2 * pp
    for m in range(2 * pp, 4 * pp + 2):
        padded = padded_microbatches("dualpipe", pp, m)
        assert padded == (m + 1 if m % 2 else m)  # odd M: one fake micro-batch
    for m in range(pp, 4 * pp + 2):
        # Both directions run padded/2; the real ones fit into that.
        padded = padded_microbatches("dualpipe", pp, m)
        assert padded % 2 == 0 and padded >= 2 * pp
        assert all(n <= padded // 2 for n in split_microbatches("dualpipe", m))


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("pp", [2, 4])
def test_too_few_microbatches_names_the_smallest_m(schedule, pp):
    for m in range(0, pp):
        with pytest.raises(ValueError) as e:
            padded_microbatches(schedule, pp, m)
        msg = str(e.value)
        print(f"\n{schedule} pp={pp} M={m}: {msg}")
        assert f"at least {pp} micro-batches" in msg and f"got {m}" in msg
        assert "--global-batch-size" in msg  # the fix
    # Evaluation (forward only) pads freely.
    for m in range(1, pp):
        assert padded_microbatches(schedule, pp, m, forward_only=True) == 2 * pp


@pytest.mark.parametrize("schedule", ["1f1b", "executor-1f1b", "zb-h1"])
def test_single_direction_schedules_are_not_padded(schedule):
    for m in range(1, 9):
        assert padded_microbatches(schedule, 4, m) == m
