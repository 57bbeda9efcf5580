"""The tests, laid out by the package's layers, one folder and one marker each.

=================  ============  =====================================================================
folder             marker        what it needs, how long it takes
=================  ============  =====================================================================
tests/schedule     schedule      the standard library only: seconds
tests/executor     executor      torch, gloo processes on plain torch modules (no megatron-core)
tests/bench        bench         the ``bench`` and ``trace`` commands on synthetic stages (gloo)
tests/cli          cli           the commands, pictures, docs and scripts (subprocesses)
tests/mcore        mcore         megatron-core in gloo processes, against single-process references
tests/cpu          cpu           the CPU mode of megatron-core (and of Megatron-LM with its checkout)
tests/megatron_lm  megatron_lm   Megatron-LM's pretrain_gpt.py (``MEGATRON_LM_PATH``): minutes per test
tests/apps         apps          the main job and the selftest end to end
tests/bridge       bridge        Megatron-Bridge's own pretrain() (skipped without Megatron-Bridge)
=================  ============  =====================================================================

``slow`` marks the folders that start megatron-core or Megatron-LM processes (mcore, cpu,
megatron_lm, apps). One tier: ``pytest tests/schedule`` (or ``scripts/run_tests.sh -m schedule``);
the quick tiers: ``pytest -m "not slow" tests``; the development loop, every layer in under 2 minutes:
``-m quick`` (:data:`QUICK`).

Also makes ``tests/harness`` importable as ``harness`` (and ``megatron_lm_runs``) from every
folder, whatever pytest's import mode.
"""
import os
import signal
import sys
import warnings

import pytest

# The Ctrl-C tests send SIGINT to the commands they start. A shell that starts a job in the
# background (``bash .ci/run &``) starts it with SIGINT ignored, which every process below inherits
# and Python then keeps: those commands would never see the Ctrl-C. A handler (unlike "ignored")
# is reset to the default in the processes the tests start, so this gives them a normal SIGINT.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

#: folder under tests/ -> (marker, description); the folder's tests carry the marker.
LAYERS = {
    "schedule": "the schedule layer: standard library only, seconds",
    "executor": "the executor on plain torch modules (gloo processes, no megatron-core)",
    "bench": "the bench and trace commands on synthetic stages",
    "cli": "the commands, pictures, docs and scripts",
    "mcore": "megatron-core in gloo processes",
    "cpu": "the CPU mode",
    "megatron_lm": "Megatron-LM's pretrain_gpt.py (needs MEGATRON_LM_PATH)",
    "apps": "the main job and the selftest end to end",
    "bridge": "Megatron-Bridge's pretrain() under DualPipe (needs Megatron-Bridge 0.3.x or 0.6.x: docs/megatron-bridge.md)",
}
#: Folders whose tests start megatron-core or Megatron-LM processes.
SLOW = ("mcore", "cpu", "megatron_lm", "apps", "bridge")
#: The order the folders run in, the longest first (seconds of test time in .ci/run's newest tier):
#: with ``--dist loadfile`` (scripts/run_tests.sh: a worker per core, with --no-loadscope-reorder so that xdist
#: keeps this order instead of putting the files with the most tests first) a worker takes the next
#: file when it is done with its own, and the quick files fill the end instead of one long
#: pretrain_gpt.py file keeping one worker busy while the other waits. mcore and bridge first: in the
#: oldest tier (-m smoke) their files are the three longest (89, 82 and 66 s) and the short Megatron-LM
#: files then fill the end (225 s of wall time for 343 s of test time before); in the newest tier the
#: Bridge files skip at once and mcore's are as long as a Megatron-LM file.
RUN_ORDER = ("mcore", "bridge", "megatron_lm", "apps", "cli", "schedule", "executor", "cpu", "bench")
assert sorted(RUN_ORDER) == sorted(LAYERS)
#: The development loop (``scripts/run_tests.sh -m quick``, under 2 minutes): the schedule layer whole
#: and, from every other layer, a test that drives it end to end (test ids, or their beginnings).
QUICK = {
    "schedule": ("tests/schedule/",),
    "executor": ("tests/executor/test_runner_toy.py::test_forward_only_runs_every_forward",
                 "tests/executor/test_runner_toy.py::test_fused_units_go_through_forward_backward"),
    "bench": ("tests/bench/test_launch.py::",),
    "cli": ("tests/cli/test_cli.py::test_simulate_costs_and_text", "tests/cli/test_advise.py::test_cli_table_and_json",
            "tests/cli/test_launch_validation.py::test_the_config_as_is_passes_megatrons_and_the_plugins_validation",
            "tests/cli/test_launch_validation.py::test_an_appended_mistake_is_one_line_naming_the_flag[--use-torch-fsdp2]"),
    "mcore": ("tests/mcore/test_dualpipe_megatron.py::test_dualpipe_equals_single_process[False-2]",
              "tests/mcore/test_dualpipe_megatron.py::test_dualpipev_equals_single_process[2]"),
    "cpu": ("tests/cpu/test_cpu_mode.py::test_dense_gpt_forward_backward_single_process",),
    "megatron_lm": ("tests/megatron_lm/test_megatron_lm_dualpipe.py::"
                    "test_dualpipe_and_megatron_1f1b_equal_on_the_users_architecture",),
    "apps": ("tests/apps/test_main_job.py::test_bad_arguments_give_one_usage_before_any_process_starts",
             "tests/apps/test_selftest.py::test_bad_settings_are_one_line_before_anything_starts"),
    "bridge": ("tests/bridge/test_bridge_checkpoint.py::"
               "test_a_recipe_dualpipe_cannot_run_is_refused_in_one_line_naming_each_field",),
}
assert sorted(QUICK) == sorted(LAYERS)
#: Outside CI's time budget (issue 27: 20 minutes on 2 cores; .ci/run selects ``not extended``): each is
#: a second proof of a path a CI test proves, a proof of the tests' own launcher, or a variant of a
#: command CI runs once. ``scripts/run_tests.sh`` (the README's command) runs them; docs/benchmarks.md
#: has the dated full runs. Test ids (or their beginnings) -> why.
EXTENDED = {
    "tests/megatron_lm/test_megatron_lm_options.py::test_rank_killed_mid_iteration":
        "8 fresh torchrun interpreters (95 s); a dead peer named: mcore/test_errors, resumes: the checkpoint tests",
    "tests/megatron_lm/test_preloaded_launch.py::test_preloaded_ranks_print_what_torchruns_print":
        "the tests' launcher against torchrun's fresh interpreters (34-62 s); no product code",
    "tests/megatron_lm/test_preloaded_launch.py::test_the_interpreters_whole_exit_when_asked":
        "the tests' launcher",
    "tests/megatron_lm/test_preloaded_launch.py::test_rank_0_hosting_the_store_ends_with_the_whole_exit":
        "the tests' launcher",
    "tests/megatron_lm/test_dataset_helpers.py::test_an_up_to_date_helper_is_not_rebuilt_and_a_stale_one_is":
        "a second g++ build; the helper built once by jobs starting together stays",
    "tests/mcore/test_dualpipe_megatron.py::test_overlap_param_gather_pp2_dp2_starts_every_gather_before_its_chunks_"
    "first_forward[dualpipev]": "the dualpipe case (the same gathers, one chunk order apart)",
    "tests/mcore/test_step_collectives_megatron.py::test_the_params_norms_all_reduces_are_the_plans[expert-mp-group-apart]":
        "the dense case; the expert groups' reductions: the MoE equality tests' params norms",
    "tests/mcore/test_dualpipe_megatron.py::test_users_architecture_equals_single_process":
        "the users' architecture against Megatron's 1F1B: test_megatron_lm_dualpipe.py (both tiers)",
    "tests/mcore/test_dualpipe_megatron.py::test_moe_with_aux_loss_equals_single_process":
        "MoE with aux loss against Megatron's 1F1B: test_megatron_lm_options.py and the TE matrix",
    "tests/mcore/test_dualpipe_megatron.py::test_dualpipe_equals_single_process[False-2]": "the pp=4 untied case",
    "tests/mcore/test_dualpipe_megatron.py::test_overlap_grad_reduce_pp2_dp2_ddp_equals_single_process[dualpipe]":
        "the dualpipev case; dualpipe's overlapped reduction: test_megatron_lm_cpu.py",
    "tests/megatron_lm/test_megatron_lm_dualpipe.py::test_uneven_stages_equal_megatron_1f1b[embedding and loss":
        "dualpipev's case of the same split",
    "tests/megatron_lm/test_megatron_lm_cpu.py::test_dualpipev_distributed_optimizer_overlap_equals_dualpipev_alone":
        "dualpipev's overlapped distributed optimizer: the bf16 torch_dist test of test_megatron_lm_dualpipev.py",
    "tests/megatron_lm/test_megatron_lm_mtp.py::test_one_chunk_executor_schedules_mtp_equal_megatron_1f1b":
        "the one-chunk executor schedules: test_megatron_lm_dualpipe.py's; MTP: the two-chunk ones'",
    "tests/megatron_lm/test_megatron_lm_mtp.py::test_dualpipe_mtp_with_sharded_copies_equal_megatron_1f1b":
        "the shared shard group and dp-first: test_megatron_lm_cpu.py's; MTP: the other MTP tests'",
    "tests/megatron_lm/test_megatron_lm_cpu.py::test_bf16":
        "bf16: the dualpipev bf16 and the TE bf16 (DeepEP) cases",
    "tests/apps/test_selftest.py::test_quick_cpu_run_with_transformer_engine_layers_passes":
        "the TE matrix: test_megatron_lm_te.py; the selftest end to end: its quick run",
    "tests/apps/test_interrupts.py::test_main_job_interrupted_stops_every_rank_in_one_line[drawing]":
        "the interrupt during training and in its set-up stay",
    "tests/cli/test_draw.py::test_large_schedules_draw_a_bounded_window_with_a_note[dualpipe-8-8192]":
        "the bounded window: the dualpipe pp=64 case",
    "tests/cli/test_draw.py::test_large_schedules_draw_a_bounded_window_with_a_note[zb-h1-64-256]": "as above",
    "tests/cli/test_draw.py::test_large_schedules_draw_a_bounded_window_with_a_note[1f1b-64-256]": "as above",
    "tests/cli/test_pictures.py::test_time_axis_tick_labels_do_not_run_together[1f1b-64-256]":
        "the dualpipe pp=64 case",
    "tests/cli/test_scripts.py::test_slurm_example_gives_each_node_its_rank_and_the_first_node_as_master[submitted from":
        "the DUALPIPE_DIR case",
    "tests/cli/test_scripts.py::test_the_sizes_named_for_the_gpus_given_run_on_them[env2]": "the env1 case",
    "tests/megatron_lm/test_megatron_lm_dualpipe.py::test_evaluation_losses_equal_and_advice_logged_once":
        "evaluation: the dualpipev evaluation test and Bridge's; the advice once: mcore/test_live_advice",
    "tests/megatron_lm/test_megatron_lm_dualpipev.py::test_dualpipev_moe_expert_parallel_bf16":
        "dualpipev with EP 2 in bf16: the TE matrix's DeepEP case",
    "tests/bridge/test_bridge.py::test_dualpipe_and_dualpipev_log_what_bridges_1f1b_logs_untied":
        "pp=4: the checkpoint chain's legs (tied); untied: Megatron-LM's tests",
    "tests/bridge/test_bridge.py::test_tensor_parallel_with_sequence_parallelism":
        "TP 2 with sequence parallelism: Megatron-LM's tests; Bridge's plumbing: the MoE case's (EP)",
}


def pytest_configure(config):
    if not hasattr(config, "workerinput") and "MEGATRON_DUALPIPE_TEST_RUNS" not in os.environ:
        # pretrain_gpt.py runs shared by pytest-xdist's workers (tests/megatron_lm_runs.py); the
        # workers start after this and inherit the variable.
        import tempfile

        config._shared_runs = tempfile.mkdtemp(prefix="megatron-dualpipe-runs-")
        os.environ["MEGATRON_DUALPIPE_TEST_RUNS"] = config._shared_runs
    for name, what in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: tests/{name}: {what}")
    config.addinivalue_line("markers", f"slow: starts megatron-core or Megatron-LM processes ({', '.join(SLOW)})")
    config.addinivalue_line("markers", "quick: the development loop: every layer in under 2 minutes (tests/conftest.py QUICK)")
    config.addinivalue_line("markers", "extended: outside CI's time budget, run by scripts/run_tests.sh (tests/conftest.py "
                                       "EXTENDED)")
    config.addinivalue_line(
        "markers", "smoke: the subset .ci/run also runs on the oldest supported Megatron (megatron-core 0.16.1, "
                   "Megatron-LM core_v0.16.1); the whole suite runs on the newest")


#: Every test's limit (pytest-timeout), unless ``--timeout`` or the ini's says otherwise: above each
#: test's own deadlines (a job past its own timeout prints every rank's stacks, which CI's summary
#: shortens), so that a wait without one still ends, and CI's summary names it HUNG with its frames
#: instead of the whole run stopping silently.
TEST_TIMEOUT_S = 900


def _default_timeout(config):
    given = config.getoption("timeout", None) if config.pluginmanager.hasplugin("timeout") else "none"
    return None if given is not None or config.getini("timeout") else pytest.mark.timeout(TEST_TIMEOUT_S)


def pytest_collection_modifyitems(config, items):
    astray = set()
    order = {}
    limit = _default_timeout(config)
    for item in items:
        if limit is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(limit)
        rel = os.path.relpath(str(item.path), _HERE).split(os.sep)
        layer = rel[0] if len(rel) > 1 and rel[0] in LAYERS else None
        order[item.nodeid] = RUN_ORDER.index(layer) if layer else len(RUN_ORDER)
        if layer is None:
            astray.add(os.path.join(*rel))
            continue
        item.add_marker(getattr(pytest.mark, layer))
        if item.nodeid.startswith(QUICK[layer]):
            item.add_marker(pytest.mark.quick)
        if item.nodeid.startswith(tuple(EXTENDED)):
            item.add_marker(pytest.mark.extended)
        if layer in SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: order[item.nodeid])  # stable: a file's tests keep their order
    files = {item.nodeid.split("::")[0] for item in items}
    for key in EXTENDED:  # a renamed test would silently come back into CI's time
        if key.split("::")[0] in files and not any(item.nodeid.startswith(key) for item in items):
            warnings.warn(pytest.PytestWarning(f"tests/conftest.py EXTENDED names no test: {key}"))
    for path in sorted(astray):  # no layer marker: `-m LAYER` misses it
        warnings.warn(pytest.PytestWarning(f"tests/{path} is in no layer folder: move it to one of "
                                           f"tests/{{{','.join(LAYERS)}}} (tests/conftest.py)"))


def pytest_unconfigure(config):
    folder = getattr(config, "_shared_runs", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("MEGATRON_DUALPIPE_TEST_RUNS", None)
