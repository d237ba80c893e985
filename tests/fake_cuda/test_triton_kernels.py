"""The project's Triton kernels (core/merge_triton.py, core/_foreach_kernels.py, and attention with dropout,
kernels/_dropout_kernels.py), checked without a GPU, in the tiers that have Triton (.venv312, .venv-floor):

* semantics: each kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors) against its torch
  reference (the checks of tests/test_merge_fused.py and tests/test_foreach_fused.py, with their bounds), the
  dropout kernels against the float64 attention with the same keep mask (fp16; Triton 3.7's interpreter only:
  tests/helpers/triton_interp.py ``loops_interpreted``);
* compilation: each is compiled the whole way to a cubin for sm_80 (A100) and sm_90 (H100/H200) with Triton's own
  ptxas, in the variants the engine launches (the merge fresh and not, with the status rider and the +inf lse;
  the list op with 4 pairs of mixed dtypes), so an error the interpreter does not see (a type that differs between
  two branches, an op the compiler does not take) fails here, not on the first GPU run. A negative control shows
  that a kernel the compiler refuses fails this check.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.helpers.triton_interp import loops_interpreted, run_interpreted  # noqa: E402

TARGETS = [(80, "sm_80"), (90, "sm_90")]


def test_merge_kernel_in_the_interpreter(monkeypatch):
    from megatron_ring.core.merge_triton import _kernel
    from tests.test_merge_fused import check_triton_against_reference

    run_interpreted(monkeypatch, _kernel, check_triton_against_reference)


def test_list_kernel_in_the_interpreter(monkeypatch):
    from megatron_ring.core.foreach_triton import _kernel
    from tests.test_foreach_fused import check_triton_against_torch

    run_interpreted(monkeypatch, _kernel, check_triton_against_torch)


def _compile(fn, signature: dict, constexprs: dict, arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in constexprs:
        signature[name] = "constexpr"
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32))


def _merge_signature(fn) -> dict:
    bf16 = ("blk_ptr", "st_dst", "st_src")
    return {n: ("*bf16" if n in bf16 else "*fp32") if n.endswith("_ptr") or n.startswith("st_") else "i32"
            for n in fn.arg_names if n not in ("FRESH", "STATUS", "POSINF", "BLOCK_D")}


def _list_signature(fn) -> dict:
    # the backward's adds (fp32 accumulator + bf16 block), a K/V write (bf16 -> bf16), a conversion (fp32 -> bf16),
    # a zeroing (src: the dst itself)
    kinds = {"0": ("*fp32", "*bf16"), "1": ("*bf16", "*bf16"), "2": ("*bf16", "*fp32"), "3": ("*bf16", "*bf16")}
    sig = {}
    for n in fn.arg_names:
        if n in ("N", "BLOCK_R", "BLOCK_C"):
            continue
        if n.startswith(("dst", "src")):
            sig[n] = kinds[n[-1]][0 if n.startswith("dst") else 1]
        else:
            sig[n] = "i64"
    return sig


@pytest.mark.parametrize("arch,name", TARGETS, ids=[t[1] for t in TARGETS])
def test_the_kernels_compile_to_a_cubin(arch, name, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    from megatron_ring.core import foreach_triton, merge_triton

    # made afresh: an interpreter test before this one left interpreted kernels in the caches
    merge_triton._kernel.cache_clear()
    foreach_triton._kernel.cache_clear()
    merge = merge_triton._kernel()
    for fresh in (False, True):
        got = _compile(merge, _merge_signature(merge), {"FRESH": fresh, "STATUS": True, "POSINF": True,
                                                        "BLOCK_D": 128}, arch)
        assert got.asm["cubin"] and name in got.asm["ptx"]
    fn = foreach_triton._kernel()
    got = _compile(fn, _list_signature(fn), {"N": 4, "BLOCK_R": 32, "BLOCK_C": 128}, arch)
    assert got.asm["cubin"] and name in got.asm["ptx"]


def test_a_kernel_the_compiler_refuses_fails_the_check(tmp_path, monkeypatch):
    """Negative control: a value of two types in two branches (the interpreter runs it, the compiler refuses)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from tests.fake_cuda import _bad_kernel

    with pytest.raises(Exception, match="(?i)type|mismatch|yield"):
        _compile(_bad_kernel.bad, {"out": "*fp32", "flag": "i32"}, {"BLOCK": 16}, 90)


_DROPOUT_FLAGS = ("CAUSAL", "MASKED", "RULE_CAUSAL", "WIN_L", "WIN_R", "SEED_PTR", "BM", "BN", "BDQ", "BDV")


def _dropout_signature(fn, dtype: str) -> dict:
    """The attention dropout kernels' arguments: Q, K, V, DO and the outputs O, DQ, DK, DVG in ``dtype``; the lse,
    delta fp32; positions, documents and the seed int64; seed_int i64 (a folded 32-bit seed may exceed i32's
    range); scale, inv_keep fp32; the rest i32."""
    sig = {}
    for n in fn.arg_names:
        if n in _DROPOUT_FLAGS:
            continue
        if n in ("Q", "K", "V", "DO", "O", "DQ", "DK", "DVG"):
            sig[n] = f"*{dtype}"
        elif n in ("L", "DELTA"):
            sig[n] = "*fp32"
        elif n in ("QPOS", "KPOS", "MQPOS", "MKPOS", "QDOC", "KDOC", "SEED"):
            sig[n] = "*i64"
        elif n == "seed_int":
            sig[n] = "i64"
        elif n in ("scale", "inv_keep"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig


@pytest.mark.parametrize("arch,name", TARGETS, ids=[t[1] for t in TARGETS])
def test_the_dropout_kernels_compile_to_a_cubin(arch, name, tmp_path, monkeypatch):
    """The attention dropout kernels (kernels/_dropout_kernels.py: forward, dK/dV, dQ, delta) in bf16 and fp16,
    plain causal and masked (documents, causal rule, both window edges, a device seed), head dims 128 and 192
    (MLA's): Triton's interpreter computes no bf16 products (numpy has no bf16), so the bf16 variants are checked
    here only."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from megatron_ring.kernels import dropout_triton

    dropout_triton._kernels.cache_clear()
    variants = [
        ("bf16", dict(CAUSAL=True, MASKED=False, RULE_CAUSAL=False, WIN_L=False, WIN_R=False, SEED_PTR=False,
                      BM=64, BN=64, BDQ=128, BDV=128)),
        ("fp16", dict(CAUSAL=False, MASKED=True, RULE_CAUSAL=True, WIN_L=True, WIN_R=True, SEED_PTR=True,
                      BM=32, BN=32, BDQ=256, BDV=128)),
    ]
    for fn in dropout_triton._kernels():
        for dtype, flags in variants:
            got = _compile(fn, _dropout_signature(fn, dtype), {n: x for n, x in flags.items() if n in fn.arg_names},
                           arch)
            assert got.asm["cubin"] and name in got.asm["ptx"]
    dropout_triton._kernels.cache_clear()


def _dropout_reference(q, k, v, causal, scale, qpos, kpos, mask, spec, dout):
    """float64 attention of one block with the keep mask of :func:`keep_mask` (the spec of the hash), its lse
    (of the undropped scores) and the gradients of ``(out * dout).sum()``."""
    from megatron_ring.kernels.dropout import keep_mask

    b, h, m, _ = q.shape
    g = h // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    vis = torch.ones(m, k.shape[2], dtype=torch.bool)
    if causal:
        vis = vis.tril()
    if mask is not None:
        vis &= mask.allowed()
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1)).nan_to_num(nan=0.0)
    rows = (torch.arange(b)[:, None] * spec.heads + spec.head_offset + torch.arange(h)[None, :]).flatten()
    keep = keep_mask(spec.seed, rows, qpos, kpos, spec.p).view(b, h, m, -1)
    out = (p * keep / (1.0 - spec.p)) @ vd.repeat_interleave(g, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad


def _dropout_cases():
    from megatron_ring.kernels.dropout import DropoutSpec
    from megatron_ring.schedules.masks import AttentionMask, BlockMask, doc_ids

    g = torch.Generator().manual_seed(5)
    h16 = torch.float16
    cases = []
    # dense causal, GQA 4:2, q a strided view, an int seed over 2**32, heads offset in a larger call
    q = torch.randn(2, 40, 4, 32, generator=g).to(h16).transpose(1, 2)
    k, v = torch.randn(2, 2, 40, 32, generator=g).to(h16), torch.randn(2, 2, 40, 16, generator=g).to(h16)
    cases.append(("causal-gqa-strided", q, k, v, True, torch.arange(40) * 3 + 5, torch.arange(40) * 3 + 5, None,
                  DropoutSpec(p=0.3, seed=2 ** 40 + 3, heads=8, seq_len=200, head_offset=2)))
    # full, fewer rows than keys, a negative int32 device seed (folded in the kernel)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(h16) for n in (24, 72, 72))
    cases.append(("full-rows-lt-keys-tensor-seed", q, k, v, False, torch.arange(24) + 100, torch.arange(72), None,
                  DropoutSpec(p=0.5, seed=torch.tensor([-5], dtype=torch.int32), heads=2, seq_len=200)))
    # an explicit mask on a whole block: documents (padding rows that see nothing), the causal rule and a window on
    # striped positions; 2 x 2 tiles of 64, two of them with no visible pair (skipped)
    qpos, kpos = torch.arange(128) * 2 + 1, torch.arange(128) * 2
    rule = AttentionMask(causal=True, cu_seqlens=(0, 11, 40, 62, 180, 250), window=(9, 0))
    mask = BlockMask(rule, qpos, doc_ids(qpos, rule.cu_seqlens), kpos, doc_ids(kpos, rule.cu_seqlens))
    q, k, v = (torch.randn(1, 2, 128, 16, generator=g).to(h16) for _ in range(3))
    cases.append(("documents-window-padding", q, k, v, False, qpos, kpos, mask,
                  DropoutSpec(p=0.2, seed=11, heads=2, seq_len=256)))
    return cases


@pytest.mark.skipif(not loops_interpreted(), reason="this Triton's interpreter runs no loop with a runtime bound "
                    "(tests/helpers/triton_interp.py); the kernels compile on it (test_the_dropout_kernels_compile...)")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dropout_kernels_in_the_interpreter(monkeypatch):
    """The fused dropout kernels (fp16, interpreted) against the float64 block attention with the same keep mask:
    output, lse, dQ, dK, dV within the derived bound; edge cases: GQA, a strided q, fewer rows than keys, int and
    device seeds (over 2**32, negative int32), a mask with documents, padding rows, the causal rule and a window.
    Negative control: the same kernels keyed on another seed miss the bound."""
    from megatron_ring.kernels import dropout_triton
    from megatron_ring.kernels.dropout import FusedDropoutKernel
    from tests.helpers.numerics import grad_terms, max_err, score_bound, tol

    def check():
        for name, q, k, v, causal, qpos, kpos, mask, spec in _dropout_cases():
            scale = q.shape[-1] ** -0.5
            dout = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(1)).to(q.dtype)
            ref = _dropout_reference(q, k, v, causal, scale, qpos, kpos, mask, spec, dout)
            for seed_shift, must_pass in ((0, True), (1, False)):
                kern = FusedDropoutKernel(spec if not seed_shift else type(spec)(
                    p=spec.p, seed=int(spec.seed) + 1, heads=spec.heads, seq_len=spec.seq_len,
                    head_offset=spec.head_offset))
                out, lse = kern.forward(q, k, v, causal, scale, mask=mask, qpos=qpos, kpos=kpos)
                grads = kern.backward(dout, q, k, v, out, lse, causal, scale, mask=mask, qpos=qpos, kpos=kpos)
                bounds = dict(dtype=q.dtype, n=k.shape[2], sigma=score_bound(q, k, scale))
                # dS = P (dP z - D): a kept dP_ij is scaled by 1 / (1 - p), so are the terms dQ and dK sum
                gmax = grad_terms(q, k, v, dout, scale, n=q.shape[2]) / (1.0 - spec.p)
                errs = {"out": (max_err(out, ref[0]), tol(ref[0].abs().max().item(), **bounds))}
                finite = torch.isfinite(ref[1])
                errs["lse"] = (max_err(lse[finite], ref[1][finite]), tol(1.0 + ref[1][finite].abs().max().item(),
                                                                        **bounds))
                errs["lse -inf"] = (0.0 if torch.equal(torch.isinf(lse), ~finite) else float("inf"), 0.0)
                for what, got, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
                    m = max(want.abs().max().item(), gmax if what != "dv" else 0.0)
                    errs[what] = (max_err(got, want), tol(m, **bounds))
                ok = all(e <= b for e, b in errs.values())
                assert ok == must_pass, (name, seed_shift, errs)
                if isinstance(spec.seed, torch.Tensor):
                    break  # (the shifted seed is an int: the device-seed case has no negative control of its own)

    run_interpreted(monkeypatch, dropout_triton._kernels, check)


def _compiled_mode_kernels(monkeypatch, tmp_path) -> tuple:
    """The dropout kernels made afresh for the compiler (an interpreted test of this process may have left
    interpreter functions behind: kernels/dropout_triton.py ``_kernels`` reloads their module), forgotten after."""
    from megatron_ring.kernels import dropout_triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dropout_triton._kernels.cache_clear()
    got = dropout_triton._kernels()
    dropout_triton._kernels.cache_clear()
    return got


@pytest.fixture(scope="module")
def launch_cache(tmp_path_factory):
    """One Triton cache for the seeds' compiles below: Triton keys a compiled kernel on its source, target and the
    launch's specialisation, so a seed that a launch specialises like an earlier one reuses its kernels, and a seed
    specialised otherwise (the bug below) compiles afresh."""
    return tmp_path_factory.mktemp("triton-launch-cache")


@pytest.mark.parametrize("seed", [1, 2 ** 32, 5 * 2 ** 32 + 4, 2, -7], ids=lambda s: f"seed{s}")
def test_the_dropout_launchers_compile_as_a_launch_specialises_them(seed, launch_cache, monkeypatch):
    """Through the real launchers (forward and backward, causal and masked), compiled for sm_90 with the argument
    specialisation a GPU launch makes (tests/helpers/triton_launch.py). A seed whose 32-bit fold is 1 (seed 1,
    2**32, ...) reached the kernels as a constexpr int, and its ``.to`` failed to compile: every such seed failed
    on a GPU until the seed argument was kept unspecialised."""
    from megatron_ring.kernels import dropout_triton
    from megatron_ring.kernels.dropout import DropoutSpec, FusedDropoutKernel
    from megatron_ring.schedules.masks import AttentionMask, BlockMask
    from tests.helpers.triton_launch import CompilingKernel

    compiled: list = []
    kernels = tuple(CompilingKernel(f, 90, compiled) for f in _compiled_mode_kernels(monkeypatch, launch_cache))
    monkeypatch.setattr(dropout_triton, "_kernels", lambda: kernels)
    q = k = v = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    kern = FusedDropoutKernel(DropoutSpec(p=0.1, seed=seed, heads=2, seq_len=64))
    pos = torch.arange(64)
    rule = AttentionMask(True, (0, 20, 64), (16, 0))
    mask = BlockMask(rule, pos, rule.doc_ids(pos), pos, rule.doc_ids(pos))
    for causal, m in ((True, None), (False, mask)):
        args = kern._args(q, causal, 0.125, m, pos, pos)
        dropout_triton.dropout_attention_forward(q, k, v, *args)
        dropout_triton.dropout_attention_backward(q, q, k, v, q, lse, *args)
    names = [name for name, got in compiled if got.asm["cubin"]]
    assert sorted(set(names)) == ["dropout_bwd_kv", "dropout_bwd_q", "dropout_delta", "dropout_fwd"], names


def test_the_launch_compile_check_is_not_vacuous(tmp_path, monkeypatch):
    """Negative control: the forward kernel jitted again WITH the seed specialised fails to compile for seed 1,
    as it did on a GPU."""
    from triton.runtime.jit import JITFunction

    from megatron_ring.kernels import dropout_triton
    from megatron_ring.kernels.dropout import DropoutSpec, FusedDropoutKernel
    from tests.helpers.triton_launch import CompilingKernel

    specialised = JITFunction(_compiled_mode_kernels(monkeypatch, tmp_path)[0].fn)
    kernels = (CompilingKernel(specialised, 90, []),)
    monkeypatch.setattr(dropout_triton, "_kernels", lambda: kernels)
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    kern = FusedDropoutKernel(DropoutSpec(p=0.1, seed=1, heads=2, seq_len=64))
    with pytest.raises(Exception, match=r"_seed\(SEED, seed_int"):
        dropout_triton.dropout_attention_forward(q, q, q, *kern._args(q, True, 0.125, None, torch.arange(64),
                                                                       torch.arange(64)))


def test_a_float64_list_takes_torchs_ops_not_the_fp32_kernel(monkeypatch):
    """The list kernel computes in fp32 (core/_foreach_kernels.py): a float64 destination on CUDA (fp64 inputs run
    on the math kernel there) takes torch's ops, so a copy or add keeps fp64's precision; fp32/bf16 lists keep the
    kernel (the negative control)."""
    from megatron_ring import device
    from megatron_ring.core import foreach
    from tests.helpers.fake_device import FakeCuda
    from torch._subclasses.fake_tensor import FakeTensorMode

    took: list = []
    real = foreach.foreach_reference
    monkeypatch.setattr(foreach, "foreach_reference", lambda d, s, m: (took.append(d[0].dtype), real(d, s, m)))
    monkeypatch.setattr(foreach, "foreach_triton", lambda d, s, m: took.append("kernel"))
    monkeypatch.setattr(foreach, "route", lambda *t: foreach.DIRECT)
    with device.use("cuda", FakeCuda()), FakeTensorMode():
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            dst, src = (torch.empty(4, 8, device="cuda", dtype=dtype) for _ in range(2))
            foreach.foreach_into([dst], [src], add=True)
    assert took == [torch.float64, "kernel", "kernel"], took


def test_the_merge_and_list_launchers_compile_as_a_launch_specialises_them(tmp_path, monkeypatch):
    """The merge and the list op through their launchers, compiled for sm_80 and sm_90 with a launch's argument
    specialisation (sizes and strides of 1 become constants): one row, one head, head dim 1, fresh and not, the
    status rider, +inf lse; the list op's four modes over mixed dtypes and size-1 dims."""
    from megatron_ring.core import foreach_triton as F
    from megatron_ring.core import merge_triton as M
    from tests.helpers.triton_launch import CompilingKernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    M._kernel.cache_clear()
    F._kernel.cache_clear()
    merge, lists = M._kernel(), F._kernel()
    M._kernel.cache_clear()
    F._kernel.cache_clear()
    for arch in (80, 90):
        compiled: list = []
        monkeypatch.setattr(M, "_kernel", lambda: CompilingKernel(merge, arch, compiled))
        monkeypatch.setattr(F, "_kernel", lambda: CompilingKernel(lists, arch, compiled))
        for shape, fresh, posinf in (((1, 1, 1, 1), True, False), ((1, 1, 1, 8), False, True),
                                     ((2, 4, 16, 64), False, False), ((1, 3, 5, 128), True, True)):
            acc, blk = torch.zeros(shape), torch.zeros(shape, dtype=torch.bfloat16)
            lse, blk_lse = torch.zeros(shape[:3]), torch.zeros(shape[:3])
            st = (torch.zeros(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.bfloat16))
            M.merge_triton(acc, lse, blk.transpose(1, 2).contiguous().transpose(1, 2), blk_lse, fresh, status=st,
                           posinf_empty=posinf)
        for dims in ((1, 1, 1, 1), (2, 1, 3, 8), (1, 4, 16, 64)):
            dsts = [torch.zeros(dims), torch.zeros(dims, dtype=torch.bfloat16), torch.zeros(dims),
                    torch.zeros(dims)]
            srcs = [torch.zeros(dims, dtype=torch.bfloat16), torch.zeros(dims), None, torch.zeros(dims)]
            F.foreach_triton(dsts, srcs, [F.ADD, F.COPY, F.ZERO, F.FLIP])
        for status in (torch.uint8, torch.bfloat16):  # a backward step's adds with its status receipt (one element)
            accs = [torch.zeros(2, 4, 16, 64) for _ in range(3)]
            blocks = [torch.zeros(2, 4, 16, 64, dtype=torch.bfloat16) for _ in range(3)]
            F.foreach_triton(accs + [torch.zeros(1, dtype=status)], blocks + [torch.ones(1, dtype=status)],
                             [F.ADD] * 3 + [F.COPY])
        assert len(compiled) == 9 and all(got.asm["cubin"] for _, got in compiled), (arch, len(compiled))


def _fp8_rows(g: torch.Generator, b: int, h: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Token rows' max |x| with the cases the scale rule has: zeros, fp32 subnormals, tiny and huge values, values at
    and around 1.75 * 2**k (where the exponent steps), inf and NaN."""
    base = torch.rand(b, h, n, generator=g) * 10.0 ** torch.randint(-30, 30, (b, h, n), generator=g).float()
    special = torch.tensor([0.0, 1e-40, 3e-39, 1.1754942e-38, 448.0, 448.00003, 447.99997, 0.875, 1.75, 3.5, 3e38,
                            float("inf"), float("nan")])
    pick = torch.rand(b, h, n, generator=g) < 0.3
    base[pick] = special[torch.randint(0, len(special), (int(pick.sum()),), generator=g)]
    if dtype != torch.float32:
        base = base.to(dtype)
    return base


@pytest.mark.skipif(not loops_interpreted(), reason="this Triton's interpreter runs no loop with a runtime bound")
def test_fp8_scale_kernel_in_the_interpreter_is_the_codecs_rule(monkeypatch):
    """The FP8 wire's scale kernel (wire/fp8_triton.py) against the codec's rule (``fp8_scales_reference``, the
    float64 frexp/ldexp chain): scales, per-token reciprocals and verdicts bit for bit (NaN where they are), for fp32,
    bf16 and fp16 row maxima, groups of 1, 7, 64 and longer than the block, e4m3 and e5m2, a strided scale view."""
    from megatron_ring.wire import fp8_triton
    from tests.helpers.triton_interp import run_interpreted

    g = torch.Generator().manual_seed(5)

    def check():
        for case in range(24):
            dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 3]
            b, h, n = 1 + case % 2, 1 + case % 3, int(torch.randint(1, 150, (1,), generator=g))
            group = (1, 7, 64, 200)[case % 4]
            emax = (8, 15)[case % 2]
            rows = _fp8_rows(g, b, h, n, dtype)
            gs = max(1, -(-n // group))
            want_s, got_s = torch.zeros(b, h, gs), torch.zeros(b, h, 2 * gs)[..., ::2]  # a strided view
            want_inv, want_bad = fp8_triton.fp8_scales_reference(rows, want_s, group, emax)
            got_inv, got_bad = fp8_triton.fp8_scales(rows, got_s, group, emax)
            bits = lambda t: t.view(torch.int32)  # noqa: E731 - NaN payloads compare too
            assert torch.equal(bits(got_s.contiguous()), bits(want_s)), (case, got_s, want_s)
            assert torch.equal(bits(got_inv), bits(want_inv)), case
            assert torch.equal(got_bad, want_bad), case

    run_interpreted(monkeypatch, fp8_triton._kernel, check)


@pytest.mark.skipif(not loops_interpreted(), reason="this Triton's interpreter runs no loop with a runtime bound")
@pytest.mark.parametrize("wire, group", [("fp8", 64), ("fp8", None), ("fp8_e5m2", 1)])
def test_fp8_wire_bytes_with_the_scale_kernel_are_the_torch_paths(monkeypatch, wire, group):
    """The whole FP8 encode (``encode_flagged``: the device check's path) with the scale kernel (interpreted, on CPU
    tensors) writes the same wire bytes and verdict as the codec's torch ops; a K with inf is refused by both.
    Negative control: a scale rule off by one power differs."""
    from megatron_ring.wire import codecs, fp8_triton
    from megatron_ring.wire.codecs import FP8Codec, KVSpec
    from tests.helpers.triton_interp import run_interpreted

    g = torch.Generator().manual_seed(7)
    dtype = torch.float8_e4m3fn if wire == "fp8" else torch.float8_e5m2
    plain, fused = FP8Codec(dtype, group_tokens=group), FP8Codec(dtype, group_tokens=group)
    fused.launch_rule = lambda *t: True
    monkeypatch.setattr(FP8Codec, "_fused", lambda self, x: self.launch_rule is not None)

    def encode(codec, k, v):
        buf = codec.new_buffer(KVSpec(tuple(k.shape), tuple(v.shape), k.dtype, k.device))
        verdict = codec.encode_flagged(k, v, buf)
        return buf, verdict

    # tokens per row: groups of one token are one interpreted program each, so that case takes fewer (still
    # several groups per block and a tail)
    n = 100 if group != 1 else 21

    def check():
        for bad in (False, True):
            k = torch.randn(2, 3, n, 64, generator=g).to(torch.bfloat16) * 30
            v = torch.randn(2, 3, n, 48, generator=g).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
            if bad:
                k[1, 2, n * 3 // 4, 5] = float("inf")
            (want, w_flag), (got, g_flag) = encode(plain, k, v), encode(fused, k, v)
            assert bool(w_flag) == bool(g_flag) == bad
            assert torch.equal(got, want), (bad, (got != want).sum())
        real = fp8_triton.fp8_scales_reference
        monkeypatch.setattr(codecs, "fp8_scales", lambda r, s, gr, e: real(r, s, gr, e + 1))
        k = torch.randn(1, 2, 64, 32, generator=g).to(torch.bfloat16)
        assert not torch.equal(encode(fused, k, k)[0], encode(plain, k, k)[0])

    run_interpreted(monkeypatch, fp8_triton._kernel, check)


def test_the_fp8_scale_launcher_compiles_as_a_launch_specialises_it(tmp_path, monkeypatch):
    """The FP8 scale kernel through its launcher for sm_80 and sm_90 with a launch's specialisation: fp32, bf16 and
    fp16 row maxima (three load modes), one token, one head, a group of 1 and one longer than the block."""
    from megatron_ring.wire import fp8_triton
    from tests.helpers.triton_launch import CompilingKernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fp8_triton._kernel.cache_clear()
    kernel = fp8_triton._kernel()
    fp8_triton._kernel.cache_clear()
    for arch in (80, 90):
        compiled: list = []
        monkeypatch.setattr(fp8_triton, "_kernel", lambda: CompilingKernel(kernel, arch, compiled))
        for dtype, (b, h, n), group in ((torch.float32, (1, 1, 1), 1), (torch.bfloat16, (2, 3, 100), 64),
                                        (torch.float16, (1, 2, 300), 200)):
            g = -(-n // group)
            fp8_triton.fp8_scales(torch.zeros(b, h, n, dtype=dtype), torch.zeros(b, h, g), group, 8)
        assert len(compiled) == 3 and all(got.asm["cubin"] for _, got in compiled)
