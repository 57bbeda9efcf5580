"""Write the bytecode of what the runs import, once, after scripts/setup_venv.sh installed with pip's
--no-compile (compiling every file pip unpacks took 16 s of CPU for torch alone; importing compiles
only what is used). Each group in its own interpreter: megatron-core is imported on the CPU mode's
stand-ins, Megatron-Bridge on its own CPU mode, which must come before megatron-core's import.
A library the environment lacks is skipped: there is nothing of it to compile.
"""
import importlib
import subprocess
import sys
import warnings

GROUPS = {
    "torch": ("torch", "torch.distributed", "numpy", "pytest", "xdist"),
    "mcore": tuple(f"megatron.core.{m}" for m in ("parallel_state", "models.gpt", "models.gpt.gpt_layer_specs",
                                                  "pipeline_parallel", "distributed", "optimizer",
                                                  "transformer.moe.moe_layer")),
    "bridge": ("megatron.bridge.training.pretrain", "megatron.bridge.training.gpt_step"),
}


def _import(group: str) -> None:
    warnings.simplefilter("ignore")
    if group == "mcore":
        from megatron_dualpipe.cpu import stand_ins

        stand_ins.install()
    elif group == "bridge":
        from megatron_dualpipe.bridge import cpu

        cpu.enable()
    for name in GROUPS[group]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed here, or needs what only a run sets up
            pass


def main(argv) -> int:
    if argv[:1] == ["--group"]:
        _import(argv[1])
        return 0
    groups = ["torch", "mcore"] + (["bridge"] if "--bridge" in argv else [])
    return max(subprocess.call([sys.executable, __file__, "--group", g]) for g in groups)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
