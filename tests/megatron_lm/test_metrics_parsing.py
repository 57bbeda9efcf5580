"""The reading of Megatron's iteration lines that every ``pretrain_gpt.py`` equality test relies on
(``tests/megatron_lm_runs.py``): another rank's print on the end of a line is dropped, every field
of ``training_log`` is kept, and a metric that one run prints and the other does not fails. Pure
text: runs without a Megatron-LM checkout."""
import pytest

from megatron_lm_runs import assert_metrics_close, metrics

LINE = (" [2026-11-27 06:43:14.123456] iteration        {it}/       5 | consumed samples:           {samples} | "
        "elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-03 | global batch size:     8 | "
        "lm loss: {loss} | load_balancing_loss: 0.12 | loss scale: 1.0 | grad norm: 1.276 | num zeros: 32.0 | "
        "{norm}number of skipped iterations:   0 | number of nan iterations:   0 |")
NUMERICS = ["grad norm", "lm loss", "load_balancing_loss", "loss scale", "num zeros", "number of nan iterations",
            "number of skipped iterations", "params norm"]


def _line(it, loss="4.878543E+00", norm="params norm: 25.122 | "):
    return LINE.format(it=it, samples=8 * it, loss=loss, norm=norm)


def test_another_ranks_print_on_the_end_of_an_iteration_line_is_dropped():
    out = "\n".join([
        _line(1) + "Number of parameters in most loaded shard in billions: 0.0001",
        _line(2) + "[Rank 0] (after 2 iterations) memory (MB) | allocated: 1.5 | max allocated: 2.0 | reserved: 0.0",
        _line(3)])
    got = metrics(out)
    print(got)
    assert sorted(got) == [1, 2, 3]
    for it in got:
        assert sorted(got[it]) == NUMERICS, got[it]
    assert got[2]["number of skipped iterations"] == "0" and got[2]["params norm"] == "25.122"


def test_a_metric_only_one_run_prints_fails():
    ref = metrics("\n".join(_line(i) for i in (1, 2)))
    without_norm = metrics("\n".join([_line(1), _line(2, norm="")]))
    assert_metrics_close(ref, ref, "itself")
    for got, want in ((without_norm, ref), (ref, without_norm)):
        with pytest.raises(AssertionError, match="iteration 2: printed by the reference only"):
            assert_metrics_close(got, want, "params norm missing at iteration 2")


def test_a_difference_beyond_the_print_fails():
    ref = metrics(_line(1))
    with pytest.raises(AssertionError, match="lm loss"):
        assert_metrics_close(metrics(_line(1, loss="4.878600E+00")), ref, "lm loss off by 1.2e-5")


def test_metric_names_with_digits_are_kept():
    """Multi-token prediction prints ``mtp_1 loss``, ``mtp_2 loss``: digits in a name (dropped before,
    so no MTP loss was compared)."""
    got = metrics(_line(1, norm="mtp_1 loss: 4.876717E+00 | mtp_2 loss: 4.850022E+00 | params norm: 25.122 | "))
    assert got[1]["mtp_1 loss"] == "4.876717E+00" and got[1]["mtp_2 loss"] == "4.850022E+00", got[1]
