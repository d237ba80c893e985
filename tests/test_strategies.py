"""Every comm type vs an independent float64 full-sequence reference: outputs AND dq/dk/dv.

One set of P gloo processes per P runs the whole matrix for every comm type the size allows:
layouts x causal x heads (MHA, GQA, MQA; for a2a also h_kv < P and h_kv % P != 0, where K/V heads go to
several ranks; more uneven splits: tests/test_ulysses_heads.py) x fp32/bf16. a2a+p2p runs at P=4 (2x2) and P=8
(2x4, 4x2) over hierarchical groups built the Megatron way (inner = consecutive ranks). Tolerance as in
test_ring_attention: the derived bound of tests/helpers/numerics.py, which one-process SDPA in the same dtype
must meet too (the ring test's case runner).
"""
import itertools

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import Checks, max_err, score_bound, tol
from megatron_ring import ring_attention, shard_sequence
from megatron_ring.strategies import make_hierarchical_groups
from tests.helpers.reference import attention_reference, outputs_and_grads
from tests.test_ring_attention import _case_errors

pytestmark = pytest.mark.slow  # every test here starts worker processes



def _heads(world):
    """(h, h_kv, d, fmt): MHA, GQA, MQA, and h_kv < P / h_kv % P != 0 where P > 1."""
    base = [(2 * world, 2 * world, 16, "bshd"), (2 * world, world, 16, "sbhd"), (world, 1, 16, "bshd")]
    if world > 2:
        base.append((2 * world, 2, 16, "sbhd"))  # h_kv < P: a2a sends a K/V head to several ranks
    if world == 3:
        base.append((6, 2, 16, "bshd"))  # h_kv % P != 0 with h_kv < P, h/P not a multiple of h/h_kv
    return base


def hierarchical(world, inner):
    """Megatron's convention: inner = consecutive ranks, outer = same inner index (every rank builds all)."""
    return make_hierarchical_groups(inner)


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
        if world == 8 and (layout, dtype) != ("zigzag", torch.float32) and ct not in ("a2a+p2p",):
            continue  # P=8: the full matrix for a2a+p2p, one layout/dtype for the others (time)
        label = f"{ct}{'/' + str(inner) + 'x' + str(world // inner) if inner else ''}"
        for name, err, sdpa_err, bound in _case_errors(world, layout, causal, heads, dtype, 100 + i, comm_type=ct,
                                                       hierarchical_groups=hier.get(inner)):
            key = (label, layout, causal, heads, str(dtype), name)
            results += [(key, err, bound), (key + ("sdpa",), sdpa_err, bound)]
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_comm_type_matches_full_attention(world):
    checks, seen = Checks(f"strategies P={world}"), set()
    for rows in run_distributed(_matrix_worker, world, timeout=600):
        checks.extend(rows)
        seen |= {key[0] for key, _, _ in rows}
    checks.check()
    want = {"p2p", "all_gather", "a2a", "auto"} | ({"a2a+p2p/2x2"} if world == 4 else set()) | (
        {"a2a+p2p/2x4", "a2a+p2p/4x2"} if world == 8 else set())
    assert want <= seen, sorted(seen)


def _wire_worker(rank, world):
    """Wire codecs on every type: all_gather quantises exactly the blocks p2p does (same per-head,
    per-64-token scales; own block as is), so its outputs/gradients equal p2p's. a2a (a rank's own shard is
    exact, but it computes every query shard) and a2a+p2p (super-blocks quantised on the outer ring)
    are compared by their error against float64."""
    hier = hierarchical(world, 2)
    out = []
    for wire in ("bf16", "fp8"):
        g = torch.Generator().manual_seed(3)
        b, s, h, h_kv, d = 1, 64, 4, 2, 16
        q, k, v, dout = (torch.randn(b, s * world, n, d, generator=g) for n in (h, h_kv, h_kv, h))
        ref = outputs_and_grads(lambda *t: attention_reference(*t, True), q.double(), k.double(), v.double(),
                                dout.double())
        kw = dict(dtype=torch.float32, n=max(s * world, d), sigma=score_bound(q, k))
        local = [shard_sequence(t, 1, layout="zigzag") for t in (q, k, v, dout)]
        res = {}
        for ct in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            res[ct] = outputs_and_grads(lambda *t: ring_attention(*t, causal=True, comm_dtype=wire, comm_type=ct,
                                                                  hierarchical_groups=hier), *local)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            m = ref[i].abs().max().item()
            r = shard_sequence(ref[i], 1, layout="zigzag")
            # same quantised blocks as p2p: equal up to fp32 arithmetic (two runs)
            out.append(((wire, "all_gather", "vs p2p", name), max_err(res["all_gather"][i], res["p2p"][i]),
                        tol(m, runs=2, **kw)))
            # the wire format is really lossy: p2p's error exceeds what fp32 arithmetic alone could give
            out.append(((wire, "p2p", "lossy", name), tol(m, **kw), max_err(res["p2p"][i], r)))
            for ct in ("p2p", "a2a", "a2a+p2p"):
                out.append(((wire, ct, "vs ref", name), max_err(res[ct][i], r), tol(m, wire=wire, **kw)))
    return out


def test_wire_codecs_apply_to_every_type():
    checks = Checks("strategies wire")
    for rows in run_distributed(_wire_worker, 4, timeout=300):
        checks.extend(rows)
    checks.check(min_rows=4 * 2 * 4 * 5)


def _bad_input_worker(rank, world):
    """Each misuse must raise the same clear error on every rank (bounded: no hang)."""
    hier = hierarchical(world, 2)
    strided = make_hierarchical_groups(2)[::-1]  # (outer, inner): not built the Megatron way for a2a+p2p
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 4, 2, 8)
    msgs = {}
    cases = {
        "a2a heads": lambda: ring_attention(q[:, :, :3], kv[:, :, :1], kv[:, :, :1], comm_type="a2a"),  # 3 < 4
        "a2a+p2p missing": lambda: ring_attention(q, kv, kv, comm_type="a2a+p2p"),
        "a2a+p2p swapped": lambda: ring_attention(q, kv, kv, comm_type="a2a+p2p", hierarchical_groups=strided),
        "a2a+p2p one group": lambda: ring_attention(q, kv, kv, comm_type="a2a+p2p", hierarchical_groups=hier[:1]),
        "unknown": lambda: ring_attention(q, kv, kv, comm_type="ulysses"),
        # a fresh shape: the consistency check runs once per new signature
        "differs": lambda: ring_attention(q[:, :2], kv[:, :2], kv[:, :2], comm_type="all_gather" if rank == 1 else "p2p"),
    }
    for name, fn in cases.items():
        try:
            fn()
            msgs[name] = "no error"
        except ValueError as exc:
            msgs[name] = str(exc)
    return msgs


def test_bad_strategy_input_fails_on_every_rank():
    per_rank = run_distributed(_bad_input_worker, 4, timeout=120)
    want = {"a2a heads": "at least one head", "a2a+p2p missing": "hierarchical_groups=(inner, outer)",
            "a2a+p2p swapped": "not built the Megatron way", "a2a+p2p one group": "pair (inner, outer)",
            "unknown": "unknown comm_type", "differs": "comm_type"}
    for rank, msgs in enumerate(per_rank):
        for name, text in want.items():
            assert msgs[name] != "no error", (rank, name)
            if name in ("a2a+p2p swapped",) and "see their error" in msgs[name]:
                continue  # ranks whose own groups happen to pass name the failing ranks instead
            assert text in msgs[name], (rank, name, msgs[name])


def _auto_inputs_worker(rank: int, world: int, variant: str) -> str:
    import os

    from megatron_ring.strategies.auto import set_machine

    machine = dict(MEGATRON_RING_FLOPS="1e9", MEGATRON_RING_BWD_FLOPS="1e9", MEGATRON_RING_BANDWIDTH="1e9",
                   MEGATRON_RING_INTER_BANDWIDTH="1e9", MEGATRON_RING_LATENCY_S="1e-5",
                   MEGATRON_RING_CALL_OVERHEAD_S="1e-5", MEGATRON_RING_AUTO_MEASURE="0")
    os.environ.update(machine)  # every rank: the same machine, no probe, no measurement
    if variant == "env" and rank == 0:
        os.environ["MEGATRON_RING_GPUS_PER_NODE"] = "8"
    if variant == "set_machine" and rank == 0:
        from megatron_ring.planning.cost_model import Machine

        set_machine(Machine(flops=1e12, bwd_flops=1e12, bw_intra=1e11, bw_inter=1e10, latency=1e-6))
    q = shard_sequence(torch.randn(1, 32, 4, 8, generator=torch.Generator().manual_seed(0)), 1)
    try:
        ring_attention(q, q, q, causal=True, comm_type="auto", timeout_s=20.0)
        return "ran"
    except ValueError as e:
        return f"ValueError: {e}"


@pytest.mark.parametrize("variant", ["env", "set_machine"])
def test_auto_inputs_that_differ_across_ranks_are_named(variant):
    """What comm_type="auto" decides from besides the call (the MEGATRON_RING_* variables it reads, a set_machine
    machine) set on one rank only: the call's cross-rank check names it on every rank before any probe (the ranks
    probed and chose differently: mismatched collectives, a hang until the group's timeout or aborted processes).
    Control: the same settings on every rank run."""
    for r in run_distributed(_auto_inputs_worker, 2, variant, timeout=120):
        assert r.startswith("ValueError: ring_attention was called with different arguments") and "comm_type" in r, r
    assert run_distributed(_auto_inputs_worker, 2, "same", timeout=120) == ["ran", "ran"]
