"""Test-only hooks for pretrain_gpt.py runs (tests/megatron_lm_runs.py puts this directory on the
children's PYTHONPATH; nothing here ships in the wheel). Each is installed right after the
plugin's install(), i.e. after the launcher put the Megatron-LM checkout on the path, and only when
its environment variable is set (the fast exit: at interpreter start, around runpy.run_path).

MEGATRON_DUALPIPE_TEST_NAN="ITERATION,MICROBATCH": the language-model loss of global micro-batch
MICROBATCH (0-based, as megatron-core numbers them in both 1F1B and the executor) of training
iteration ITERATION (1-based) becomes NaN, wherever that micro-batch's last stage runs.

MEGATRON_DUALPIPE_TEST_SIGKILL="RANK,ITERATION,FORWARD": the process of global rank RANK sends
itself SIGKILL when it starts its FORWARD-th model-chunk forward (1-based, counted per iteration) of
training iteration ITERATION (1-based), i.e. in the middle of that iteration's schedule; only in
torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), so that the restarted job runs through.
It prints ``[test-sigkill] rank R iteration I forward F`` first. The other ranks of that attempt
ignore SIGTERM: torchrun sends it to them as soon as its monitor sees the dead worker, often before
they find the dead peer themselves; ignoring it shows what they do on their own (torchrun still
SIGKILLs a worker that has not exited 30 s after the SIGTERM, so a hang would show).

MEGATRON_DUALPIPE_TEST_EXPERT_BIAS=1: after Megatron's finalize moves the routers' expert_bias
(``--moe-router-enable-expert-bias``), every rank prints one line per MoE layer of every chunk it
holds, ``[test-expert-bias] iteration I layer L: b1,b2,...`` (global layer number, values in full
precision), so that a test can check that both DualPipe copies of a layer carry the same bias as
1F1B's one copy.

MEGATRON_DUALPIPE_TEST_COLLECTIVES=1: every gradient reduce-scatter and parameter all-gather of Megatron
DDP's buffers (``param_and_grad_buffer``'s ``dist_reduce_scatter_func`` / ``dist_all_gather_func``)
prints ``[test-collective] rank R: KIND over A,B,C numel N`` (global ranks of its group in group
order) before it is issued, and so does every bd sum (``executor.pair_sums.issue_sum``, KIND
``bd-sum``, one line per tensor), so that a test can check the order every rank issues them in
(``schedule.iteration_plan.issued``).

MEGATRON_DUALPIPE_TEST_FAST_EXIT=1: once the script the launcher runs (pretrain_gpt.py) has
returned normally, the process does what Python's exit does up to the atexit handlers (joins the
non-daemon threads, runs every atexit handler: multiprocessing's joins the data loader's workers)
and then leaves with os._exit(0), skipping the interpreter's teardown of its modules (torch,
megatron, transformers, sympy...): 3-5 s per rank, 4 ranks on 2 cores, for every run. A script
that raises or calls sys.exit takes the normal path. tests/megatron_lm_runs.py sets it for its
runs except those that ask for the normal exit (the evaluation test's 1f1b and dualpipe runs, so
that a hang in the interpreter's own teardown would still show).
"""
import os
import sys

_NAN = os.environ.get("MEGATRON_DUALPIPE_TEST_NAN")
_EXPERT_BIAS = os.environ.get("MEGATRON_DUALPIPE_TEST_EXPERT_BIAS")
_SIGKILL = os.environ.get("MEGATRON_DUALPIPE_TEST_SIGKILL")
_FAST_EXIT = os.environ.get("MEGATRON_DUALPIPE_TEST_FAST_EXIT") == "1"
_COLLECTIVES = os.environ.get("MEGATRON_DUALPIPE_TEST_COLLECTIVES") == "1"
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    _SIGKILL = None


def _inject_nan(spec):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training import get_args
    it, mb = (int(x) for x in spec.split(","))
    orig = GPTModel.compute_language_model_loss

    def compute_language_model_loss(self, labels, logits):
        loss = orig(self, labels, logits)
        if get_args().curr_iteration == it - 1 and self.decoder.layers[-1].current_microbatch == mb:
            loss = loss * float("nan")
        return loss
    GPTModel.compute_language_model_loss = compute_language_model_loss


def _kill_mid_iteration(spec):
    import signal

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training import get_args
    rank, it, nth = (int(x) for x in spec.split(","))
    if int(os.environ["RANK"]) != rank:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    orig = GPTModel.forward
    seen = {}

    def forward(self, *a, **k):
        iteration = get_args().curr_iteration + 1
        seen[iteration] = seen.get(iteration, 0) + 1
        if int(os.environ["RANK"]) == rank and iteration == it and seen[iteration] == nth and self.training:
            print(f"[test-sigkill] rank {rank} iteration {it} forward {nth}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return orig(self, *a, **k)
    GPTModel.forward = forward


def _print_expert_bias():
    import importlib

    from megatron.training import get_args
    # the module, not the function of the same name that megatron.core.distributed exports
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    orig = fmg._update_router_expert_bias

    def _update_router_expert_bias(model, config, *args, **kwargs):  # 0.19 adds tp_dp_cp_group=
        orig(model, config, *args, **kwargs)
        for chunk in model:
            for layer in chunk.modules():
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if getattr(router, "expert_bias", None) is None:
                    continue
                values = ",".join(repr(float(v)) for v in router.expert_bias.detach().cpu().tolist())
                line = f"[test-expert-bias] iteration {get_args().curr_iteration + 1} layer {layer.layer_number}: {values}\n"
                sys.stdout.flush()
                os.write(sys.stdout.fileno(), line.encode())  # one write: lines of the ranks do not interleave
    fmg._update_router_expert_bias = _update_router_expert_bias


def _print_collectives():
    import importlib

    import torch.distributed as dist
    buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")

    def logged(kind, orig, data_arg):
        def collective(*args, **kwargs):
            group = kwargs.get("group")
            ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            numel = (args[data_arg] if len(args) > data_arg else kwargs.get("input", kwargs.get("input_tensor"))).numel()
            line = f"[test-collective] rank {dist.get_rank()}: {kind} over {ranks} numel {numel}\n"
            sys.stdout.flush()
            os.write(sys.stdout.fileno(), line.encode())
            return orig(*args, **kwargs)
        return collective
    # (output, input): the reduce-scatter's input is the whole bucket, the all-gather's output
    buffers.dist_reduce_scatter_func = logged("reduce-scatter", buffers.dist_reduce_scatter_func, 1)
    buffers.dist_all_gather_func = logged("all-gather", buffers.dist_all_gather_func, 0)

    from megatron_dualpipe.executor import pair_sums
    issue_sum = pair_sums.issue_sum

    def logged_bd_sums(chunk, tensors, group, **kwargs):
        ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group))
        lines = "".join(f"[test-collective] rank {dist.get_rank()}: bd-sum over {ranks} numel {t.numel()}\n"
                        for t in tensors)
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), lines.encode())
        return issue_sum(chunk, tensors, group, **kwargs)
    pair_sums.issue_sum = logged_bd_sums


if _NAN or _EXPERT_BIAS or _SIGKILL or _COLLECTIVES:
    import megatron_dualpipe.megatron_lm.install as _inst
    _orig_install = _inst.install

    def install(*a, **k):
        r = _orig_install(*a, **k)
        if _NAN:
            _inject_nan(_NAN)
        if _EXPERT_BIAS:
            _print_expert_bias()
        if _SIGKILL:
            _kill_mid_iteration(_SIGKILL)
        if _COLLECTIVES:
            _print_collectives()
        return r
    _inst.install = install


def _exit_after_the_script():
    import atexit
    import runpy
    import threading

    orig = runpy.run_path

    def run_path(*a, **k):
        result = orig(*a, **k)
        shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx does first
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
        return result
    runpy.run_path = run_path


if _FAST_EXIT:
    _exit_after_the_script()
