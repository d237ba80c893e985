"""The whole engine, forward AND backward, P ranks on one device (``tests/helpers/replay_ring``: one rank at
a time on recorded messages, exact, cannot deadlock) vs the float64 reference with the derived bound: every
layout (contiguous, zigzag, striped, DocumentZigzag), GQA, THD with documents, windows, each wire. The
``cpu`` variants run in the fast tier (CI); the ``cuda`` ones where a GPU is (tests/gpu/conftest.py).
Negative control: pass 1 of the replay (remote K/V still placeholders) must be far over the bound."""
import sys

import pytest
import torch

from megatron_ring import DocumentZigzag, ring_attention
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.numerics import Checks, max_err, score_bound, tol
from tests.helpers.reference import feature_reference, outputs_and_grads
from tests.helpers.replay_ring import run_replayed

DEVICES = ["cpu", "cuda"]
# (P, layout, heads, fmt, docs, window, wire)
CASES = [
    (4, "zigzag", (4, 2), "bshd", None, None, None),
    (4, "striped", (4, 4), "bshd", None, None, "bf16"),
    (2, "contiguous", (4, 1), "bshd", None, None, "fp8"),
    (4, "zigzag", (4, 2), "thd", [3, 5, 1, 7], None, None),
    (2, "docs", (4, 2), "thd", [2, 6, 4], None, "bf16"),
    (4, "zigzag", (4, 2), "bshd", None, (24, 0), None),
    (2, "striped", (4, 2), "thd", [5, 3], (8, 0), "fp8"),
]
# attention dropout: (case, dropout_p); the torch dropout kernel on CPU, the fused Triton kernels on CUDA
# (kernels/dropout_triton.py; a device seed there, folded in the kernels)
DROPOUT_CASES = [(CASES[0], 0.1), (CASES[3], 0.2), (CASES[6], 0.3)]


def _global(P, heads, fmt, docs, device, dtype, seed=0, dims=(32, 32)):
    g = torch.Generator().manual_seed(seed)
    d, dv = dims
    T = 2 * P * (sum(docs) if docs else 16)
    lead = (T,) if fmt == "thd" else (1, T)
    q = torch.randn(*lead, heads[0], d, generator=g).to(device, dtype)
    dout = torch.randn(*lead, heads[0], dv, generator=g).to(device, dtype)
    k = torch.randn(*lead, heads[1], d, generator=g).to(device, dtype)
    v = torch.randn(*lead, heads[1], dv, generator=g).to(device, dtype)
    cu = [0] + [2 * P * sum(docs[:i + 1]) for i in range(len(docs))] if docs else None
    return q, k, v, dout, cu


def engine_checks(device, P, layout, heads, fmt, docs, window, wire, dtype=torch.bfloat16, stop_after=None,
                  dropout_p=0.0, dims=(32, 32), kernel="auto"):
    q, k, v, dout, cu = _global(P, heads, fmt, docs, device, dtype, dims=dims)
    lay = DocumentZigzag(cu) if layout == "docs" else get_layout(layout)
    dim = 0 if fmt == "thd" else 1
    T = q.shape[dim]
    pos = [lay.positions(T, P, r).to(device) for r in range(P)]
    kw = dict(causal=True, layout=lay, window=window, comm_dtype=wire, qkv_format=fmt, kernel=kernel)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    drop = dict(dropout_p=dropout_p, seed=2 ** 33 + 5) if dropout_p else {}
    if drop:
        kw.update(dropout_p=dropout_p, dropout_seed=torch.tensor(drop["seed"], device=device))

    def rank(r, ring):
        leaves = [t.index_select(dim, pos[r]).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, ring=ring, **kw)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.index_select(dim, pos[r])))

    results, passes = run_replayed(rank, P, device, max_passes=64, stop_after=stop_after)
    for res in results:
        if isinstance(res, BaseException):
            raise res
    batch = (lambda t: t[None]) if fmt == "thd" else (lambda t: t)
    ref = outputs_and_grads(lambda *t: feature_reference(*(batch(x) for x in t), causal=True, cu=cu, window=window,
                                                         **drop)
                            [0 if fmt == "thd" else slice(None)], *(t.double().cpu() for t in (q, k, v, dout)))
    sigma, n = score_bound(q, k), max(T, *dims)
    checks = Checks(f"engine on {device} P={P} {layout} {fmt} wire={wire} dropout={dropout_p} pass {passes}")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = torch.empty_like(ref[i], dtype=dtype)
        for r in range(P):
            got.index_copy_(dim, pos[r].cpu(), results[r][i].cpu())  # the reference is on CPU
        m = ref[i].abs().max().item()
        checks.add(what, max_err(got, ref[i]), tol(m, dtype=dtype, n=n, sigma=sigma, wire=wire, blocks=2 * P))
    return checks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c).replace(" ", ""))
def test_engine_forward_backward_on_one_device_matches_float64(device, case):
    engine_checks(device, *case).check(min_rows=4)


# head dims the fused CUDA kernels take only zero-padded (kernels/head_dim.py; the engine pads once per ring:
# RingPads): MLA-like (48, 32: V, dO and O padded to 48, on CPU too, whose flash kernel takes one head dim; on CUDA
# torch's flash kernel, named: cuDNN may take them as they are) and 20 (every operand padded to 24 on CUDA), dense,
# documents on the variable-length kernel, a window
PADDED_CASES = [(CASES[0], (48, 32)), (CASES[0], (20, 20)), (CASES[3], (48, 32)), (CASES[4], (20, 20)),
                (CASES[5], (48, 32)), (CASES[1], (20, 20))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dims", PADDED_CASES, ids=lambda c: "-".join(str(x) for x in c).replace(" ", ""))
def test_engine_with_padded_head_dims_matches_float64(device, case, dims):
    kernel = "flash_cuda" if device == "cuda" and dims[0] != dims[1] else "auto"
    engine_checks(device, *case, dims=dims, kernel=kernel).check(min_rows=4)


# MLA head dims on cuDNN as they are, where torch's own SDPA hands them to it (kernels/block.py CudnnKernel,
# unsupported_head_dims): DeepSeek's 192/128 (torch: sm90/sm100, cuDNN 9.11 on), 64/32 and 32/64; dense, packed
# documents (their masked tasks on the variable-length kernel, padded), a window. CUDA only (cuDNN)
MLA_CASES = [(CASES[0], (192, 128)), (CASES[3], (192, 128)), (CASES[0], (64, 32)), (CASES[4], (32, 64)),
             (CASES[5], (64, 32))]


@pytest.mark.parametrize("device", ["cuda"])
@pytest.mark.parametrize("case,dims", MLA_CASES, ids=lambda c: "-".join(str(x) for x in c).replace(" ", ""))
def test_engine_with_mla_head_dims_on_cudnn_as_they_are_matches_float64(device, case, dims):
    from megatron_ring.kernels.block import CudnnKernel

    P, _, heads, fmt, docs = case[:5]
    q, k, v, _, _ = _global(P, heads, fmt, docs, device, torch.bfloat16, dims=dims)
    bhsd = (lambda t: t[None].transpose(1, 2)) if fmt == "thd" else (lambda t: t.transpose(1, 2))
    why = CudnnKernel().unsupported_head_dims(*(bhsd(t.requires_grad_()) for t in (q, k, v)))
    if why:
        pytest.skip(f"cuDNN does not take head dims {dims} as they are here: {why}")
    engine_checks(device, *case, dims=dims, kernel="cudnn").check(min_rows=4)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_unfinished_replay_is_over_the_bound(device):
    checks = engine_checks(device, *CASES[0], stop_after=1)
    assert checks.worst() > 10, checks.rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,p", DROPOUT_CASES, ids=lambda c: "-".join(str(x) for x in c).replace(" ", "")
                         if isinstance(c, tuple) else str(c))
def test_engine_with_dropout_matches_float64(device, case, p):
    """Attention dropout through the engine vs the float64 attention with the same keep mask (the reference draws
    it from kernels/dropout.py ``keep_mask``, the spec of the hash)."""
    engine_checks(device, *case, dropout_p=p).check(min_rows=4)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_dropout_with_another_seed_is_over_the_bound(device, monkeypatch):
    """The reference keyed on another seed: the check fails (the dropout cases are not vacuous)."""
    real = feature_reference
    monkeypatch.setattr(sys.modules[__name__], "feature_reference",
                        lambda *a, seed=None, **kw: real(*a, seed=None if seed is None else seed + 1, **kw))
    checks = engine_checks(device, *DROPOUT_CASES[0][0], dropout_p=DROPOUT_CASES[0][1])
    assert checks.worst() > 1, checks.rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["dense", "thd"])
def test_deterministic_mode_runs_on_flash_and_matches_float64(device, case, monkeypatch):
    """Under torch's strict deterministic mode (Megatron's --deterministic-mode sets it, with
    CUBLAS_WORKSPACE_CONFIG) a deterministic call runs on torch's flash kernels (dense, and variable-length for the
    packed documents), whose backward is deterministic there, and matches float64 as before."""
    from megatron_ring.kernels.block import select_kernel

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        if device == "cuda":
            q = torch.empty(1, 4, 64, 32, device=device, dtype=torch.bfloat16)
            assert select_kernel(q, "auto", deterministic=True).name == "flash_cuda"
        engine_checks(device, *case).check(min_rows=4)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "in-order"])
def test_a_diverging_backward_order_raises_on_every_rank(device, swap, monkeypatch):
    """Two alike calls (one signature), their forwards alike; rank 0 backpropagates them in the other order. The
    backward ring's status (core/backward_check.py: BackwardTag) makes every rank raise RingInputError: on CPU at the
    end of that backward ring, on CUDA at the next call's backward ring (its host copy read with that call's forward
    codes). The call's tag is given as a process group's check gives it (the replay ring has no group).
    Negative control: in order, nothing raises."""
    from megatron_ring import RingInputError
    from megatron_ring import call as call_mod

    real = call_mod._agreed_codec
    monkeypatch.setattr(call_mod, "_agreed_codec", lambda ring, *a, **kw: (real(ring, *a, **kw)[0], 7))

    def rank(r, ring):
        def call(i):
            g = torch.Generator().manual_seed(10 * i + r)
            k = torch.randn(1, 16, 2, 32, generator=g).to(device, torch.bfloat16).requires_grad_()
            return ring_attention(k, k, k, ring=ring, causal=True)

        try:
            outs = [call(0), call(1)]
            for i in ([1, 0] if swap and r == 0 else [0, 1]):
                outs[i].float().sum().backward()
            call(2).float().sum().backward()
        except RingInputError as exc:
            return str(exc)
        return None

    results, _ = run_replayed(rank, 2, device)
    if not swap:
        assert results == [None, None], results
        return
    for r, got in enumerate(results):
        assert isinstance(got, str) and "ran the backward of different calls" in got, (r, got)
        assert f"global rank(s) {1 - r} backpropagated another call" in got, got
