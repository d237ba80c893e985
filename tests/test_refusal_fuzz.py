"""Fuzz: one rank refusing at a random point of a random call makes EVERY rank raise the named error;
no rank hangs, no message is left undelivered.

A case draws a configuration (ring size P = 1..8, layout, tensor format, causal or not, a window, packed
documents, sinks, dropout, wire format, head chunks, K/V pieces, GQA) and a fault on one random rank at one
of the points where a rank alone refuses its input after the cross-rank check:

* ``stride``: ``check_inputs`` refuses this rank's q (a non-contiguous head dim);
* ``kernel``: this rank asks for a kernel its device cannot run (``select_kernel`` refuses);
* ``nan`` / ``huge``: the checking wire codec refuses this rank's K/V at a random element (NaN on an fp8
  wire; a finite value beyond fp16's range on an fp16 wire).

The ring (``comm_type="p2p"``) runs on threads (``ring_fakes.ThreadRing``): every message is counted,
so "nothing left undelivered" is exact. The collective comm types need a process group: a short
4-process part plays random cases for them too.

``MEGATRON_RING_FUZZ_CASES`` (default 100) sets the thread part's case count, ``MEGATRON_RING_FUZZ_SEED``
(default 0) its seed: a long run is e.g. ``MEGATRON_RING_FUZZ_CASES=3000 pytest tests/test_refusal_fuzz.py``.
"""
import os
import random
import threading

import pytest
import torch

from tests.helpers.launch import run_distributed
from megatron_ring import ring_attention
from megatron_ring.call import attention_mask as _attention_mask
from megatron_ring.errors import RingInputError, WireFiniteError
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.schedules.masks import needed_steps

CASES = int(os.environ.get("MEGATRON_RING_FUZZ_CASES", "100"))
SEED = int(os.environ.get("MEGATRON_RING_FUZZ_SEED", "0"))
WAIT_S = 20.0  # a receive's wait on the thread ring: far above a case's run time (well under 1 s)


def draw_case(rng: random.Random, world: int | None = None, comm_types=("p2p",)) -> dict:
    """A random valid configuration and fault (every rank draws the same from the same seed)."""
    while True:
        P = world or rng.randint(1, 8)
        layout = rng.choice(["zigzag", "striped", "contiguous"])
        fmt = rng.choice(["bshd", "sbhd", "thd"])
        h_kv = rng.choice([1, 2, 4])
        h = h_kv * rng.choice([1, 2])
        s_local = rng.choice([4, 6, 8])
        T = P * s_local
        causal = rng.random() < 0.7
        window = None
        if rng.random() < 0.5:  # small left windows shorten a contiguous causal ring (steps < P)
            window = (rng.randint(0, max(1, T // 2)), 0 if causal else rng.choice([-1, rng.randint(0, T)]))
        cu = None
        if fmt == "thd" and rng.random() < 0.7:
            cuts = sorted(rng.sample(range(1, T), min(T - 1, rng.randint(1, 4))))
            cu = [0, *cuts, T - rng.randint(0, 2)]
            cu = sorted(cu)
        comm_type = rng.choice(comm_types)
        comm_dtype = rng.choice([None, "bf16", "fp16", "fp8"])
        sink = rng.choice([None, 0.0, "tensor"])
        dropout = rng.random() < 0.25
        # a checking wire refuses: fp8 non-finite K/V; fp16 finite K/V beyond its range (it carries inf/NaN)
        wire_fault = {"fp8": "nan", "fp16": "huge"}.get(comm_dtype) if P > 1 else None
        faults = ["stride", "kernel"] + [wire_fault] * 2 * (wire_fault is not None)
        case = dict(P=P, layout=layout, fmt=fmt, h=h, h_kv=h_kv, d=rng.choice([8, 16]), s_local=s_local,
                    causal=causal, window=window, cu_seqlens=cu, comm_type=comm_type, comm_dtype=comm_dtype,
                    sink=sink, dropout=dropout, head_chunks=rng.randint(1, 4), kv_pieces=rng.randint(1, 4),
                    bad=rng.randrange(P), fault=rng.choice(faults), seed=rng.randrange(2**31))
        if comm_type in ("a2a", "a2a+p2p") and h_kv % (P if comm_type == "a2a" else 2):
            continue
        try:
            get_layout(layout).check_local_len(s_local, P)
            mask = _attention_mask(causal, None if cu is None else torch.tensor(cu), window, T)
        except ValueError:
            continue
        case["steps"] = needed_steps(get_layout(layout), mask, P, s_local)
        return case


def call_case(case: dict, rank: int, **extra):
    """Rank ``rank``'s call of ``case`` (its fault applied when it is the bad rank)."""
    g = torch.Generator().manual_seed(case["seed"] + rank)
    s, h, h_kv, d = case["s_local"], case["h"], case["h_kv"], case["d"]
    fmt = case["fmt"]
    lead = {"bshd": (1, s), "sbhd": (s, 1), "thd": (s,)}[fmt]
    q = torch.randn((*lead, h, d), generator=g)
    k = torch.randn((*lead, h_kv, d), generator=g)
    v = torch.randn((*lead, h_kv, d), generator=g)
    kernel = "auto"
    if rank == case["bad"]:
        fault = case["fault"]
        if fault == "stride":
            q = torch.randn((*lead, h, 2 * d), generator=g)[..., ::2]
        elif fault == "kernel":
            kernel = "flash_cuda"
        else:
            idx = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in k.shape)
            (k if torch.rand((), generator=g) < 0.5 else v)[idx] = float("nan") if fault == "nan" else 1e6
    sink = case["sink"]
    if sink == "tensor":
        sink = torch.randn(h, generator=torch.Generator().manual_seed(case["seed"]))
    cu = None if case["cu_seqlens"] is None else torch.tensor(case["cu_seqlens"], dtype=torch.int32)
    return ring_attention(q, k, v, causal=case["causal"], layout=case["layout"], qkv_format=fmt,
                          comm_dtype=case["comm_dtype"], kernel=kernel, head_chunks=case["head_chunks"],
                          kv_pieces=case["kv_pieces"], cu_seqlens=cu, window=case["window"],
                          comm_type=case["comm_type"], softmax_offset=sink,
                          dropout_p=0.1 if case["dropout"] else 0.0, dropout_seed=7 if case["dropout"] else None,
                          **extra)


def outcome(case: dict, rank: int, **extra) -> tuple[str, str]:
    try:
        call_case(case, rank, **extra)
        return ("ok", "")
    except Exception as exc:  # noqa: BLE001 - judged by check_outcomes
        return (type(exc).__name__, str(exc))


def check_outcomes(case: dict, results: list) -> None:
    """The bad rank raises its own error; every other rank the named error naming the bad rank."""
    bad, wire = case["bad"], case["fault"] in ("nan", "huge")
    for rank, res in enumerate(results):
        assert res is not None, (case, rank, "no result")
        kind, msg = res
        if rank == bad:
            assert kind == ("WireFiniteError" if wire else "ValueError"), (case, rank, kind, msg)
        elif wire:
            assert kind == "WireFiniteError" and f"global rank(s) {bad} cannot be sent" in msg, (case, rank, kind, msg)
        else:
            assert kind == "RingInputError" and f"global rank(s) {bad} rejected their input" in msg, \
                (case, rank, kind, msg)


def run_on_threads(case: dict) -> tuple[list, list, int]:
    """``case`` on a ThreadRing of P threads: per-rank outcomes, ranks still running, messages left."""
    from tests.helpers.ring_fakes import ThreadRing

    rings = ThreadRing.make(case["P"])
    for r in rings:
        r.WAIT_S = WAIT_S
    results = [None] * case["P"]

    def body(rank):
        results[rank] = outcome(case, rank, ring=rings[rank])

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(case["P"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT_S)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    left = sum(box.qsize() for box in rings[0]._queues.values())
    return results, hung, left


def test_error_types():
    assert issubclass(RingInputError, ValueError) and issubclass(WireFiniteError, ValueError)


def test_refusal_reaches_every_rank_fuzz():
    """CASES random configurations x one rank refusing at a random point, on the thread ring."""
    rng = random.Random(SEED)
    shortened = 0
    for i in range(CASES):
        case = draw_case(rng)
        shortened += case["steps"] < case["P"]
        results, hung, left = run_on_threads(case)
        assert not hung and left == 0, (i, case, hung, left, results)
        check_outcomes(case, results)
    print(f"\n{CASES} cases (seed {SEED}), {shortened} on a window-shortened ring")
    assert CASES < 20 or shortened > 0  # the fuzz covers the case the status hops are for


def test_the_fuzz_sees_a_missing_status_hop(monkeypatch):
    """Not vacuous: without the status hops of a shortened ring, far ranks do not raise the named error
    (they return, or wait for a rank that raised)."""
    from megatron_ring.core.status import RingStatus

    monkeypatch.setattr(RingStatus, "spread", lambda self, steps: None)
    monkeypatch.setattr("tests.test_refusal_fuzz.WAIT_S", 2.0)
    rng = random.Random(SEED)
    case = draw_case(rng)
    while not (case["steps"] < case["P"] - 1 and case["fault"] == "stride"):
        case = draw_case(rng)
    case["bad"] = 0
    results, hung, left = run_on_threads(case)
    with pytest.raises(AssertionError):
        assert not hung and left == 0
        check_outcomes(case, results)


# --- the collective comm types (a process group): a few random cases on 4 gloo processes -----------------

COLLECTIVE_CASES = 20
COMM_TYPES = ("a2a", "all_gather", "a2a+p2p", "auto", "p2p")


def _collective_worker(rank, world):
    from megatron_ring.strategies import make_hierarchical_groups

    hier = make_hierarchical_groups(2)
    rng = random.Random(SEED + 1)
    out = []
    for i in range(COLLECTIVE_CASES):
        case = draw_case(rng, world=world, comm_types=(COMM_TYPES[i % len(COMM_TYPES)],))
        extra = dict(timeout_s=WAIT_S)
        if case["comm_type"] in ("a2a+p2p", "auto"):
            extra["hierarchical_groups"] = hier
        out.append((case, outcome(case, rank, **extra)))
    return out


@pytest.mark.slow
def test_refusal_reaches_every_rank_collective_comm_types():
    per_rank = run_distributed(_collective_worker, 4, timeout=300)
    kinds = {case["comm_type"] for case, _ in per_rank[0]}
    assert kinds == set(COMM_TYPES), kinds
    for i in range(COLLECTIVE_CASES):
        case = per_rank[0][i][0]
        check_outcomes(case, [r[i][1] for r in per_rank])
