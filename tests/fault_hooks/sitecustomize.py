"""Test-only fault injection for pretrain_gpt.py runs (tests/test_megatron_lm_options.py puts this
directory on the children's PYTHONPATH; nothing here ships in the wheel).

MEGATRON_DUALPIPE_TEST_NAN="ITERATION,MICROBATCH": the language-model loss of global micro-batch
MICROBATCH (0-based, as megatron-core numbers them in both 1F1B and the executor) of training
iteration ITERATION (1-based) becomes NaN, wherever that micro-batch's last stage runs. Installed
right after the plugin's install(), i.e. after the launcher put the Megatron-LM checkout on the path.
"""
import os
_spec = os.environ.get("MEGATRON_DUALPIPE_TEST_NAN")
if _spec:
    import megatron_dualpipe.megatron_lm.install as _inst
    _orig_install = _inst.install

    def install(*a, **k):
        r = _orig_install(*a, **k)
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.training import get_args
        it, mb = (int(x) for x in _spec.split(","))
        orig = GPTModel.compute_language_model_loss

        def compute_language_model_loss(self, labels, logits):
            loss = orig(self, labels, logits)
            if get_args().curr_iteration == it - 1 and self.decoder.layers[-1].current_microbatch == mb:
                loss = loss * float("nan")
            return loss
        GPTModel.compute_language_model_loss = compute_language_model_loss
        return r
    _inst.install = install
