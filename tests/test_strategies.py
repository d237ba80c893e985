"""Every comm type vs an independent float64 full-sequence reference: outputs AND dq/dk/dv.

One set of P gloo processes per P runs the whole matrix for every comm type the size allows:
layouts x causal x heads (MHA, GQA, MQA; for a2a also h_kv < P and h_kv % P != 0, where K/V heads are
replicated) x fp32/bf16. a2a+p2p runs at P=4 (2x2) and P=8 (2x4, 4x2) over hierarchical groups built
the Megatron way (inner = consecutive ranks). Tolerance as in test_ring_attention: at most FACTOR x the
error of one-process SDPA in the same dtype plus a small floor.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_ring import ring_attention, shard_sequence
from reference import attention_reference, outputs_and_grads, sdpa

FACTOR = 4.0
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 4e-3}


def _heads(world):
    """(h, h_kv, d, fmt): MHA, GQA, MQA, and h_kv < P / h_kv % P != 0 where P > 1."""
    base = [(2 * world, 2 * world, 16, "bshd"), (2 * world, world, 16, "sbhd"), (world, 1, 16, "bshd")]
    if world > 2:
        base.append((2 * world, 2, 16, "sbhd"))  # h_kv < P: a2a replicates K/V heads
    if world == 3:
        base.append((6, 2, 16, "bshd"))  # h_kv % P != 0 with h_kv < P, h/P not a multiple of h/h_kv
    return base


def hierarchical(world, inner):
    """Megatron's convention: inner = consecutive ranks, outer = same inner index (every rank builds all)."""
    mine = [None, None]
    me = dist.get_rank()
    for o in range(world // inner):
        g = dist.new_group(list(range(o * inner, (o + 1) * inner)))
        if me // inner == o:
            mine[0] = g
    for i in range(inner):
        g = dist.new_group(list(range(i, world, inner)))
        if me % inner == i:
            mine[1] = g
    return tuple(mine)


def _case(world, comm_type, hier, layout, causal, heads, dtype, seed, comm_dtype=None):
    h, h_kv, d, fmt = heads
    b, s_local = 2, 4
    seq = s_local * world
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, seq, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, seq, h_kv, d, generator=g) for _ in range(2))
    ref = outputs_and_grads(lambda *t: attention_reference(*t, causal), q.double(), k.double(), v.double(),
                            dout.double())
    base = outputs_and_grads(lambda *t: sdpa(*t, causal), q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype))
    to_fmt = (lambda t: t) if fmt == "bshd" else (lambda t: t.transpose(0, 1).contiguous())
    local = [to_fmt(shard_sequence(t, 1, layout=layout)).to(dtype) for t in (q, k, v, dout)]

    def run(qq, kk, vv):
        out = ring_attention(qq, kk, vv, causal=causal, layout=layout, qkv_format=fmt, comm_type=comm_type,
                             hierarchical_groups=hier, comm_dtype=comm_dtype)
        assert out.shape == qq.shape and out.dtype == dtype and out.is_contiguous()
        return out

    got = outputs_and_grads(run, *local)
    rows = []
    for name, r, bse, f in zip(("out", "dq", "dk", "dv"), got, base, ref):
        assert r.shape == local[0 if name in ("out", "dq") else 1].shape
        f_local = to_fmt(shard_sequence(f, 1, layout=layout))
        b_local = to_fmt(shard_sequence(bse, 1, layout=layout))
        rows.append((name, (r.double() - f_local).abs().max().item(), (b_local.double() - f_local).abs().max().item()))
    return rows


def _types(world):
    types = [("p2p", None), ("all_gather", None), ("a2a", None), ("auto", None)]
    splits = {4: [2], 8: [2, 4]}.get(world, [])
    return types + [("a2a+p2p", inner) for inner in splits]


def _matrix_worker(rank, world):
    results = []
    hier = {inner: hierarchical(world, inner) for _, inner in _types(world) if inner}
    cases = itertools.product(_types(world), ("contiguous", "zigzag", "striped"), (False, True), _heads(world),
                              (torch.float32, torch.bfloat16))
    for i, ((ct, inner), layout, causal, heads, dtype) in enumerate(cases):
        if ct == "a2a" and heads[0] % world:
            continue
        if world == 8 and (layout, dtype) != ("zigzag", torch.float32) and ct not in ("a2a+p2p",):
            continue  # P=8: the full matrix for a2a+p2p, one layout/dtype for the others (time)
        label = f"{ct}{'/' + str(inner) + 'x' + str(world // inner) if inner else ''}"
        for name, err, sdpa_err in _case(world, ct, hier.get(inner), layout, causal, heads, dtype, seed=100 + i):
            results.append((label, layout, causal, heads, str(dtype), name, err, sdpa_err))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_comm_type_matches_full_attention(world):
    per_rank = run_distributed(_matrix_worker, world, timeout=600)
    failures, seen = [], set()
    for rows in per_rank:
        for label, layout, causal, heads, dtype, name, err, sdpa_err in rows:
            seen.add(label)
            bound = FACTOR * sdpa_err + FLOOR[getattr(torch, dtype.split(".")[1])]
            if not err <= bound:
                failures.append(f"{label} {layout} causal={causal} heads={heads} {dtype} {name}: "
                                f"{err:.3g} > bound {bound:.3g} (sdpa {sdpa_err:.3g})")
    assert not failures, "\n".join(failures[:20])
    want = {"p2p", "all_gather", "a2a", "auto"} | ({"a2a+p2p/2x2"} if world == 4 else set()) | (
        {"a2a+p2p/2x4", "a2a+p2p/4x2"} if world == 8 else set())
    assert want <= seen, sorted(seen)
