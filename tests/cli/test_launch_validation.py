"""Every refusal before torchrun: ``launch --check`` runs Megatron-LM's own ``parse_args`` and
``validate_args`` and the plugin's checks on the final argument list (a config plus what is
appended), one line per problem naming the flag; and a refusal inside torchrun's ranks (torchrun
started by hand) is said once, by rank 0, without a traceback.

The Megatron-LM cases need a checkout (``MEGATRON_LM_PATH``, skipped when unset) and run in one
child process (one import of Megatron-LM for all of them)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron_dualpipe.launch import launcher
from megatron_dualpipe.megatron_lm.arguments import DualPipeArgumentError

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")

#: gpt_8b's model (configs/gpt_8b.sh) with the launch script's parallel sizes on 2 x 8 GPUs.
GPT_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
          "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
          "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --bf16 "
          "--sequence-parallel --use-distributed-optimizer --lr 3e-4 --train-iters 10 --mock-data "
          "--tokenizer-type NullTokenizer --vocab-size 128000 --tensor-model-parallel-size 2 "
          "--pipeline-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 512 "
          "--pipeline-schedule dualpipe").split()

#: appended arguments -> what the one line must say (the flag to change).
MISTAKES = {
    "--mtp-num-layers 1 --pipeline-model-parallel-layout Etttt|tttt|tttt|tttt|tttt|tttt|tttt|ttttmL":
        "remove --pipeline-model-parallel-layout (MTP then runs on the last stage)",
    "--use-torch-fsdp2": "--use-torch-fsdp2 is not supported with pipeline parallelism",
    "--pipeline-model-parallel-size 6": "world size (16) is not divisible",
    "--num-layers 30": "Number of layers should be divisible by the pipeline-model-parallel size",
    "--num-layers-per-virtual-pipeline-stage 2": "remove --num-layers-per-virtual-pipeline-stage",
    "--no-such-flag": "unrecognized arguments: --no-such-flag",
    # a layout of 1F1B's pp stages under dualpipev, and a count Megatron-LM's own check would assert on
    "--pipeline-schedule dualpipev --pipeline-model-parallel-layout Et*3|(t*4|)*6,t*5L":
        "--pipeline-model-parallel-layout has 8 stages; --pipeline-schedule dualpipev runs 16 (2 * "
        "--pipeline-model-parallel-size 8): use e.g. 'Et|(tt|)*14,t*3L'",
    "--pipeline-model-parallel-layout Et*2|(t*3|)*10,L": "--pipeline-model-parallel-layout has 12 stages; "
        "--pipeline-schedule dualpipe runs 8 (--pipeline-model-parallel-size 8): use e.g. 'Et*4|(t*4|)*6,t*4L'",
}

#: appended arguments that run -> what the launch script's header (the layout of the final list) says.
ACCEPTED = {
    "--global-batch-size 8": "dualpipe: 16 processes (minimum 16), PP=8 TP=2 EP=1 CP=1 DP=1, 8 micro-batches",
    "--pipeline-schedule zb-h1 --global-batch-size 64": "zb-h1: 16 processes (minimum 16), PP=8 TP=2 EP=1 CP=1 DP=1, 64 ",
    "--pipeline-schedule 1f1b --num-layers-per-virtual-pipeline-stage 2": "1f1b (interleaved, 2 chunks per rank): 16 ",
    # DualPipeV's 16 V-stages: no virtual pipeline left in the arguments (dualpipev builds its two chunks)
    "--pipeline-schedule dualpipev --pipeline-model-parallel-layout Ett|(tt|)*14,ttL": "dualpipev: 16 processes "
        "(minimum 16), PP=8 TP=2 EP=1 CP=1 DP=1, 512 ",
}

#: Megatron's validate_args asks the GPU's compute capability for grouped GEMM.
ASKS_THE_GPU = "--moe-grouped-gemm"

_CHILD = """
import json, sys
from megatron_dualpipe.launch import validation
script, base, cases = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {c: validation.check(script, base + c.split()) for c in cases}
print("@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def refusals():
    if not MEGATRON_LM_PATH:
        pytest.skip("MEGATRON_LM_PATH is not set")
    env = dict(os.environ, WORLD_SIZE="16", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=str(ROOT))
    cases = [""] + list(MISTAKES) + list(ACCEPTED) + [ASKS_THE_GPU]
    proc = subprocess.run([sys.executable, "-c", _CHILD, os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"),
                           json.dumps(GPT_8B), json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][2:])


def test_the_config_as_is_passes_megatrons_and_the_plugins_validation(refusals):
    assert refusals[""] == [[], "dualpipe: 16 processes (minimum 16), PP=8 TP=2 EP=1 CP=1 DP=1, 512 micro-batches "
                                "per iteration", None]


@pytest.mark.parametrize("extra", sorted(MISTAKES))
def test_an_appended_mistake_is_one_line_naming_the_flag(refusals, extra):
    got, layout, _ = refusals[extra]
    print(f"\n{extra}: {got}")
    assert len(got) == 1 and MISTAKES[extra] in got[0] and "\n" not in got[0] and layout is None


@pytest.mark.parametrize("extra", sorted(ACCEPTED))
def test_the_header_says_the_layout_of_the_final_arguments(refusals, extra):
    """The launch script's header came from its own variables (GLOBAL_BATCH=512 said 512 micro-batches
    with --global-batch-size 8 appended); it is now the validated list's."""
    got, layout, _ = refusals[extra]
    print(f"\n{extra}: {layout}")
    assert got == [] and layout.startswith(ACCEPTED[extra])


def test_what_megatron_asks_the_gpu_is_left_to_the_ranks_without_one_here(refusals):
    """Without a GPU here (a login node), an argument Megatron checks against the device is not a
    refusal: the check says it could not be checked, the ranks on the GPU nodes check it."""
    import torch

    got, layout, note = refusals[ASKS_THE_GPU]
    print(f"\n{ASKS_THE_GPU}: {got} {layout} {note}")
    assert got == []
    if torch.cuda.is_available():
        assert note is None and layout
    else:
        assert layout is None and "this machine has none: they are checked by the ranks on the GPU nodes" in note


def test_without_a_parser_in_the_checkout_nothing_is_checked(tmp_path):
    """The launch script tests' stand-in checkout (no megatron/training/arguments.py)."""
    from megatron_dualpipe.launch import validation

    (tmp_path / "pretrain_gpt.py").write_text("")
    assert validation.check(str(tmp_path / "pretrain_gpt.py"), ["--num-layers", "30"]) == ([], None, None)


def _run_in_rank(tmp_path, monkeypatch, rank, body):
    """launcher.main on a script whose body is ``body``, as torchrun's rank ``rank`` would run it."""
    import megatron_dualpipe.megatron_lm.install as install

    script = tmp_path / "pretrain_gpt.py"
    script.write_text(body)
    monkeypatch.setattr(install, "install", lambda: None)
    monkeypatch.setattr(launcher, "preflight", lambda s: None)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return launcher.main([str(script), "--tokenizer-type", "NullTokenizer", "--vocab-size", "8", "--mock-data"])


@pytest.mark.parametrize("rank", ["0", "3"])
def test_megatrons_own_refusal_inside_a_rank_is_one_line_from_rank_0_only(tmp_path, monkeypatch, capsys, rank):
    """An assertion of Megatron-LM's validate_args (megatron/training/arguments.py) is a refusal
    too; an assertion anywhere else (another function of the same file included: it may fail on
    some ranks only) is a bug and keeps its traceback."""
    validation = tmp_path / "megatron" / "training" / "arguments.py"
    validation.parent.mkdir(parents=True)
    validation.write_text("def validate_args():\n"
                          "    assert 1 == 2, 'Number of layers should be divisible by the pipeline size'\n"
                          "def core_transformer_config_from_args():\n"
                          "    assert False, 'a bug'\n")
    load = f"import runpy\nfunctions = runpy.run_path({str(validation)!r})\n"
    code = _run_in_rank(tmp_path, monkeypatch, rank, load + "functions['validate_args']()\n")
    err = capsys.readouterr().err
    print(f"\nrank {rank}: {err!r}")
    assert code == 2 and err == ("megatron_dualpipe.launch: error: Megatron-LM refuses these arguments "
                                 "(training/arguments.py:2): Number of layers should be divisible by the pipeline "
                                 "size\n" if rank == "0" else "")
    for elsewhere in ("assert False, 'a bug'\n", load + "functions['core_transformer_config_from_args']()\n"):
        with pytest.raises(AssertionError, match="a bug"):
            _run_in_rank(tmp_path, monkeypatch, rank, elsewhere)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refusal_inside_a_rank_is_one_line_from_rank_0_only(tmp_path, monkeypatch, capsys, rank):
    """torchrun started by hand: every rank refuses the same arguments in Megatron's validate_args;
    rank 0 prints the problems, one line each, the others nothing; no traceback, exit status 2."""
    body = ("from megatron_dualpipe.megatron_lm.arguments import DualPipeArgumentError\n"
            "raise DualPipeArgumentError('invalid arguments for the DualPipe schedule:\\n  - first: fix a"
            "\\n  - second: fix b')\n")
    assert _run_in_rank(tmp_path, monkeypatch, rank, body) == 2
    err = capsys.readouterr().err
    print(f"\nrank {rank}: {err!r}")
    want = ("megatron_dualpipe.launch: error: first: fix a\nmegatron_dualpipe.launch: error: second: fix b\n"
            if rank == "0" else "")
    assert err == want and issubclass(DualPipeArgumentError, ValueError)


#: A rank's script that refuses a checkpoint at load, as strategies.load_reshardable_state does.
CHECKPOINT_REFUSAL = ("from megatron_dualpipe.megatron_lm.refusal import Refusal\n"
                      "raise Refusal('--pipeline-schedule dualpipev: this torch_dist checkpoint cannot load: save "
                      "it with --dist-ckpt-optim-fully-reshardable, or load with --no-load-optim')\n")
SAID = ("megatron_dualpipe.launch: error: --pipeline-schedule dualpipev: this torch_dist checkpoint cannot load: "
        "save it with --dist-ckpt-optim-fully-reshardable, or load with --no-load-optim\n")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_checkpoint_refusal_before_the_process_group_is_said_by_rank_0_only(tmp_path, monkeypatch, capsys, rank):
    """A checkpoint the schedule cannot load used to be a traceback from every rank: one line,
    rank 0's, exit status 2."""
    monkeypatch.setattr(launcher, "REFUSAL_WAIT_S", 0.0)
    assert _run_in_rank(tmp_path, monkeypatch, rank, CHECKPOINT_REFUSAL) == 2
    err = capsys.readouterr().err
    print(f"\nrank {rank}: {err!r}")
    assert err == (SAID if rank == "0" else "")


def test_a_checkpoint_refusal_is_said_by_the_first_rank_that_meets_it(tmp_path, monkeypatch, capsys):
    """With the process group up (a checkpoint is loaded after it), the first rank to refuse says it,
    whichever it is (rank 0 may wait in a collective): rank 3 here, then no other."""
    import torch.distributed as dist

    monkeypatch.setattr(launcher, "REFUSAL_WAIT_S", 0.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        said = []
        for rank in ("3", "0", "1"):
            assert _run_in_rank(tmp_path, monkeypatch, rank, CHECKPOINT_REFUSAL) == 2
            said.append(capsys.readouterr().err)
    finally:
        dist.destroy_process_group()
    print(f"\nranks 3, 0, 1 refuse in turn: {said}")
    assert said == [SAID, "", ""]


def test_other_errors_in_a_rank_keep_their_traceback(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="a bug"):
        _run_in_rank(tmp_path, monkeypatch, "0", "raise RuntimeError('a bug')\n")


def _script(tmp_path, *extra):
    """scripts/pretrain_gpt_dualpipe.sh, CONFIG=gpt_8b on 2 x 8 GPUs, DRY_RUN, with the checkout of
    MEGATRON_LM_PATH and this interpreter, ``extra`` appended."""
    import struct

    prefix = tmp_path / "text_document"
    prefix.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, 8) + b"\x00" * 16)
    prefix.with_suffix(".bin").write_bytes(bytes(range(16)))
    env = {k: v for k, v in os.environ.items() if k not in ("PP", "TP", "EP", "CP", "ETP", "TORCHRUN", "WORLD_SIZE",
                                                           "CUDA_DEVICE_MAX_CONNECTIONS")}
    env.update(MEGATRON_LM_PATH=MEGATRON_LM_PATH, PYTHON=sys.executable, CONFIG="gpt_8b", NNODES="2",
               GPUS_PER_NODE="8", MASTER_ADDR="node0", DRY_RUN="1", DATA_PATH=str(prefix))
    return subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_gpt_dualpipe.sh"), "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "128000", *extra], env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_launch_script_refuses_an_appended_mistake_before_torchrun(tmp_path):
    """End to end: the script's own variables are fine, the appended --num-layers 30 is not."""
    if not MEGATRON_LM_PATH:
        pytest.skip("MEGATRON_LM_PATH is not set")
    bad = _script(tmp_path, "--num-layers", "30")
    good = _script(tmp_path, "--global-batch-size", "8")
    header = [line for line in good.stdout.splitlines() if not line.startswith("# advise: ")][:1]  # DRY_RUN's advice first
    print(f"\n--num-layers 30: rc {bad.returncode}: {bad.stderr.strip()}\n--global-batch-size 8: "
          f"{header[0] if header else good.stderr}")
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("pretrain_gpt_dualpipe.sh: error: Megatron-LM refuses these arguments")
    assert good.returncode == 0, good.stderr
    assert header and header[0].startswith("# dualpipe: 16 processes (minimum 16), PP=8 TP=2 EP=1 CP=1 DP=1, 8 micro-batches")
