"""The launch script composes the torchrun command and refuses bad set-ups before launching.

Runs `scripts/pretrain_gpt_dualpipe.sh` with DRY_RUN=1 against a stand-in Megatron-LM folder
(pretrain_gpt.py and megatron/core/package_info.py at 0.16.1) and a stand-in data prefix; every
config in configs/ must pass at the minimum GPU count it states, and each missing or wrong setting
must fail with one line naming the fix (never a bash error such as "unbound variable").
"""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def run(tmp_path, **env):
    fake = fake_checkout(tmp_path / "Megatron-LM")
    for ext in ("bin", "idx"):
        (tmp_path / f"text_document.{ext}").write_text("")
    full = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "NNODES", "PP", "TP", "EP", "CP", "ETP", "TORCHRUN", "PYTHON")}
    full.update(DRY_RUN="1", MEGATRON_LM_PATH=str(fake), DATA_PATH=str(tmp_path / "text_document"),
                PYTHON=sys.executable)
    full.update({k: str(v) for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    return subprocess.run(["bash", str(SCRIPT), "--seed", "7"], env=full, capture_output=True, text=True, timeout=30)


def test_configs_exist():
    assert {"gpt_tiny_cpu", "gpt_345m", "gpt_8b", "moe_mixtral_8x7b", "moe_deepseek_v2_lite"} <= set(CONFIGS)


def test_readme_states_each_configs_minimum():
    readme = (ROOT / "README.md").read_text()
    for config in CONFIGS:
        assert f"`{config}` ({min_gpus(config)}" in readme, config


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_every_config_is_accepted_at_its_minimum_and_composed(tmp_path, config, schedule):
    gpus = min(min_gpus(config), 8)
    nodes = min_gpus(config) // gpus
    r = run(tmp_path, CONFIG=config, SCHEDULE=schedule, NNODES=nodes, GPUS_PER_NODE=gpus, MASTER_ADDR="node0")
    assert r.returncode == 0, r.stderr
    header, command = r.stdout.strip().splitlines()[-2:]
    print(f"\n{config} {schedule}: {header}")
    argv = shlex.split(command)
    assert argv[argv.index("-m") + 1] == "megatron_dualpipe.launch"
    assert argv[argv.index("--pipeline-schedule") + 1] == schedule
    assert argv[argv.index("--nnodes") + 1] == str(nodes) and argv[-2:] == ["--seed", "7"]
    pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
    layers = int(argv[argv.index("--num-layers") + 1])
    assert layers % (2 * pp if schedule == "dualpipev" else pp) == 0 and (schedule != "dualpipe" or pp % 2 == 0)
    assert f"(minimum {min_gpus(config)})" in header


@pytest.mark.parametrize("config", CONFIGS)
def test_below_the_stated_minimum_is_refused_naming_it(tmp_path, config):
    """Megatron refuses a world size that is not a multiple of TP*PP*CP and of ETP*EP*PP; so does the script."""
    least = min_gpus(config)
    gpus = least // 2
    r = run(tmp_path, CONFIG=config, NNODES=1, GPUS_PER_NODE=gpus)
    print(f"\n{config} on {gpus} GPUs: {r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert f"the nearest valid count is {least}" in r.stderr


@pytest.mark.parametrize("env,expected", [
    (dict(MEGATRON_LM_PATH=None, CONFIG="gpt_345m"), "set MEGATRON_LM_PATH"),
    (dict(CONFIG=None), "set CONFIG to one of"),
    (dict(CONFIG="nope"), "no config nope"),
    (dict(CONFIG="gpt_345m", NNODES=2), "set MASTER_ADDR"),
    (dict(CONFIG="gpt_345m", PP=3, GPUS_PER_NODE=3), "even PP"),
    (dict(CONFIG="gpt_345m", SCHEDULE="dualpipev", PP=5, GPUS_PER_NODE=5), "divisible by 2*PP=10"),
    (dict(CONFIG="gpt_345m", GLOBAL_BATCH=8), "raise GLOBAL_BATCH to 32"),
    (dict(CONFIG="gpt_345m", DATA_PATH=None), "set DATA_PATH"),
    (dict(CONFIG="gpt_345m", SCHEDULE="gpipe"), "use dualpipe, dualpipev or 1f1b"),
    (dict(CONFIG="gpt_345m", GPUS_PER_NODE=6), "multiple of TP*PP*CP=4 and of ETP*EP*PP=4, i.e. of 4; the nearest "
                                               "valid count is 4"),
    (dict(CONFIG="moe_mixtral_8x7b"), "multiple of TP*PP*CP=8 and of ETP*EP*PP=64, i.e. of 64; the nearest valid "
                                      "count is 64 (GPUS_PER_NODE=8 with NNODES=8)"),
    (dict(CONFIG="moe_deepseek_v2_lite", GPUS_PER_NODE=8, NNODES=5, MASTER_ADDR="n0"), "nearest valid count is 32"),
    (dict(CONFIG="moe_mixtral_8x7b", EP=3, PP=2, GPUS_PER_NODE=6), "EP=3 does not divide the config's 8 experts"),
    (dict(CONFIG="gpt_345m", DATA_PATH="/no/such/prefix"), "no /no/such/prefix.bin and /no/such/prefix.idx"),
    (dict(CONFIG="gpt_345m", PYTHON="/no/such/python"), "PYTHON=/no/such/python not found"),
])
def test_bad_setups_fail_early_with_the_fix(tmp_path, env, expected):
    r = run(tmp_path, **env)
    print(f"\n{env}: {r.stderr.strip()}")
    assert r.returncode != 0 and expected in r.stderr and r.stdout == ""


@pytest.mark.parametrize("var,value", [(v, x) for v in ("PP", "TP", "EP", "CP", "MICRO_BATCH", "GLOBAL_BATCH", "NNODES",
                                                         "GPUS_PER_NODE", "MASTER_PORT")
                                       for x in ("0", "abc", "-2", "1.5", "99999999999999999999")])
def test_numbers_must_be_positive_integers(tmp_path, var, value):
    r = run(tmp_path, CONFIG="gpt_345m", **{var: value})
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and "must be a positive integer" in r.stderr, r.stderr
    for bash_error in ("unbound variable", "division by 0", "syntax error", "line "):
        assert bash_error not in r.stderr


def test_wrong_megatron_version_is_refused_before_torchrun(tmp_path):
    old = fake_checkout(tmp_path / "Megatron-LM-0.15", version=(0, 15, 0))
    r = run(tmp_path, CONFIG="gpt_345m", MEGATRON_LM_PATH=str(old))
    print(f"\n{r.stderr.strip()}")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "core_v0.16.1 or core_v0.19.0 (found megatron-core 0.15.0)" in r.stderr


def test_blended_data_path_checks_every_prefix(tmp_path):
    r = run(tmp_path, CONFIG="gpt_345m", DATA_PATH=f"0.7 {tmp_path / 'text_document'} 0.3 {tmp_path / 'other'}")
    assert r.returncode == 2 and f"no {tmp_path / 'other'}.bin" in r.stderr
    for ext in ("bin", "idx"):
        (tmp_path / f"other.{ext}").write_text("")
    r = run(tmp_path, CONFIG="gpt_345m", DATA_PATH=f"0.7 {tmp_path / 'text_document'} 0.3 {tmp_path / 'other'}")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip().splitlines()[-1])
    i = argv.index("--data-path")
    assert argv[i + 1:i + 5] == ["0.7", str(tmp_path / "text_document"), "0.3", str(tmp_path / "other")]
