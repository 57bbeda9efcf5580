"""Megatron's dataset C++ helper, built by jobs that start together from one checkout: built once,
renamed into place, so that no rank imports a library another job's linker is still writing (a
fresh checkout's first two runs in CI: one rank failed, "MockGPTDataset failed to build")."""
import multiprocessing
import os
import shutil
import time

import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, MEGATRON_LM_PATH, SKIP_MESSAGE

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)
JOBS = 3


def _job(datasets_dir, start_at, queue):
    """One job's rank 0: build at the same moment as the others, then import what is in place."""
    import importlib.util

    from megatron_dualpipe.megatron_lm import dataset_helpers

    time.sleep(max(0.0, start_at - time.time()))
    outcome = dataset_helpers.build(datasets_dir)
    spec = importlib.util.spec_from_file_location("helpers_cpp", dataset_helpers.library_path(datasets_dir))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    queue.put((outcome, hasattr(module, "build_blending_indices")))


def _watch(path, stop, queue):
    """Every size the library had while the jobs ran: one, if it only ever appeared whole."""
    sizes = set()
    while not os.path.exists(stop):
        try:
            sizes.add(os.stat(path).st_size)
        except FileNotFoundError:
            pass
        time.sleep(0.0005)  # the linker writes for tens of milliseconds: still seen, without a core of its own
    queue.put(sorted(sizes))


@pytest.fixture(scope="module")
def built_together(tmp_path_factory):
    """A copy of the checkout's helper source, built by JOBS jobs at once, a watcher beside them."""
    from megatron_dualpipe.megatron_lm import dataset_helpers

    datasets_dir = tmp_path_factory.mktemp("datasets")
    for name in ("Makefile", "helpers.cpp"):
        shutil.copy2(os.path.join(MEGATRON_LM_PATH, "megatron", "core", "datasets", name), datasets_dir / name)
    ctx = multiprocessing.get_context("spawn")
    results, seen, stop = ctx.SimpleQueue(), ctx.SimpleQueue(), str(datasets_dir.parent / "stop")
    watcher = ctx.Process(target=_watch, args=(dataset_helpers.library_path(str(datasets_dir)), stop, seen))
    watcher.start()
    start_at = time.time() + 3.0  # after every interpreter has started
    t0 = time.monotonic()
    jobs = [ctx.Process(target=_job, args=(str(datasets_dir), start_at, results)) for _ in range(JOBS)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=300)
    open(stop, "w").close()
    watcher.join(timeout=30)
    outcomes = [results.get() for _ in range(sum(job.exitcode == 0 for job in jobs))]
    print(f"\n{JOBS} jobs in {time.monotonic() - t0:.1f} s: (outcome, imported whole) {outcomes}; "
          f"exit codes {[job.exitcode for job in jobs]}")
    return datasets_dir, [job.exitcode for job in jobs], outcomes, seen.get()


def test_jobs_starting_together_build_the_helper_once_and_import_it_whole(built_together):
    from megatron_dualpipe.megatron_lm import dataset_helpers as dh

    datasets_dir, codes, outcomes, sizes = built_together
    left = sorted(os.listdir(datasets_dir))
    print(f"the library's sizes while they ran: {sizes}; the folder: {left}")
    assert codes == [0] * JOBS and all(whole for _, whole in outcomes)
    assert sorted(o for o, _ in outcomes) == sorted([dh.BUILT] + [dh.UP_TO_DATE] * (JOBS - 1))  # linked once
    assert len(sizes) == 1  # never seen half-written
    assert left == sorted(["Makefile", "helpers.cpp", os.path.basename(dh.library_path(str(datasets_dir)))])


def test_an_up_to_date_helper_is_not_rebuilt_and_a_stale_one_is(built_together):
    from megatron_dualpipe.megatron_lm import dataset_helpers as dh

    datasets_dir = str(built_together[0])
    library = dh.library_path(datasets_dir)
    assert dh.build(datasets_dir) == dh.UP_TO_DATE
    older = os.path.getmtime(os.path.join(datasets_dir, "helpers.cpp")) - 10
    os.utime(library, (older, older))  # the source changed after the library was built
    outcome = dh.build(datasets_dir)
    print(f"\n{os.path.basename(library)} older than helpers.cpp: {outcome}")
    assert outcome == dh.BUILT and os.path.getmtime(library) > older + 10
