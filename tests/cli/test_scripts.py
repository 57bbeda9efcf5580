"""The launch script composes the torchrun command and refuses bad set-ups before launching.

Runs `scripts/pretrain_gpt_dualpipe.sh` with DRY_RUN=1 against a stand-in Megatron-LM folder
(pretrain_gpt.py and megatron/core/package_info.py at 0.16.1) and a stand-in data prefix; every
config in configs/ must pass at the minimum GPU count it states, and each missing or wrong setting
must fail with one line naming the fix (never a bash error such as "unbound variable"). Where a
test needs only the composed command, the script launches for real, a stand-in torchrun that
records its arguments: the command printed is the one run, without DRY_RUN's `advise` (seconds per
run at a config's global batch; its output is checked by the DeepSeek-V3 dry run).
"""
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt_dualpipe.sh"
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.sh"))


def fake_checkout(root, version=(0, 16, 1)):
    (root / "megatron" / "core").mkdir(parents=True, exist_ok=True)
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\n".format(*version))
    (root / "pretrain_gpt.py").write_text("")
    return root


def min_gpus(config):
    """The minimum GPU count the config states in its comments."""
    return int(re.search(r"^# Minimum GPUs: (\d+)", (ROOT / "configs" / f"{config}.sh").read_text(), re.M).group(1))


def write_indexed(prefix, top_id):
    """A Megatron indexed dataset header (.idx: magic, version, dtype code 8 = uint16) and a .bin
    whose largest token id is ``top_id``."""
    import struct

    import numpy as np

    pathlib.Path(f"{prefix}.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, 8) + b"\x00" * 16)
    np.arange(top_id + 1, dtype=np.uint16).tofile(f"{prefix}.bin")


def run(tmp_path, tokenizer=True, extra=(), **env):
    fake = fake_checkout(tmp_path / "Megatron-LM")
    if not (tmp_path / "text_document.idx").exists():
        write_indexed(tmp_path / "text_document", 7)
    full = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "NNODES", "PP", "TP", "EP", "CP", "ETP", "TORCHRUN", "PYTHON",
                         "CUDA_DEVICE_MAX_CONNECTIONS")}
    full.update(DRY_RUN="1", MEGATRON_LM_PATH=str(fake), DATA_PATH=str(tmp_path / "text_document"),
                PYTHON=sys.executable)
    full.update({k: str(v) for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    args = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"] if tokenizer else []
    return subprocess.run(["bash", str(SCRIPT), *args, *extra, "--seed", "7"], env=full, capture_output=True,
                          text=True, timeout=60)


def stand_in_torchrun(tmp_path):
    """A torchrun on ``tmp_path/bin`` that appends its arguments (shell-quoted, one line per call) to
    ``tmp_path/torchrun-ran`` and exits 0."""
    path = tmp_path / "bin" / "torchrun"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/bash\n{{ printf '%q ' \"$@\"; echo; }} >> {shlex.quote(str(tmp_path / 'torchrun-ran'))}\n")
    path.chmod(0o755)
    return path


def torchrun_calls(tmp_path):
    """The argument lists the stand-in torchrun was called with, in order."""
    ran = tmp_path / "torchrun-ran"
    return [shlex.split(line) for line in ran.read_text().splitlines()] if ran.exists() else []


def test_configs_exist():
    assert {"gpt_tiny_cpu", "gpt_345m", "gpt_8b", "moe_mixtral_8x7b", "moe_deepseek_v2_lite"} <= set(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_config_says_which_tokenizer_to_pass(config):
    """A config either sets a tokenizer (and names the files it needs) or says which to pass."""
    text = (ROOT / "configs" / f"{config}.sh").read_text()
    line = re.search(r"^# Tokenizer: (.*)$", text, re.M)
    assert line and "--tokenizer" in text[line.start():line.start() + 300] or "--vocab-file" in line.group(1), config


def test_readme_states_each_configs_minimum():
    readme = (ROOT / "README.md").read_text()
    for config in CONFIGS:
        assert f"`{config}` ({min_gpus(config)}" in readme, config


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_every_config_is_accepted_at_its_minimum_and_composed(tmp_path, config, schedule):
    gpus = min(min_gpus(config), 8)
    nodes = min_gpus(config) // gpus
    torchrun = stand_in_torchrun(tmp_path)
    r = run(tmp_path, CONFIG=config, SCHEDULE=schedule, NNODES=nodes, GPUS_PER_NODE=gpus, MASTER_ADDR="node0",
            DRY_RUN=None, TORCHRUN=torchrun, MEMORY_CHECK=0)  # the memory gate: test_a_schedule_advise_says_...
    assert r.returncode == 0, r.stderr
    header, command = r.stdout.strip().splitlines()[-2:]
    print(f"\n{config} {schedule}: {header}")
    argv = shlex.split(command)
    assert argv[0] == str(torchrun) and torchrun_calls(tmp_path) == [argv[1:]]  # printed, then run as printed
    last_m = max(i for i, a in enumerate(argv) if a == "-m")  # after "python -m torch.distributed.run" if any
    assert argv[last_m + 1] == "megatron_dualpipe.launch"
    assert argv[argv.index("--pipeline-schedule") + 1] == schedule
    assert argv[argv.index("--nnodes") + 1] == str(nodes) and argv[-2:] == ["--seed", "7"]
    pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
    layers = int(argv[argv.index("--num-layers") + 1])
    first_last = "--decoder-first-pipeline-num-layers" in argv  # Megatron-LM's own check split them
    layout = argv[argv.index("--pipeline-model-parallel-layout") + 1] if "--pipeline-model-parallel-layout" in argv else ""
    assert first_last or layout or layers % (2 * pp if schedule == "dualpipev" else pp) == 0
    assert (schedule != "dualpipe" or pp % 2 == 0) and (schedule == "dualpipe" or not first_last)
    if layout and schedule == "dualpipev":  # 2pp V-stages of the model's layers (Megatron's layout syntax)
        from megatron_dualpipe.schedule import stage_layout
        stages = stage_layout.parse(layout)
        assert len(stages) == 2 * pp and sum(stage_layout.decoder_counts(stages)) == layers, layout
    assert f"(minimum {min_gpus(config)})" in header


@pytest.mark.parametrize("config", CONFIGS)
def test_below_the_stated_minimum_is_refused_naming_it(tmp_path, config):
    """Megatron refuses a world size that is not a multiple of TP*PP*CP and of ETP*EP*PP; so does the script."""
    least = min_gpus(config)
    gpus = least // 2
    r = run(tmp_path, CONFIG=config, NNODES=1, GPUS_PER_NODE=gpus)
    print(f"\n{config} on {gpus} GPUs: {r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert f"use {least} GPUs (NNODES=2 x GPUS_PER_NODE={gpus}: the nearest valid count" in r.stderr


#: A GPU count the launch script names, with the node layout (and the GLOBAL_BATCH) it names for it.
NAMED_COUNT = re.compile(r"(?:use|or) (\d+) GPUs \(NNODES=(\d+) x GPUS_PER_NODE=(\d+)[^)]*\)"
                         r"(?: with GLOBAL_BATCH=(\d+))?")


@pytest.mark.parametrize("env", [dict(CONFIG="gpt_8b", GPUS_PER_NODE=6, NNODES=2),
                                 dict(CONFIG="gpt_345m", GPUS_PER_NODE=6),
                                 dict(CONFIG="moe_deepseek_v2_lite", GPUS_PER_NODE=6, NNODES=3),
                                 dict(CONFIG="gpt_8b", GPUS_PER_NODE=12, NNODES=3)])
def test_every_gpu_count_named_is_whole_nodes_that_megatron_accepts(tmp_path, env):
    """Each GPU count a refusal names is NNODES x GPUS_PER_NODE as it says, and the launch with that
    NNODES and GPUS_PER_NODE (and the GLOBAL_BATCH it names where the batch would not split) passes
    (it used to name 16 GPUs for nodes of 6 beside 8 such nodes, and no batch)."""
    r = run(tmp_path, MASTER_ADDR="n0", **env)
    print(f"\n{env}: {r.stderr.strip()}")
    named = [m.groups() for m in NAMED_COUNT.finditer(r.stderr)]
    assert r.returncode == 2 and named, r.stderr
    torchrun = stand_in_torchrun(tmp_path)
    for count, nodes, per_node, batch in named:
        assert int(count) == int(nodes) * int(per_node)
        use = {"NNODES": nodes, "GPUS_PER_NODE": per_node, **({"GLOBAL_BATCH": batch} if batch else {})}
        again = run(tmp_path, MASTER_ADDR="n0", DRY_RUN=None, TORCHRUN=torchrun, **{**env, **use})
        print(f"  {use}: {again.stderr.strip() or 'accepted'}")
        assert again.returncode == 0, again.stderr


#: PP, TP (EP) and the GLOBAL_BATCH where one is named, as a refusal names them for the GPUs given.
NAMED_SIZES = re.compile(r"PP=(\d+) TP=(\d+)(?: EP=(\d+))?(?: with GLOBAL_BATCH=(\d+))?")
#: A Megatron-LM checkout to validate the named sizes with (Megatron's validate_args), where one is set.
REAL_MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH", "")


@pytest.mark.parametrize("env", [dict(CONFIG="gpt_8b"), dict(CONFIG="gpt_8b", SCHEDULE="dualpipev"),
                                 dict(CONFIG="moe_mixtral_8x7b"), dict(CONFIG="gpt_345m", GPUS_PER_NODE=6),
                                 dict(CONFIG="gpt_8b", GPUS_PER_NODE=6, NNODES=2, MASTER_ADDR="n0")])
def test_the_sizes_named_for_the_gpus_given_run_on_them(tmp_path, env):
    """gpt_8b on 1 node x 8 GPUs used to get "change PP, TP, EP, CP, ETP" and no values: the refusal
    names PP/TP (EP) that run on these GPUs, and the launch with them passes (Megatron-LM's own
    validation too, for dualpipev and the MoE config, where MEGATRON_LM_PATH names a checkout)."""
    r = run(tmp_path, **env)
    keep = r.stderr.partition("or keep ")[2]
    print(f"\n{env}: {r.stderr.strip()}")
    named = [m.groups() for m in NAMED_SIZES.finditer(keep)]
    assert r.returncode == 2 and named, r.stderr
    torchrun = stand_in_torchrun(tmp_path)
    # Megatron-LM's own validation (~7 s a launch) for the first size named for dualpipev and for the MoE
    # config; the dense dualpipe configs' sizes through the plugin's
    real = {"MEGATRON_LM_PATH": REAL_MEGATRON_LM} if os.path.isfile(os.path.join(REAL_MEGATRON_LM, "pretrain_gpt.py")) \
        and (env.get("SCHEDULE") == "dualpipev" or env["CONFIG"].startswith("moe_")) else {}
    for i, (pp, tp, ep, batch) in enumerate(named):
        use = {"PP": pp, "TP": tp, **({"EP": ep} if ep else {}), **({"GLOBAL_BATCH": batch} if batch else {})}
        # sizes Megatron accepts; whether they fit the GPUs' memory is the memory gate's (MEMORY_CHECK, below)
        again = run(tmp_path, DRY_RUN=None, TORCHRUN=torchrun, MEMORY_CHECK=0, **{**env, **use, **(real if i == 0 else {})})
        print(f"  {use}: {again.stderr.strip() or again.stdout.strip().splitlines()[-2]}")
        assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("env,expected", [
    (dict(MEGATRON_LM_PATH=None, CONFIG="gpt_345m"), "set MEGATRON_LM_PATH"),
    (dict(CONFIG=None), "set CONFIG to one of"),
    (dict(CONFIG="nope"), "no config nope"),
    (dict(CONFIG="gpt_345m", NNODES=2), "set MASTER_ADDR"),
    (dict(CONFIG="gpt_345m", PP=3, GPUS_PER_NODE=3), "even PP"),
    (dict(CONFIG="gpt_345m", SCHEDULE="dualpipev", PP=5, GPUS_PER_NODE=5), "divisible by 2*PP=10"),
    (dict(CONFIG="gpt_345m", GLOBAL_BATCH=8), "raise GLOBAL_BATCH to 32"),
    (dict(CONFIG="gpt_345m", GLOBAL_BATCH=100, MICRO_BATCH=3),
     "GLOBAL_BATCH=100 is not a multiple of MICRO_BATCH*DP=3*2=6: use GLOBAL_BATCH=96 (16 micro-batches) or 102"),
    (dict(CONFIG="gpt_345m", DATA_PATH=None), "set DATA_PATH"),
    (dict(CONFIG="gpt_345m", SCHEDULE="gpipe"), "use dualpipe, dualpipev, zb-h1, executor-1f1b or 1f1b"),
    (dict(CONFIG="gpt_345m", GPUS_PER_NODE=6), "multiple of TP*PP*CP=4 and of ETP*EP*PP=4, i.e. of 4: use 12 GPUs "
                                               "(NNODES=2 x GPUS_PER_NODE=6: the nearest valid count on nodes of 6 "
                                               "GPUs) with GLOBAL_BATCH=252, or 4 GPUs (NNODES=1 x GPUS_PER_NODE=4: 4 "
                                               "of each node's 6)"),
    (dict(CONFIG="moe_mixtral_8x7b"), "multiple of TP*PP*CP=8 and of ETP*EP*PP=64, i.e. of 64: use 64 GPUs "
                                      "(NNODES=8 x GPUS_PER_NODE=8: the nearest valid count"),
    (dict(CONFIG="moe_deepseek_v2_lite", GPUS_PER_NODE=8, NNODES=5, MASTER_ADDR="n0"),
     "use 32 GPUs (NNODES=4 x GPUS_PER_NODE=8: the nearest valid count"),
    (dict(CONFIG="moe_mixtral_8x7b", EP=3, PP=2, GPUS_PER_NODE=6), "EP=3 does not divide the config's 8 experts"),
    (dict(CONFIG="gpt_345m", DATA_PATH="/no/such/prefix"), "no /no/such/prefix.bin or /no/such/prefix.idx"),
    (dict(CONFIG="gpt_345m", PYTHON="/no/such/python"), "PYTHON=/no/such/python not found"),
    (dict(CONFIG="gpt_345m", PP=3), "dualpipe needs an even PP >= 2, got PP=3"),
    (dict(CONFIG="gpt_8b", GPUS_PER_NODE=6, NNODES=2, MASTER_ADDR="n0"),
     "use 48 GPUs (NNODES=8 x GPUS_PER_NODE=6: the nearest valid count on nodes of 6 GPUs)"),
    (dict(CONFIG="gpt_345m", MEGATRON_LM_PATH=""), "set MEGATRON_LM_PATH"),
    (dict(CONFIG=""), "set CONFIG to one of"),
    (dict(CONFIG="gpt_345m", DATA_PATH=""), "set DATA_PATH"),
])
def test_bad_setups_fail_early_with_the_fix(tmp_path, env, expected):
    """One line naming the fix, exit 2, before anything starts; never bash's own error."""
    r = run(tmp_path, **env)
    print(f"\n{env}: {r.stderr.strip()}")
    assert r.returncode == 2 and expected in r.stderr and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith("pretrain_gpt_dualpipe.sh: error: ") and "line " not in r.stderr


@pytest.mark.parametrize("what,expected", [
    ("empty .bin", ".bin is empty (0 bytes)"),
    ("empty .idx", ".idx is empty (0 bytes)"),
    ("no header", ".idx is not a Megatron indexed-dataset index"),
    ("empty tokenizer directory", "is an empty directory"),
    ("tokenizer directory without tokenizer files", "holds none of tokenizer.json"),
])
def test_data_and_tokenizer_that_cannot_load_are_refused(tmp_path, what, expected):
    """Files that exist but cannot load (an interrupted preprocessing, a tokenizer directory copied
    empty) are refused before torchrun, like missing ones."""
    write_indexed(tmp_path / "text_document", 7)
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    extra = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok)]
    if what.startswith("empty ."):
        (tmp_path / f"text_document{what[len('empty '):]}").write_bytes(b"")
        extra = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    elif what == "no header":
        (tmp_path / "text_document.idx").write_bytes(b"not an index")
        extra = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
    elif what.startswith("tokenizer directory"):
        (tok / "README.txt").write_text("the tokenizer was here")
    r = run(tmp_path, tokenizer=False, extra=extra, CONFIG="gpt_345m")
    print(f"\n{what}: {r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and expected in r.stderr


def test_cuda_device_max_connections_is_set_unless_given(tmp_path):
    """Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (before Blackwell): the script sets it,
    32 for the MoE all-to-all overlap without TP/CP, and keeps a value the user set."""
    for env, extra, want in ((dict(TP=2), (), "1"), (dict(CUDA_DEVICE_MAX_CONNECTIONS=8), (), "8"),
                             (dict(CONFIG="moe_mixtral_8x7b", GPUS_PER_NODE=8, NNODES=8, MASTER_ADDR="n0", TP=1),
                              ("--overlap-moe-expert-parallel-comm",), "32")):
        r = run(tmp_path, extra=extra, **{"CONFIG": "gpt_345m", **env})
        assert r.returncode == 0, r.stderr
        header = r.stdout.strip().splitlines()[-2]
        print(f"\n{env} {' '.join(extra)}: {header}")
        assert header.endswith(f"CUDA_DEVICE_MAX_CONNECTIONS={want}")


@pytest.mark.parametrize("var,value", [(v, x) for v in ("PP", "TP", "EP", "CP", "MICRO_BATCH", "GLOBAL_BATCH", "NNODES",
                                                         "GPUS_PER_NODE", "MASTER_PORT")
                                       for x in ("0", "abc", "-2", "1.5", "99999999999999999999")])
def test_numbers_must_be_positive_integers(tmp_path, var, value):
    r = run(tmp_path, CONFIG="gpt_345m", **{var: value})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and "must be a positive integer" in r.stderr, r.stderr
    for bash_error in ("unbound variable", "division by 0", "syntax error", "line "):
        assert bash_error not in r.stderr


@pytest.mark.parametrize("version", [(0, 15, 0), (0, 17, 1)])
def test_wrong_megatron_version_is_refused_before_torchrun(tmp_path, version):
    """An older checkout and one of the unsupported 0.17/0.18 in between get the same sentence as
    pip, the import check and the docs (versions.SUPPORTED_TEXT)."""
    from megatron_dualpipe import versions

    old = fake_checkout(tmp_path / "Megatron-LM-old", version=version)
    r = run(tmp_path, CONFIG="gpt_345m", MEGATRON_LM_PATH=str(old))
    print(f"\n{r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "is not a supported Megatron-LM checkout" in r.stderr and versions.SUPPORTED_TEXT in r.stderr
    assert f"(found megatron-core {'.'.join(map(str, version))})" in r.stderr


def test_blended_data_path_checks_every_prefix(tmp_path):
    r = run(tmp_path, CONFIG="gpt_345m", DATA_PATH=f"0.7 {tmp_path / 'text_document'} 0.3 {tmp_path / 'other'}")
    assert r.returncode == 2 and f"no {tmp_path / 'other'}.bin" in r.stderr
    write_indexed(tmp_path / "other", 7)
    r = run(tmp_path, CONFIG="gpt_345m", DATA_PATH=f"0.7 {tmp_path / 'text_document'} 0.3 {tmp_path / 'other'}")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip().splitlines()[-1])
    i = argv.index("--data-path")
    assert argv[i + 1:i + 5] == ["0.7", str(tmp_path / "text_document"), "0.3", str(tmp_path / "other")]


def test_appended_mock_data_needs_no_data_path(tmp_path):
    """``--mock-data`` appended to the command (not only in the config) means synthetic data: no
    DATA_PATH asked for, no --data-path passed (it used to be refused: "use a config with --mock-data")."""
    torchrun = stand_in_torchrun(tmp_path)
    r = run(tmp_path, extra=("--mock-data",), CONFIG="gpt_345m", DATA_PATH=None, DRY_RUN=None, TORCHRUN=torchrun)
    print(f"\n{r.stderr.strip() or r.stdout.strip().splitlines()[-2]}")
    assert r.returncode == 0, r.stderr
    argv = torchrun_calls(tmp_path)[0]
    assert "--mock-data" in argv and "--data-path" not in argv


# ---------------------------------------------------------------------------------------------
# Checked before torchrun (megatron_dualpipe/launch/checks.py through launch --check)
# ---------------------------------------------------------------------------------------------

def gpt2_files(tmp_path, entries):
    (tmp_path / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(entries)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return ["--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]


@pytest.mark.parametrize("config,extra,expected", [
    ("gpt_tiny_cpu", [], "no --tokenizer-type: Megatron-LM needs one"),
    ("gpt_345m", [], "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    ("gpt_345m", ["--vocab-file", "/no/vocab.json", "--merge-file", "/no/merges.txt"],
     "--vocab-file /no/vocab.json: no such file"),
    ("gpt_tiny_cpu", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "./no/such/dir"],
     "--tokenizer-model ./no/such/dir: no such file"),
])
def test_tokenizer_is_checked_before_torchrun(tmp_path, config, extra, expected):
    r = run(tmp_path, tokenizer=False, extra=extra, CONFIG=config)
    print(f"\n{config} {' '.join(extra)}: {r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and expected in r.stderr
    assert r.stderr.startswith("pretrain_gpt_dualpipe.sh: error: ")


def test_vocabulary_smaller_than_the_datas_token_ids_is_refused(tmp_path):
    """The data holds ids up to 1023, the tokenizer has 581 entries: Megatron would fail with an
    IndexError in the embedding 40 s in; the script refuses it first (and accepts 1024 entries)."""
    write_indexed(tmp_path / "real_document", 1023)
    small = tmp_path / "small"
    small.mkdir()
    data = str(tmp_path / "real_document")
    r = run(tmp_path, tokenizer=False, extra=gpt2_files(small, 581), CONFIG="gpt_345m", DATA_PATH=data)
    print(f"\n{r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "holds token id 1023 but the tokenizer has only 581 entries" in r.stderr
    r = run(tmp_path, tokenizer=False, extra=gpt2_files(small, 1024), CONFIG="gpt_345m", DATA_PATH=data)
    assert r.returncode == 0, r.stderr


def test_a_python_without_torch_is_named(tmp_path):
    """PYTHON (or torchrun's interpreter) that cannot import torch: refused before torchrun,
    where `--check` used to say "can run"."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    r = run(tmp_path, CONFIG="gpt_345m", PYTHON=str(venv / "bin" / "python"))
    print(f"\n{r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == ""
    assert f"{venv / 'bin' / 'python'} cannot import torch" in r.stderr and "Traceback" not in r.stderr


def test_without_torchrun_on_path_the_python_that_has_torch_runs_it(tmp_path):
    """No torchrun on PATH and no PYTHON: `python -m torch.distributed.run` with the interpreter
    the preflight checked, not a bare `torchrun` that the shell cannot find."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").symlink_to(sys.executable)
    r = run(tmp_path, CONFIG="gpt_345m", PYTHON=None, TORCHRUN=None, PATH=f"{shim}:/usr/bin:/bin")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip().splitlines()[-1])
    print(f"\n{' '.join(argv[:3])}")
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    venv = ".venv" + (f"-mcore{os.environ['MEGATRON_CORE']}" if os.environ.get("MEGATRON_CORE") else "")
    assert argv[0] in (str(ROOT / venv / "bin" / "python"), str(shim / "python3"))


def test_gpu_extra_pins_transformer_engine_as_megatron_core_asks():
    """The transformer-engine a user installs is the one the Megatron-LM checkout asks for: where its
    pyproject.toml gives a range (core_v0.16.1: < 2.12), setup.py's [gpu] extra takes it; where it
    gives none and builds against one release (core_v0.19.0: its uv metadata, 2.17.1), the README
    tells users of that megatron-core to install that release instead of the extra."""
    megatron = os.environ.get("MEGATRON_LM_PATH")
    pyproject = pathlib.Path(megatron or "/nonexistent") / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("MEGATRON_LM_PATH with pyproject.toml not set")
    text = pyproject.read_text()
    ranged = re.search(r'"transformer-engine\[[^\]]*\]([^"]+)"', text)
    if ranged:
        theirs = ranged.group(1)
        ours = re.search(r'"gpu": \["transformer-engine\[pytorch\]([^"]+)"\]', (ROOT / "setup.py").read_text()).group(1)
        print(f"\nMegatron-LM asks {theirs}; setup.py [gpu] pins {ours}")
        upper = lambda spec: re.search(r"<\s*([\d.]+)", spec).group(1).rstrip(".0")  # noqa: E731
        assert upper(ours) == upper(theirs)
        return
    built = re.search(r'name = "transformer-engine"\nversion = "(\d+)\.(\d+)\.', text)
    assert built, f"{pyproject} gives neither a transformer-engine range nor the release it builds against"
    advice = f"`transformer-engine[pytorch]=={built.group(1)}.{built.group(2)}.*`"
    core = re.search(r'^MAJOR = (\d+)\nMINOR = (\d+)', (pyproject.parent / "megatron/core/package_info.py").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    print(f"\nMegatron-LM builds against transformer-engine {built.group(1)}.{built.group(2)}; README: {advice}")
    assert re.search(rf"with megatron-core {core.group(1)}\.{core.group(2)} install\s+{re.escape(advice)}", readme), advice


def run_sbatch(tmp_path, command=None, **env_vars):
    """scripts/slurm_dualpipe.sbatch as Slurm runs it: a copy in a spool directory, started from
    ``SLURM_SUBMIT_DIR`` (``tmp_path/elsewhere`` unless given), under a stand-in srun that runs its
    command once per node (SLURM_NODEID 0 and 1, and leaves a mark) and a stand-in scontrol (the
    hostnames; for ``show job``, ``Command=COMMAND`` when given)."""
    fake = fake_checkout(tmp_path / "Megatron-LM")
    write_indexed(tmp_path / "text_document", 7)
    bin_dir, spool, elsewhere = tmp_path / "bin", tmp_path / "spool", tmp_path / "elsewhere"
    for d in (bin_dir, spool, elsewhere):
        d.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f'#!/bin/bash\ntouch {tmp_path}/srun-ran\nshift\n'
                                  'for n in 0 1; do SLURM_NODEID=$n "$@" || exit; done\n')
    job = f"   Command={command}" if command else "   JobState=RUNNING"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\nif [ "$1 $2" = "show job" ]; then echo "{job}"; exit; fi\n'
                                      "printf 'gpu-node-a\\ngpu-node-b\\n'\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    script = spool / "slurm_script"
    script.write_text((ROOT / "scripts" / "slurm_dualpipe.sbatch").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "MASTER_ADDR", "TORCHRUN", "DUALPIPE_DIR")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", DRY_RUN="1", MEGATRON_LM_PATH=str(fake),
               DATA_PATH=str(tmp_path / "text_document"), TOKENIZER_ARGS="--tokenizer-type NullTokenizer --vocab-size 8",
               CONFIG="gpt_8b", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_JOB_NODELIST="gpu-node-[a-b]",
               SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(elsewhere), PYTHON=sys.executable)
    env.update(env_vars)
    return subprocess.run(["bash", str(script), "--seed", "7"], env=env, cwd=env["SLURM_SUBMIT_DIR"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["submitted from the checkout", "submitted from elsewhere", "DUALPIPE_DIR"])
def test_slurm_example_gives_each_node_its_rank_and_the_first_node_as_master(tmp_path, how):
    """Both nodes compose their torchrun command, however the job was submitted: from the checkout
    (``sbatch scripts/slurm_dualpipe.sbatch``), from another directory (scontrol's Command= names
    the script by its full path), or with DUALPIPE_DIR; and each node runs (a stand-in torchrun) the
    command it printed."""
    env = {"submitted from the checkout": dict(command="scripts/slurm_dualpipe.sbatch", SLURM_SUBMIT_DIR=str(ROOT)),
           "submitted from elsewhere": dict(command=str(ROOT / "scripts" / "slurm_dualpipe.sbatch")),
           "DUALPIPE_DIR": dict(DUALPIPE_DIR=str(ROOT))}[how]
    torchrun = stand_in_torchrun(tmp_path)
    r = run_sbatch(tmp_path, DRY_RUN="0", TORCHRUN=str(torchrun), **env)
    assert r.returncode == 0, r.stderr
    commands = [shlex.split(line) for line in r.stdout.splitlines() if not line.startswith("#")]
    assert [c[0] for c in commands] == [str(torchrun)] * 2 and torchrun_calls(tmp_path) == [c[1:] for c in commands]
    print(f"\n{how}:\n" + "\n".join(" ".join(c[:14]) for c in commands))
    assert [c[c.index("--node-rank") + 1] for c in commands] == ["0", "1"]
    assert all(c[c.index("--master-addr") + 1] == "gpu-node-a" and c[c.index("--nnodes") + 1] == "2"
               for c in commands)
    assert all(c[-2:] == ["--seed", "7"] and "NullTokenizer" in c for c in commands)


@pytest.mark.parametrize("env,expected", [
    (dict(), "cannot find the megatron-dualpipe checkout"),
    (dict(DUALPIPE_DIR="/no/such/dir"), "DUALPIPE_DIR=/no/such/dir has no scripts/pretrain_gpt_dualpipe.sh"),
    (dict(command="/no/such/slurm_dualpipe.sbatch", DATA_PATH=""), "cannot find the megatron-dualpipe checkout"),
    (dict(DUALPIPE_DIR=str(ROOT), MEGATRON_LM_PATH=""), "set MEGATRON_LM_PATH"),
    (dict(DUALPIPE_DIR=str(ROOT), TOKENIZER_ARGS=""), "set TOKENIZER_ARGS"),
    (dict(DUALPIPE_DIR=str(ROOT), SLURM_NNODES=""), "not inside a Slurm job: submit this script with sbatch"),
])
def test_slurm_job_that_cannot_find_its_parts_stops_before_srun(tmp_path, env, expected):
    """No checkout to be found (a copy in the spool directory, submitted elsewhere, no Command=) or a
    missing variable: one line naming the fix, exit 2, and srun never runs."""
    r = run_sbatch(tmp_path, **env)
    print(f"\n{env}: {r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and expected in r.stderr
    assert r.stderr.startswith("slurm_dualpipe.sbatch: error: ") and not (tmp_path / "srun-ran").exists()


FAKE_PYTHON = """#!/bin/bash
# Stand-in interpreter for setup_venv.sh: the interrupt helper runs for real, venv and pip are faked
# (pip prints setuptools' BuildBackendWarning box, as a real editable install does; the megatron-core
# it was asked for is the version it then reports).
case "$1 $2" in
  "-m megatron_dualpipe.launch.interrupts") exec REAL "$@";;
  "-m venv") mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0;;
esac
case "$1" in */warm_bytecode.py) exit 0;; esac
here="$(dirname "$0")"
if [ "$1" = -c ]; then
  case "$2" in *"version('megatron-core')"*) cat "$here/megatron-core" 2>/dev/null; exit;; esac
  [ -f "$here/torch" ]; exit
fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  printf '  !!\\n  ****\\n  BuildBackendWarning: Editable installation.\\n  ****\\n  !!\\n' >&2
  case "$*" in *torch==*) touch "$here/torch";; esac
  for a; do case "$a" in megatron-core==*) echo "${a#megatron-core==}" > "$here/megatron-core";; esac; done
  exit 0
fi
exit 3
"""


@pytest.mark.parametrize("megatron_core, steps", [(None, (1, 2, 3, 3)), ("0.19.2", (1, 2, 2, 3, 3))])
def test_setup_prints_one_line_per_step_with_its_time_and_nothing_of_pip(tmp_path, megatron_core, steps):
    """A fresh venv: one line "setup N/3: ... (about T)" per step (with MEGATRON_CORE, step 2, the
    dependencies, installs torch, then that megatron-core; the last writes the bytecode pip did not),
    pip's output (the BuildBackendWarning box) only in the log; a second run has nothing to do and
    prints nothing."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CORE"}
    env.update(VENV=str(tmp_path / "venv"), PYTHON=str(fake), **({"MEGATRON_CORE": megatron_core} if megatron_core else {}))
    first = subprocess.run(["bash", str(ROOT / "scripts" / "setup_venv.sh")], env=env, capture_output=True, text=True,
                           timeout=120)
    print(f"\n{first.stderr}")
    lines = first.stderr.splitlines()
    assert first.returncode == 0 and first.stdout == "" and len(lines) == len(steps), first.stderr
    assert all(re.fullmatch(rf"setup {n}/3: .+ \(about [\d.-]+ (s|min)\)", line) for n, line in zip(steps, lines))
    assert not megatron_core or f"megatron-core=={megatron_core}" in lines[2]
    log = (tmp_path / "venv" / "setup.log").read_text()
    assert "BuildBackendWarning" not in first.stderr and "BuildBackendWarning" in log
    again = subprocess.run(["bash", str(ROOT / "scripts" / "setup_venv.sh")], env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == ""


def test_launcher_help_is_success_and_no_script_is_a_usage_error():
    """``python -m megatron_dualpipe.launch --help`` prints the usage on stdout and exits 0; no script
    at all is a usage error (one line on stderr, exit 2)."""
    asked = subprocess.run([sys.executable, "-m", "megatron_dualpipe.launch", "--help"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    print(f"\n{asked.stdout}")
    assert asked.returncode == 0 and asked.stdout.startswith("usage: ") and "--check" in asked.stdout and not asked.stderr
    bare = subprocess.run([sys.executable, "-m", "megatron_dualpipe.launch"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr.startswith("usage: ")
    assert bare.stderr.count("\n") == 1


def test_dry_run_of_deepseek_v3_prints_the_stages_and_the_advice(tmp_path):
    """DRY_RUN=1 of the 671B config on 64 nodes x 8 GPUs: before the header and the torchrun command,
    the stages each rank holds under each schedule and `advise`'s estimate per schedule for this
    model (H100 unless GPU is set)."""
    r = run(tmp_path, CONFIG="moe_deepseek_v3", NNODES=64, GPUS_PER_NODE=8, MASTER_ADDR="node0", SCHEDULE="dualpipev")
    assert r.returncode == 0, r.stderr
    print("\n" + r.stdout + r.stderr)
    assert "note: SCHEDULE=dualpipev fits (" in r.stderr
    advice = [line[len("# advise: "):] for line in r.stdout.splitlines() if line.startswith("# advise: ")]
    assert any(line.startswith("stages each rank holds") for line in advice), advice
    ranks = [line.split()[0] for line in advice if re.match(r"\s+\d+\s+\d+: ", line)]
    assert ranks == [str(i) for i in range(16)], ranks
    assert re.search(r"^\s+0\s+0: \S+\s+0\+15: ", "\n".join(advice), re.M)  # DualPipe's pair of rank 0
    table = [line.split()[0] for line in advice if re.match(r"\s+(1f1b|dualpipe|dualpipev)\s+128\s", line)]
    assert table == ["1f1b", "dualpipe", "dualpipev"], advice[-6:]
    header, command = r.stdout.strip().splitlines()[-2:]
    assert header.startswith("# dualpipev: 512 processes") and "megatron_dualpipe.launch" in command


def test_a_schedule_advise_says_does_not_fit_is_refused_before_torchrun(tmp_path):
    """DeepSeek-V3's default dualpipe on 512 GPUs (EP32, DP32) needs more than an H800's 80 GB by
    advise's estimate: one line naming dualpipev, which fits; MEMORY_CHECK=0 launches anyway; at the
    config's stated 2048 GPUs dualpipe fits (one note with the figure)."""
    v3 = dict(CONFIG="moe_deepseek_v3", GPUS_PER_NODE=8, MASTER_ADDR="node0", GPU="H800")
    r = run(tmp_path, NNODES=64, **v3)
    print("\n" + r.stderr)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "use SCHEDULE=dualpipev" in r.stderr
    assert "MEMORY_CHECK=0" in r.stderr and "dualpipe needs" in r.stderr
    anyway = run(tmp_path, NNODES=64, MEMORY_CHECK=0, **v3)
    assert anyway.returncode == 0, anyway.stderr
    stated = run(tmp_path, NNODES=256, **v3)
    print(stated.stderr)
    assert stated.returncode == 0 and "note: SCHEDULE=dualpipe fits (" in stated.stderr
    bad = run(tmp_path, NNODES=256, **dict(v3, GPU="V100"))
    assert bad.returncode == 2 and "GPU=V100: use A100, H100, H800, H200 or B200" in bad.stderr
