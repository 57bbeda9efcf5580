"""The stand-in for apex's fused_weight_gradient_mlp_cuda keeps its contract: d_weight += d_output^T
input, in place, fp32 or half main grads; a wrong shape or dtype is refused (apex raises too)."""
import pytest
import torch

from megatron_dualpipe.cpu.stand_ins import fused_weight_gradient_mlp_cuda as fw


@pytest.mark.parametrize("dtype,accum", [(torch.float32, fw.wgrad_gemm_accum_fp32),
                                         (torch.bfloat16, fw.wgrad_gemm_accum_fp32),
                                         (torch.bfloat16, fw.wgrad_gemm_accum_fp16)])
def test_it_accumulates_the_weight_gradient_in_place(dtype, accum):
    torch.manual_seed(3)
    x, dy = torch.randn(10, 6).to(dtype), torch.randn(10, 4).to(dtype)
    main_dtype = torch.float32 if accum is fw.wgrad_gemm_accum_fp32 else dtype
    start = torch.randn(4, 6).to(main_dtype)
    main = start.clone()
    storage = main.data_ptr()
    accum(x, dy, main)
    accum(x, dy, main)
    want = start.double() + 2 * dy.double().t() @ x.double()
    gap = ((main.double() - want).abs().max() / want.abs().max()).item()
    print(f"\n{dtype} into {main_dtype} twice: relative gap {gap:.2e} against float64")
    assert main.data_ptr() == storage and main.dtype == main_dtype
    assert gap < (1e-6 if main_dtype == torch.float32 else 1e-2)


def test_wrong_shapes_and_dtypes_are_refused():
    x, dy = torch.randn(10, 6), torch.randn(10, 4)
    for call in (lambda: fw.wgrad_gemm_accum_fp32(x, dy, torch.zeros(6, 4)),
                 lambda: fw.wgrad_gemm_accum_fp32(x, dy[:9], torch.zeros(4, 6)),
                 lambda: fw.wgrad_gemm_accum_fp32(x, dy, torch.zeros(4, 6, dtype=torch.bfloat16)),
                 lambda: fw.wgrad_gemm_accum_fp16(x, dy, torch.zeros(4, 6))):
        with pytest.raises(RuntimeError) as e:
            call()
        print(e.value)
