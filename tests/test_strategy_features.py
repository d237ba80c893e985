"""Attention sinks, positional dropout and in-band refusal of bad input on EVERY comm type.

Sinks/dropout: one set of 4 gloo processes runs, for all_gather, a2a (h=4: one head per rank) and
a2a+p2p (2x2) (p2p: tests/test_model_features.py; auto runs one of these), a few cases (learnable sink
with GQA; dropout with a sink, MLA head dims and head_chunks=2 in sbhd; dropout with documents + window)
on causal zigzag and non-causal striped, against the float64 reference of ``tests/helpers/reference.py`` (outputs, dq/dk/dv and the sink gradient
summed over the group; the derived bound of tests/helpers/numerics.py), and with dropout also against the
same call at CP=1 (a loopback ring in the same process): the keep/drop decisions are keyed on global heads
and positions, so CP=4 with any comm type equals CP=1 up to fp32 summation order (twice the bound).

Bad input: rank 2 alone has a NaN in K (fp8 wire, which refuses it) or a rank-local input error (a
non-contiguous head dim, or a kernel its device cannot run): for every comm type every rank raises promptly (well under the ring timeout),
the others naming global rank 2, and the group stays usable afterwards.
"""
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import run_distributed
from tests.helpers.reference import feature_reference, sink_weight
from tests.helpers.numerics import Checks, max_err, score_bound, sink_grad_scale, tol
from megatron_ring import ring_attention, shard_sequence
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring.strategies import make_hierarchical_groups

TYPES = ("all_gather", "a2a", "a2a+p2p", "auto")  # auto: the bad-input test (its choice is made on every rank)
FEATURE_TYPES = TYPES[:3]
# (name, h, h_kv, sink, dropout_p, head_chunks, fmt, docs, dtype, (d_qk, d_v))
CASES = [
    ("sink learnable gqa", 4, 2, "learn", 0.0, 1, "bshd", False, torch.float32, (8, 8)),
    ("sink off-by-one bf16", 4, 2, 0.0, 0.0, 1, "bshd", False, torch.bfloat16, (8, 8)),
    ("dropout + sink, chunks sbhd, mla", 4, 2, "learn", 0.2, 2, "sbhd", False, torch.float32, (12, 8)),
    ("dropout docs+window mqa", 4, 1, None, 0.25, 1, "thd", True, torch.float32, (8, 8)),
    # a2a: 6 heads over 4 ranks (2, 2, 1, 1; K/V head 2 on two ranks); a2a+p2p 2x2: 3 heads a rank, K/V
    # heads repeated locally (tests/test_ulysses_heads.py): sink slices and dropout head numbers follow
    ("dropout + sink, uneven heads", 6, 3, "learn", 0.2, 1, "bshd", False, torch.float32, (8, 8)),
]
LAYOUTS = (("zigzag", True), ("striped", False))


def _fmt(x, fmt):
    return x.squeeze(0) if fmt == "thd" else (x.transpose(0, 1).contiguous() if fmt == "sbhd" else x)


def _call(case, local, sink_t, cu, window, seed, layout, causal, **kw):
    name, h, h_kv, sink, p, chunks, fmt, docs, dtype, _ = case
    leaves = [t.detach().clone().requires_grad_() for t in local[:3]]
    s_leaf = sink_t.clone().requires_grad_() if sink == "learn" else None
    offset = s_leaf if s_leaf is not None else (None if sink is None else float(sink))
    out = ring_attention(*leaves, causal=causal, layout=layout, qkv_format=fmt, head_chunks=chunks,
                         softmax_offset=offset, dropout_p=p, dropout_seed=seed, window=window,
                         cu_seqlens=torch.tensor(cu) if cu is not None else None, **kw)
    out.backward(local[3])
    return [out.detach()] + [t.grad for t in leaves] + ([s_leaf.grad] if s_leaf is not None else [])


def _features_worker(rank, world):
    hier = make_hierarchical_groups(2)
    rows = []
    for ci, case in enumerate(CASES):
        name, h, h_kv, sink, p, chunks, fmt, docs, dtype, (dqk, dv) = case
        for li, (layout, causal) in enumerate(LAYOUTS):
            seed = 100 * ci + li
            g = torch.Generator().manual_seed(seed)
            b, S = (1 if fmt == "thd" else 2), 8 * world
            q, k, v, dout = (torch.randn(b, S, n, d, generator=g).to(dtype)
                             for n, d in ((h, dqk), (h_kv, dqk), (h_kv, dv), (h, dv)))
            sink_t = torch.randn(h, generator=g) if sink == "learn" else (
                None if sink is None else torch.full((h,), float(sink)))
            cu = [0, 3, 4, 11, S - 2] if docs else None
            window = (5, 2) if docs else None
            ref_in = [t.double().requires_grad_() for t in (q, k, v)]
            s_ref = sink_t.double().requires_grad_() if sink_t is not None else None
            ref = feature_reference(*ref_in, causal=causal, cu=cu, window=window, sink=s_ref, dropout_p=p, seed=seed)
            ref.backward(dout.double())
            refs = [ref.detach()] + [t.grad for t in ref_in] + ([s_ref.grad] if sink == "learn" else [])
            if sink == "learn":  # a signed sum over rows that cancels: M from its terms (helpers.numerics)
                weight = sink_weight(q, k, sink_t, causal=causal, cu=cu, window=window)
                dsink_m = max(s_ref.grad.abs().max().item(), sink_grad_scale(weight, dout, refs[0]))
            sh = lambda x: _fmt(shard_sequence(x, 1, layout=layout), fmt)  # noqa: E731
            local = [sh(t) for t in (q, k, v, dout)]
            cp1 = None
            if p:
                cp1 = _call(case, [_fmt(t, fmt) for t in (q, k, v, dout)], sink_t, cu, window, seed, layout,
                            causal, ring=LoopbackRing(1, 0, q.device))
            for ct in FEATURE_TYPES:
                got = _call(case, local, sink_t, cu, window, seed, layout, causal, comm_type=ct,
                            hierarchical_groups=hier)
                if sink == "learn":
                    dist.all_reduce(got[4])  # each rank's sink gradient covers its own (query, head) pairs
                sigma = score_bound(q, k)
                for what, a, r in zip(("out", "dq", "dk", "dv", "dsink"), got, refs):
                    r_local = r if what == "dsink" else sh(r)
                    n = b * S if what == "dsink" else max(S, dqk, dv)
                    rows.append(((ct, name, layout, what, "ref"), max_err(a, r_local),
                                 tol(dsink_m if what == "dsink" else r.abs().max().item(), dtype=dtype, n=n,
                                     sigma=sigma, blocks=2 * world)))
                if cp1 is not None:
                    for what, a, r, r64 in zip(("out", "dq", "dk", "dv"), got, cp1, refs):
                        full = r.unsqueeze(0) if fmt == "thd" else (r.transpose(0, 1) if fmt == "sbhd" else r)
                        rows.append(((ct, name, layout, what, "cp1"), max_err(a, sh(full)),
                                     tol(r64.abs().max().item(), dtype=dtype, n=max(S, dqk, dv), sigma=sigma,
                                         runs=2, blocks=2 * world)))
    return rows


@pytest.mark.slow
def test_sinks_and_dropout_on_every_comm_type():
    checks, seen = Checks("strategy features"), set()
    for rows in run_distributed(_features_worker, 4, timeout=300):
        checks.extend(rows)
        seen |= {(key[0], key[1], key[4]) for key, _, _ in rows}
    checks.check()
    assert {(ct, CASES[2][0], "cp1") for ct in FEATURE_TYPES} <= seen


TIMEOUT_S = 20.0
BAD = 2


def _faulty_call(rank, comm_type, fault, hier):
    """q, k, v and the options of a call whose input rank :data:`BAD` alone gets wrong (``fault``: "nan" in K on the
    fp8 wire, "stride": a non-contiguous head dim), after a call with the same signature (so the cross-rank check
    passes before the fault)."""
    torch.manual_seed(rank)
    q = torch.randn(1, 16, 4, 8)
    k, v = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    kw = dict(causal=True, comm_dtype="fp8", comm_type=comm_type, hierarchical_groups=hier, timeout_s=TIMEOUT_S)
    ring_attention(q, k, v, **kw)
    if rank == BAD and fault == "nan":
        k[0, 5, 1, 3] = float("nan")
    if rank == BAD and fault == "stride":
        q = torch.randn(1, 16, 4, 16)[..., ::2]  # refused on this rank only
    return q, k, v, kw


def _bad_input_worker(rank, world):
    hier = make_hierarchical_groups(2)
    results = {}
    for ct in TYPES:
        for fault in ("nan", "stride", "kernel", "none"):
            q, k, v, kw = _faulty_call(rank, ct, fault, hier)
            kernel = "flash_cuda" if rank == BAD and fault == "kernel" else "auto"  # this rank's device cannot run it
            start = time.monotonic()
            try:
                out = ring_attention(q, k, v, kernel=kernel, **kw)
                res = ("ok", bool(torch.isnan(out).any()))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                res = (type(exc).__name__, str(exc))
            results[(ct, fault)] = res + (time.monotonic() - start,)
    return results


@pytest.mark.slow
def test_bad_input_on_one_rank_raises_on_every_rank_for_every_comm_type():
    per_rank = run_distributed(_bad_input_worker, 4, timeout=300)
    for ct in TYPES:
        for rank, res in enumerate(per_rank):
            kind, msg, elapsed = res[(ct, "nan")]
            assert elapsed < TIMEOUT_S / 2, (ct, rank, elapsed)
            assert kind == "WireFiniteError", (ct, rank, kind, msg)
            if rank == BAD:
                assert "inf/NaN" in msg, (ct, msg)
            else:
                assert f"global rank(s) {BAD} cannot be sent" in msg, (ct, rank, msg)
            for fault in ("stride", "kernel"):  # refused by check_inputs / by select_kernel on rank 2 only
                kind, msg, elapsed = res[(ct, fault)]
                assert elapsed < TIMEOUT_S / 2, (ct, fault, rank, elapsed)
                if rank == BAD:
                    assert kind == "ValueError", (ct, fault, kind, msg)
                else:
                    assert kind == "RingInputError" and f"global rank(s) {BAD} rejected" in msg, (ct, rank, kind, msg)
            assert res[(ct, "none")][:2] == ("ok", False), (ct, rank, res[(ct, "none")])


def _bad_input_cuda_path_worker(rank, world):
    """As :func:`_bad_input_worker` on the CUDA code path (the fake device's answers for ``cpu``: the status codes
    copied to the host in the forward, read at the start of the layer's backward), with a backward after each call:
    per (comm type, fault), where each rank raised and what."""
    from megatron_ring import device
    from tests.helpers.fake_device import FakeCuda

    hier = make_hierarchical_groups(2)
    results = {}
    with device.use("cpu", FakeCuda()):
        for ct in TYPES:
            for fault in ("nan", "stride", "none"):
                q, k, v, kw = _faulty_call(rank, ct, fault, hier)
                leaves = [t.requires_grad_() for t in (q, k, v)]  # as they are (the stride fault's q too)
                where = "forward"
                try:
                    out = ring_attention(*leaves, **kw)
                    where = "backward"
                    out.sum().backward()
                    res = ("ok", "")
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    res = (type(exc).__name__, str(exc))
                results[(ct, fault)] = (where, *res)
    return results


@pytest.mark.slow
def test_bad_input_on_one_rank_raises_on_every_rank_on_the_cuda_path():
    """The collective comm types on the CUDA path read the gathered codes from their host copy at the start of the
    layer's backward (no host sync in the forward, none in the backward where the copy is complete): a rank whose
    K/V the wire refuses, or whose input is refused, still stops every rank there, with the named errors."""
    per_rank = run_distributed(_bad_input_cuda_path_worker, 4, timeout=300)
    for ct in TYPES:
        for rank, res in enumerate(per_rank):
            where, kind, msg = res[(ct, "nan")]
            assert (where, kind) == ("backward", "WireFiniteError"), (ct, rank, res[(ct, "nan")])
            assert ("inf/NaN" if rank == BAD else f"global rank(s) {BAD} cannot be sent") in msg, (ct, rank, msg)
            where, kind, msg = res[(ct, "stride")]
            if rank == BAD:
                assert (where, kind) == ("forward", "ValueError"), (ct, rank, res[(ct, "stride")])
            else:
                assert (where, kind) == ("backward", "RingInputError") and f"global rank(s) {BAD} rejected" in msg, (
                    ct, rank, res[(ct, "stride")])
            assert res[(ct, "none")] == ("backward", "ok", ""), (ct, rank, res[(ct, "none")])


def test_deferred_status_check_raises_at_the_start_of_backward():
    """CUDA without a checking codec: the forward leaves the gathered codes' host copy to the layer's backward,
    which reads it at its start and raises; it waits for the device only where the copy is not complete yet (the
    mechanism, on CPU tensors with a device that answers like CUDA: no GPU here)."""
    from megatron_ring.core.status import PendingChecks
    from megatron_ring.device import DeviceOps
    from megatron_ring.errors import RingInputError
    from megatron_ring.strategies.refusal import _CheckInBackward
    from megatron_ring.wire.codecs import IdentityCodec

    class Ops(DeviceOps):  # a device whose reads are not free; says whether the copy's event is done
        host_reads_free = False

        def __init__(self, done):
            self.done, self.host_waits = done, 0

        def event_done(self, event):
            return self.done

        def wait_event_host(self, event):
            self.host_waits += 1

    class Ring:
        rank, my_global, members = 0, 0, [0, 1, 2, 3]

    for codes, fails, done in ((torch.zeros(4), False, True), (torch.tensor([0.0, 0, 2, 0]), True, True),
                               (torch.zeros(4), False, False)):
        ops, checks = Ops(done), PendingChecks()
        checks.add(codes, object(), ops, Ring(), IdentityCodec())
        x = torch.ones(3, requires_grad=True)
        y = _CheckInBackward.apply(x, checks)
        assert torch.equal(y, x) and checks._items  # forward: identity, nothing read
        if fails:
            with pytest.raises(RingInputError, match=r"ring global rank\(s\) 2 rejected their input"):
                y.sum().backward()
        else:
            y.sum().backward()
            assert torch.equal(x.grad, torch.ones(3))
        assert not checks._items and ops.host_waits == (0 if done else 1)  # read once; waited only if not done


def _odd_fp8_worker(rank, world):
    """The FP8 wire on the collective comm types with head dims 9 / 16: one FP8 buffer of 150 payload bytes a rank,
    laid back to back (all_gather's chunks, a2a's splits). The next rank's scales started at an unaligned offset:
    a crash on the rank decoding it, the others waiting out the timeout. Outputs and gradients vs float64."""
    g = torch.Generator().manual_seed(9)
    S, layout = 6 * world, "zigzag"
    q, k, v, dout = (torch.randn(1, S, n, d, generator=g) for n, d in ((4, 9), (2, 9), (2, 16), (4, 16)))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = feature_reference(*ref_in, causal=True)
    ref.backward(dout.double())
    refs = [ref.detach()] + [t.grad for t in ref_in]
    rows = []
    for ct in ("all_gather", "a2a"):
        local = [shard_sequence(t, 1, layout=layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, causal=True, layout=layout, comm_type=ct, comm_dtype="fp8", timeout_s=TIMEOUT_S)
        out.backward(shard_sequence(dout, 1, layout=layout))
        for what, a, r in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in local], refs):
            rows.append(((ct, what), max_err(a, shard_sequence(r, 1, layout=layout)),
                         tol(r.abs().max().item(), dtype=torch.float32, n=S, sigma=score_bound(q, k), wire="fp8",
                             blocks=2 * world)))
    return rows


@pytest.mark.slow
def test_fp8_wire_with_odd_head_dims_on_the_collective_comm_types():
    checks = Checks("fp8 wire, head dims 9/16, all_gather and a2a, P=2")
    for rows in run_distributed(_odd_fp8_worker, 2, timeout=300):
        checks.extend(rows)
    checks.check(min_rows=16)
