"""The launch script composes the torchrun command and refuses bad set-ups before launching.

Runs `scripts/pretrain_gpt_dualpipe.sh` with DRY_RUN=1 against a stand-in Megatron-LM folder
(only the file name is checked); every config in configs/ must pass DualPipe's rules for the
default sizes, and each missing or wrong setting must fail with a message naming the fix.
"""
import os
import pathlib
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt_dualpipe.sh"
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.sh"))


def run(tmp_path, **env):
    fake = tmp_path / "Megatron-LM"
    fake.mkdir(exist_ok=True)
    (fake / "pretrain_gpt.py").write_text("")
    full = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "NNODES", "PP", "TP", "EP")}
    full.update(DRY_RUN="1", MEGATRON_LM_PATH=str(fake), DATA_PATH="/data/text_document")
    full.update({k: str(v) for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    return subprocess.run(["bash", str(SCRIPT), "--seed", "7"], env=full, capture_output=True, text=True, timeout=30)


def test_configs_exist():
    assert {"gpt_tiny_cpu", "gpt_345m", "gpt_8b", "moe_mixtral_8x7b", "moe_deepseek_v2_lite"} <= set(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_every_config_is_accepted_and_composed(tmp_path, config, schedule):
    gpus = 4 if config == "gpt_tiny_cpu" else 8
    nodes = 1 if config == "gpt_tiny_cpu" else 4
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
    (dict(CONFIG="gpt_345m", GPUS_PER_NODE=6), "not a multiple of PP*TP"),
])
def test_bad_setups_fail_early_with_the_fix(tmp_path, env, expected):
    r = run(tmp_path, **env)
    print(f"\n{env}: {r.stderr.strip()}")
    assert r.returncode != 0 and expected in r.stderr and r.stdout == ""
