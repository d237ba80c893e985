"""The benchmark CLI's own logic on a tiny problem: modes interleaved, paired ratios, the ideal split,
the breakdown per piece count. Times mean nothing here (speed claims live in the CLI's output)."""
import pytest

from megatron_ring_lab.bench import main as benchmark

pytestmark = pytest.mark.slow

TINY = ["--seq", "64", "--heads", "4", "--head-dim", "8", "--iters", "2", "--no-limit", "--timeout", "120"]


def test_rows_have_paired_ratios_and_the_ideal_split():
    rows = benchmark.main(["--world-sizes", "2", "--kv-pieces", "auto", "2"] + TINY)
    assert [r["kv_pieces"] for r in rows] == ["auto", 2]
    for r in rows:
        assert r["split_fwd_bwd_s"] > 0 and r["split_efficiency"] > 0
        assert r["overlap_overhead_fwd_bwd"] > -1 and "ring_peak_mib_per_rank" in r
    # 2 pieces send one status lead more per step than 1 (16 bytes: the status element and padding; auto here:
    # tiny, whole blocks)
    assert rows[1]["bytes_fwd_per_rank"] == rows[0]["bytes_fwd_per_rank"] + 16


def test_interleaved_rotates_the_order():
    seen = []
    modes = {m: ((lambda m=m: seen.append((m, 0))), (lambda m=m: seen.append((m, 1)))) for m in "abc"}
    times = benchmark._interleaved(modes, 2, lambda: None)
    assert seen == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1),
                    ("b", 0), ("c", 0), ("a", 0), ("b", 1), ("c", 1), ("a", 1)]
    assert all(len(t) == 2 for t in times.values())


def test_breakdown_one_table_per_piece_count():
    rows = benchmark.main(["--breakdown", "--world-sizes", "2", "--kv-pieces", "1", "2"] + TINY)
    assert [r["kv_pieces"] for r in rows] == [1, 2]
    for r in rows:
        assert any(k.endswith("|kernel") for k in r["mean"])
        # every exchange launch is timed (a real gloo ring: step 0 starts the first K/V hop)
        assert r["mean"].get("fwd|0|launch", 0.0) > 0, r["mean"]
        assert 0 <= r["other_s"] < r["total_s"]  # each rank's own untimed rest (timed regions never nest)


def test_host_time_row_fits_per_step_and_fixed():
    from megatron_ring_lab.bench import host_time

    rows = benchmark.main(["--host-time", "--world-sizes", "2", "3", "--block-len", "8", "--heads", "2",
                           "--head-dim", "8", "--iters", "3"])
    assert [r["causal"] for r in rows] == [False, True]
    for r in rows:
        assert set(r["call_s"]) == {"2", "3"} and all(t > 0 for t in r["call_s"].values())
        # two points: the fit goes through both
        assert r["fixed_s"] + r["per_step_s"] * 4 == pytest.approx(r["call_s"]["2"])
        assert r["fixed_s"] + r["per_step_s"] * 6 == pytest.approx(r["call_s"]["3"])
    assert host_time.fit({2: 1.0, 4: 2.0, 6: 3.0}) == pytest.approx((0.25, 0.0))


def test_layer_host_time_row_times_the_layer_and_the_bare_call():
    rows = benchmark.main(["--layer-host-time", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--iters", "20"])
    (r,) = rows
    assert r["layer_s"] > 0 and r["ring_s"] > 0 and r["glue_s"] == pytest.approx(r["layer_s"] - r["ring_s"])
    assert len(r["outputs_sha256"]) == 64 and (r["heads"], r["kv_heads"]) == (2, 1)


def test_layer_host_time_row_on_a_packed_batch():
    """``--layer-packed``: the layer on a packed THD batch, the later layers (same params) and the first (new)."""
    rows = benchmark.main(["--layer-host-time", "--layer-packed", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                           "--iters", "20"])
    (r,) = rows
    assert r["packed"] and r["seq"] == 64 and r["first_layer_s"] > 0 and r["layer_s"] > 0
    assert r["first_glue_s"] == pytest.approx(r["first_layer_s"] - r["ring_s"])


def test_instant_kernel_leaves_the_engine_running_unchanged():
    """The host-time row's kernel does nothing, yet the engine runs its whole schedule: every merge,
    wire copy and gradient add happens (zero kernel results give zero gradients; the ring's bytes move)."""
    import torch

    from megatron_ring import ring_attention
    from megatron_ring_lab.bench.host_time import InstantKernel
    from megatron_ring.transport.ring import LoopbackRing

    ring = LoopbackRing(4, 1, torch.device("cpu"))
    q, k, v = (torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3))
    ring_attention(q, k, v, causal=True, ring=ring, kernel=InstantKernel()).sum().backward()
    assert ring.bytes_sent["fwd_kv"] > 0 and ring.bytes_sent["bwd_dkv"] > 0
    assert not q.grad.any() and not k.grad.any()


def test_torch_ring_row_agrees_and_pairs_ratios():
    """Ours vs PyTorch's ring: both rings compute the same attention on the same shards (fp32 rounding),
    and every ratio / memory column is filled."""
    rows = benchmark.main(["--torch-ring", "--world-sizes", "2", "--seq", "64", "--heads", "2", "--head-dim", "8",
                           "--iters", "2", "--timeout", "300"])
    assert [(r["P"], r["causal"]) for r in rows] == [(2, True), (2, False)]
    for r in rows:
        # |out| <= max|v| ~ 4 for these normal inputs; two fp32 merges of 32 keys differ by a few ulps
        assert r["max_abs_diff"] < 64 * torch_eps()
        for m in ("torch (views)", "torch (BHSD)"):
            assert r[f"ours/{m}"] > 0 and r[f"cpu ours/{m}"] > 0 and r[f"{m}_mib"] >= 0


def torch_eps() -> float:
    import torch

    return torch.finfo(torch.float32).eps


def test_gpu_row_runs_on_cpu_dense_and_packed():
    """The GPU row's logic (every rank's schedule on one device vs one-device attention; packed documents vs a
    per-document reference) on CPU, tiny: the fields are there and the packed mix is a real one."""
    import torch

    from megatron_ring_lab.bench.gpu import gpu_row, packed_lengths

    lens = packed_lengths(4096)
    assert sum(lens) == 4096 and max(lens) <= 1024 and len(lens) > 8
    for docs in (False, True):
        row = gpu_row(2, 256, 4, 2, 16, torch.float32, iters=1, docs=docs, device="cpu")
        assert row["efficiency"] > 0 and row["host_ms"] > 0 and row["tokens_per_rank"] == 128
        assert row["layout"] == ("striped" if docs else "zigzag") and (row["docs"] > 1) == docs
        assert row["reference"] == ("per-document sdpa" if docs else "sdpa")
        assert row["launches"] is None and row["peak_gib"] is None  # CUDA only
        # the host split: the forward and the backward apart, the attention ops' host time apart from the others'
        assert row["host_ms_forward"] > 0 and row["host_ms_backward"] > 0
        assert row["host_ms_attention_ops"] > 0 and row["host_ms_other_ops"] > 0 and row["host_ms_ours"] > 0
        assert row["host_ms_triton"] == 0 and row["host_ops"] > 10  # no Triton on CPU


def test_gpu_row_on_megatrons_per_document_zigzag_runs_on_cpu():
    """``layout="doc-zigzag"`` (``--gpu-docs-layouts doc-zigzag``): the packed row in Megatron's per-document order,
    documents padded to multiples of 2P, a new mix (and layout) per call for ``host_ms_new_documents``; refused by
    name without packed documents."""
    import pytest
    import torch

    from megatron_ring_lab.bench.gpu import gpu_row

    row = gpu_row(2, 256, 4, 2, 16, torch.float32, "doc-zigzag", iters=1, docs=True, device="cpu")
    assert row["layout"] == "doc-zigzag" and row["docs"] > 1 and row["efficiency"] > 0
    assert row["host_ms_new_documents"] > 0 and row["reference"] == "per-document sdpa"
    with pytest.raises(ValueError, match="add --gpu-docs"):
        gpu_row(2, 256, 4, 2, 16, torch.float32, "doc-zigzag", iters=1, device="cpu")


def test_gpu_row_with_mla_head_dims_runs_on_cpu():
    """``v_head_dim`` (``--v-head-dim``): V of another head dim, dense; a packed row with it is refused by name."""
    import pytest
    import torch

    from megatron_ring_lab.bench.gpu import gpu_row

    row = gpu_row(2, 128, 4, 2, 24, torch.float32, iters=1, device="cpu", v_head_dim=16)
    assert (row["head_dim"], row["v_head_dim"]) == (24, 16) and row["efficiency"] > 0
    with pytest.raises(ValueError, match="drop --v-head-dim or --gpu-docs"):
        gpu_row(2, 128, 4, 2, 24, torch.float32, iters=1, device="cpu", v_head_dim=16, docs=True)


def test_gpu_row_host_kinds():
    """The host split's kinds, on the entries cProfile gives: an attention op apart from other torch ops, Triton's
    Python and its launcher (a built-in only Triton calls), this library's Python apart from the lab's and the
    rest; a built-in that is no torch op (``isinstance``) is Python."""
    from megatron_ring_lab.bench.gpu import host_kind

    torch_op = "<built-in method torch._ops.aten._scaled_dot_product_cudnn_attention>"
    assert host_kind("~", torch_op) == "attention_ops"
    assert host_kind("~", "<method 'copy_' of 'torch._C.TensorBase' objects>") == "other_ops"
    assert host_kind("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>") == "other_ops"
    assert host_kind("/x/site-packages/triton/runtime/jit.py", "run") == "triton"
    assert host_kind("~", "<built-in method launch>", ["/x/triton/backends/nvidia/driver.py"]) == "triton"
    assert host_kind("~", "<built-in method builtins.isinstance>", ["/w/megatron_ring/core/engine.py"]) == "python"
    assert host_kind("/w/megatron_ring/core/engine.py", "ring_forward") == "ours"
    # this library's launchers of Triton kernels are its own Python, not Triton's (counted as Triton before)
    assert host_kind("/w/megatron_ring/core/foreach_triton.py", "_launch") == "ours"
    assert host_kind("/w/megatron_ring/triton_launch.py", "__call__") == "ours"
    assert host_kind("~", "<built-in method builtins.len>", ["/w/megatron_ring/core/merge_triton.py"]) == "python"
    assert host_kind("/w/lab/megatron_ring_lab/bench/gpu.py", "step") == "python"
    assert host_kind("/x/site-packages/torch/autograd/function.py", "apply") == "python"


def test_gpu_row_kernel_kinds():
    """The GPU row's kernel breakdown sorts CUDA kernel names (as torch's profiler reports them on an H100/H200)
    into attention, the fused merge, the list op, copies and other; a reduction is other, not attention."""
    from megatron_ring_lab.bench.gpu import KERNEL_KINDS, kernel_kind

    names = {
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t> >": "attention",
        "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
        "_merge_kernel": "merge",
        "foreach_kernel": "lists",
        "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": "copies",
        "Memcpy DtoD (Device -> Device)": "copies",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor": "other",
    }
    for name, kind in names.items():
        assert kernel_kind(name) == kind, name
    assert set(names.values()) == set(KERNEL_KINDS)


def test_window_compute_rows_run_the_engines_block_calls():
    """``--window --window-compute``: every rank's block tasks through ``RingPlan.forward_block`` /
    ``backward_block`` in one process (the plan's own calls, so a change of their contract shows here)."""
    from megatron_ring_lab.bench.documents import run_window_compute

    rows = run_window_compute(2, 64, dict(heads=2, head_dim=8, layouts=["striped"]), reps=1)
    assert {r["case"] for r in rows} >= {"full causal"} and all(r["compute_ms"] > 0 for r in rows)


def test_plan_time_row_plans_new_mixes_on_every_rank():
    """``--plan-time``: the planning of a new document layout (tasks and segment plans, whole blocks), the slowest
    rank, a new mix each time; both mixes fill the stream; the CLI gives a row per size and mix."""
    from megatron_ring_lab.bench import plan_time as pt
    from megatron_ring_lab.benchmark import main

    for mix in pt.MIXES.values():
        assert sum(mix(4096, seed=2)) == 4096
    assert len(pt.short_lengths(8192)) > len(pt.packed_lengths(8192))
    row = pt.plan_times(2, 256, mixes=2)
    assert row["plan_ms"] > 0 and len(row["plan_ms_mixes"]) == 2 and row["docs"] > 1
    assert row["masked"] >= 1 and row["planned"] == row["masked"]  # every masked task has a segment plan
    assert "| 2 | 256 | striped | web |" in pt.format_plan_time([row])
    tiles = pt.plan_times(2, 256, mixes=1, whole=False)  # the CPU engine's tile schedules: no segment plans
    assert tiles["masked"] >= row["masked"] and tiles["planned"] == 0 and not tiles["whole"]
    rows = main(["--plan-time", "--world-sizes", "1", "2", "--tokens-per-rank", "128", "--iters", "1"])
    assert [(r["P"], r["mix"], r["layout"]) for r in rows] == [(2, "web", "striped"), (2, "short", "striped")]
