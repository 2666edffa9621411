"""`moerl bench rollout`'s decode step split and prefill floor: the kernel-name classifier on names the CUDA
profiler shows (torch, cuBLAS, CUTLASS, our Triton kernels, the ones being written), the module scopes that
decide generic kernels, the prefill FLOP count against a hand count, and the CPU bench printing both."""

from __future__ import annotations

import pytest
import torch

from moerl.bench import rollout, rollout_workload, step_split
from moerl.bench.step_split import classify
from moerl.model import MoEModelConfig
from moerl.rollout import Engine, EngineConfig

NAMES = {
    # experts: torch._grouped_mm's CUTLASS kernel, our SwiGLU, the fused MoE kernels being added
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
    "cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<"
    "cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecialized<4> > > > >(...)": "experts",
    "_fused_moe_gate_up_kernel": "experts",
    "_fused_moe_down_kernel": "experts",
    "_gate_up_swiglu_kernel": "experts",  # moerl/kernels/triton_fused_moe.py's, as the H200 profile names them
    "_down_kernel": "experts",
    "_align_count_kernel": "dispatch",
    "_align_scatter_kernel": "dispatch",
    "_swiglu_forward_kernel": "experts",
    "aten::_grouped_mm": "experts",
    # attention: the paged decode kernel, flash and memory-efficient SDPA, SDPA on a CPU
    "_paged_decode_kernel": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true>(...)": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    # dense GEMMs outside any module (the lm_head's is labelled by its module)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
    "5x_cublas": "dense GEMMs",
    "nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT": "dense GEMMs",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)": "dense GEMMs",
    "aten::mm": "dense GEMMs",
    # norms: ours, the fused add + norm being added, Inductor's fusion of the eager chain
    "_rms_norm_kernel": "norms",
    "_add_rms_norm_kernel": "norms",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norms",
    # router
    "_router_topk_kernel": "router",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)": "router",
    "void at::native::mbtopk::computeBlockwiseWithinKCounts<unsigned int>(...)": "router",
    "void (anonymous namespace)::softmax_warp_forward<float, float, float, 7, false, false>(...)": "router",
    "aten::topk": "router",
    # dispatch
    "_moe_align_kernel": "dispatch",
    "_gather_weighted_sum_kernel": "dispatch",
    "void at::native::radixSortKVInPlace<-2, -1, 32, 4, long, long, unsigned int>(...)": "dispatch",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>(...)": "dispatch",
    "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)": "dispatch",
    "aten::sort": "dispatch",
    # sampling: the fused Gumbel-max kernel, greedy's log-softmax and argmax over the vocabulary
    "_gumbel_argmax_kernel": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(...)": "sampling",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4> >(...)": "sampling",
    # other: elementwise kernels, copies, Inductor's other fusions, outside any module
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(...)": "other",
    "Memcpy HtoD (Pinned -> Device)": "other",
    "triton_poi_fused_add_0": "other",
    "aten::add": "other",
    # nothing claims it: the table lists it so the next rule is visible
    "_some_new_kernel": "unclassified",
}


@pytest.mark.parametrize("name, category", NAMES.items(), ids=[n[:40] for n in NAMES])
def test_kernel_names_fall_in_their_category(name, category):
    assert classify(name) == category


def test_the_module_decides_generic_kernels_and_the_name_decides_specific_ones():
    radix = "void at::native::radixSortKVInPlace<-2, -1, 32, 4, float, long, unsigned int>(...)"
    assert classify(radix, "router") == "router"  # top-k's sort of its results, inside the router
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>(...)"
    assert classify(add, "norms") == "norms"  # an eager RMSNorm's chain
    assert classify("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", "attention") == "attention"  # q/k/v/o
    assert classify("void at::native::indexSelectLargeIndex<float, long>(...)", "other") == "other"  # embedding
    assert classify("_fused_moe_down_kernel", "dispatch") == "experts"  # launched from the MoE block
    assert classify("_rms_norm_kernel", None) == "norms"  # outside any RMSNorm module
    assert classify("_some_new_kernel", "dispatch") == "dispatch"
    assert set(step_split.SCOPES.values()) | {r.category for r in step_split.RULES} <= set(step_split.CATEGORIES)


def test_prefill_flops_match_a_hand_count():
    c = MoEModelConfig(vocab_size=100, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=6, mlp_only_layers=[1])
    flops, active = rollout.prefill_flops(c, prompt_len=3)
    attn = 8 * 4 * 2 + 8 * 4 * 1 + 8 * 4 * 1 + 2 * 4 * 8  # q, k, v, o: 64 + 32 + 32 + 64 = 192
    moe = 4 * 8 + 2 * (8 * 2 * 6 + 6 * 8)  # router + 2 experts of gate/up and down = 32 + 2 x 144
    dense = 3 * 8 * 12  # layer 1 is a dense MLP
    assert active == attn + moe + attn + dense == 992
    scores = 2 * (2 + 2) * 2 * 4 * (1 + 2 + 3)  # 2 layers x (QK and AV, 2 FLOPs each per head dim) x H x d x pairs
    assert flops == 2 * 992 * 3 + scores + 2 * 100 * 8


def test_30b_active_parameters_are_qwen3_30b_a3b_s_3_3b():
    c = rollout_workload.qwen3_30b_a3b_config()
    _, active = rollout.prefill_flops(c, 128)
    assert abs(active + 2 * c.vocab_size * c.hidden_size - 3.35e9) < 0.05e9  # HF's 3.3B counts both embeddings


def test_split_of_a_tiny_cpu_engine_covers_every_part_and_cleans_up():
    c = rollout_workload.PRESETS["tiny"].config()
    model = rollout.random_model(c, torch.float32, torch.device("cpu"), seed=0)
    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=24, prefill_chunk=8, cuda_graphs=False,
                                        prefix_caching=False))
    prompts = torch.randint(0, c.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0)).tolist()
    split = step_split.measure(engine, prompts, new_tokens=16, temperature=1.0)
    assert split.steps == 3 and split.rows == 4 and 15 <= split.context <= 18 and not split.on_cuda
    for part in ("experts", "attention", "dense GEMMs", "norms", "router", "dispatch", "sampling", "other"):
        assert split.ms.get(part, 0) > 0, part
    assert split.ms.get("unclassified", 0) < 0.1 * split.busy_ms, split.unclassified
    assert not engine.has_unfinished()
    assert not {"decode_forward", "forward", "decode_inputs"} & set(vars(engine))  # the methods are the class's
    assert not any(m._forward_hooks or m._forward_pre_hooks or "add_and_norm" in vars(m) for m in model.modules())
    table = step_split.format_split(split, 2.0, graphs=False)
    assert "host" in table and "n/a" in table and "unclassified" in table


def _run(capsys, *extra: str) -> str:
    assert rollout.main(["--device", "cpu", "--preset", "tiny", "--requests", "2", "--prompt-len", "4",
                         "--new-tokens", "8", "--peer", "none", *extra]) == 0
    return capsys.readouterr().out


@pytest.fixture
def no_hw_probes(monkeypatch):
    monkeypatch.setattr(rollout, "measure_copy_bandwidth", lambda device: 10e9)  # not 256 MB of copies per test
    monkeypatch.setattr(rollout, "measure_matmul_peak", lambda device, dtype: 1e11)


def test_cpu_bench_prints_the_split_and_the_prefill_floor(capsys, no_hw_probes):
    out = _run(capsys)
    assert "decode step split (CPU): op self time per step over 3 eager steps profiled at 2 rows" in out
    for part in ("experts", "attention", "norms", "router", "dispatch", "sampling", "host"):
        assert f"\n  {part} " in out, part
    assert "prefill, all prompts" in out and "prefill floor: 2 x 4 prompt tokens" in out
    assert "of the floor's speed" in out


def test_no_split_skips_it_and_a_failing_split_costs_one_line(capsys, no_hw_probes, monkeypatch):
    assert "decode step split" not in _run(capsys, "--no-split")

    def broken(*a, **k):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")
    monkeypatch.setattr(step_split, "measure", broken)
    out = _run(capsys)
    assert "decode step split failed, skipped: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED\n" in out
    assert "HBM floor (decode)" in out and "prefill floor" in out
