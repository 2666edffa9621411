"""`moerl bench train`'s optimizer step split: the classifier on kernel names the CUDA profiler shows, in their
phase and part, and the CPU bench printing the table with rows that add up to the step."""

from __future__ import annotations

import re

import pytest

from moerl.bench.train import main
from moerl.bench.train_split import ROWS, row_of

GROUPED = ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
           "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<"
           "cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecialized<4> > > > >(...)")
CUBLAS = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
               "std::array<char*, 3ul> >(...)")
COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>(...)"
CASES = [  # (kernel name, phase, part of the launching op) -> row
    (GROUPED, "fwd", "expert GEMMs", "expert GEMMs fwd"),
    (GROUPED, "bwd", "expert GEMMs", "expert GEMMs bwd"),
    (GROUPED, "fwd", None, "expert GEMMs fwd"),  # the name decides, wherever it ran
    ("_swiglu_backward_kernel", "bwd", "expert GEMMs", "expert GEMMs bwd"),
    ("_swiglu_backward_kernel", "fwd", None, "expert GEMMs bwd"),  # no linked op: the name says backward
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true>(...)",
     "fwd", "attention", "attention fwd"),
    ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, false, "
     "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >, true, false>(...)",
     "bwd", "attention", "attention bwd"),
    (CUBLAS, "fwd", "attention", "attention fwd"),  # q/k/v/o GEMMs: their module decides
    (CUBLAS, "bwd", "attention", "attention bwd"),
    (CUBLAS, "fwd", "router/dispatch", "router/dispatch"),  # the router GEMM
    (CUBLAS, "bwd", "log-probs", "log-probs"),  # the chunked lm_head's backward
    (CUBLAS, "recompute", "attention", "recompute"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>(...)", "fwd", "log-probs", "log-probs"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", "fwd", "router/dispatch",
     "router/dispatch"),
    ("void at::native::radixSortKVInPlace<-2, -1, 32, 4, long, long, unsigned int>(...)", "fwd", None,
     "router/dispatch"),
    ("_combine_backward_kernel", "bwd", "expert GEMMs", "router/dispatch"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>(...)",
     "fwd", "optimizer", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>(...)", "fwd", None, "optimizer"),
    (COPY, "fwd", "trainer", "optimizer"),  # the master weights' bf16 casts
    (COPY, "bwd", "optimizer", "optimizer"),  # AccumulateGrad into the float32 grads
    (ELEMENTWISE, "fwd", "trainer", "norms/elementwise"),  # the loss
    (ELEMENTWISE, "bwd", None, "norms/elementwise"),  # a residual add's backward
    ("_rms_norm_kernel", "fwd", None, "norms/elementwise"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "bwd", None, "communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "recompute", None, "communication"),
    ("Memcpy HtoD (Pinned -> Device)", "fwd", "trainer", "other"),
    ("_some_new_kernel", "fwd", None, "unclassified"),
]


@pytest.mark.parametrize("name, phase, part, row", CASES, ids=[f"{c[0][:30]}-{c[1]}" for c in CASES])
def test_kernels_fall_in_their_row(name, phase, part, row):
    assert row_of(name, phase, part) == row


def test_bench_train_prints_the_split_and_its_rows_add_up_to_the_step(capsys):
    assert main(["--device", "cpu", "--samples", "2", "--seq", "32", "--prompt", "8", "--vocab", "512",
                 "--steps", "1", "--micro-batch-tokens", "40", "--peer", "none"]) == 0
    out = capsys.readouterr().out
    assert "optimizer step split" in out
    table = out[out.index("optimizer step split"):]
    ms = {}
    for row in ROWS + ("idle", "step"):
        m = re.search(rf"^  {re.escape(row)} +(-?[\d.]+) +(-?[\d.]+)%", table, re.MULTILINE)
        assert m, f"no row {row!r} in\n{table}"
        ms[row] = float(m.group(1))
    assert ms["step"] > 0 and ms["recompute"] > 0 and ms["expert GEMMs bwd"] > 0 and ms["log-probs"] > 0
    assert ms["communication"] == 0.0  # one rank
    parts = sum(v for k, v in ms.items() if k != "step")
    assert abs(parts - ms["step"]) <= 0.01 * (len(ms) - 1)


def test_no_split_skips_it(capsys):
    assert main(["--device", "cpu", "--samples", "1", "--seq", "16", "--prompt", "4", "--vocab", "256",
                 "--steps", "1", "--peer", "none", "--no-split"]) == 0
    assert "optimizer step split" not in capsys.readouterr().out
