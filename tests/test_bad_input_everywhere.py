"""A rank whose K/V the wire codec refuses (inf/NaN, or beyond the fp16 range), or whose input fails a
rank-local check after the cross-rank check, makes EVERY rank of the ring raise promptly: no neighbour
waits for a time-out, and the ring stays usable for the next call.

One 4-process run plays every scenario in turn (rank 2 is the bad one); the measured times (seconds
from the call to the error, per rank) are printed with ``-s``. The bound is the configured ring timeout,
so passing shows the error did not come from a time-out.
"""
import time

import pytest
import torch

from tests.helpers.launch import run_distributed
from megatron_ring import ring_attention
from megatron_ring.errors import WireFiniteError
from megatron_ring.errors import RingInputError
from megatron_ring.call import attention_mask as _attention_mask
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.schedules.masks import needed_steps

TIMEOUT_S = 20.0
BAD = 2
SCENARIOS = [("nan", "fp8"), ("huge", "fp16"), ("nan", "bf16"), ("kernel", None), ("stride", None)]


def _worker(rank, world):
    results = {}
    for fault, comm_dtype in SCENARIOS + [("none", "fp8")]:  # last: the ring still works afterwards
        torch.manual_seed(rank)
        q = torch.randn(1, 32, 2, 16)
        k, v, kernel = q.clone(), q.clone(), "auto"
        if fault != "none":
            ring_attention(q, k, v, causal=True, comm_dtype=comm_dtype, timeout_s=TIMEOUT_S)  # signature seen
        if rank == BAD:
            if fault == "nan":
                k[0, 5, 1, 3] = float("nan")
            elif fault == "huge":
                v[0, 7, 0, 1] = 1e6  # finite, but beyond fp16's 65504
            elif fault == "kernel":
                kernel = "flash_cuda"  # a kernel this rank's device cannot run (rank-local: not in the signature)
            elif fault == "stride":
                q = torch.randn(1, 32, 2, 32)[..., ::2]  # a non-contiguous head dim, refused on this rank only
        start = time.monotonic()
        try:
            out = ring_attention(q, k, v, causal=True, comm_dtype=comm_dtype, timeout_s=TIMEOUT_S, kernel=kernel)
            res = ("ok", bool(torch.isnan(out).any()))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            res = (type(exc).__name__, str(exc))
        results[(fault, comm_dtype)] = res + (time.monotonic() - start,)
    return results


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_distributed(_worker, 4, timeout=240)
    table = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    for (fault, comm_dtype), res in table.items():
        times = ", ".join(f"{x[2]:.3f}" for x in res)
        print(f"\n{fault:>6} on rank {BAD}, comm_dtype={comm_dtype}: {[x[0] for x in res]}; seconds per rank: {times}")
    return table


@pytest.mark.slow
@pytest.mark.parametrize("fault, comm_dtype", [("nan", "fp8"), ("huge", "fp16")])
def test_refused_kv_on_one_rank_raises_on_every_rank(outcomes, fault, comm_dtype):
    for rank, (kind, msg, elapsed) in enumerate(outcomes[(fault, comm_dtype)]):
        assert kind == "WireFiniteError", (rank, kind, msg)
        assert elapsed < TIMEOUT_S, f"rank {rank} raised after {elapsed:.1f}s: a time-out, not the in-band status"
        if rank == BAD:
            assert ("contains inf/NaN" if fault == "nan" else "fp16 max") in msg, msg  # the detailed local error
        else:
            assert f"global rank(s) {BAD} cannot be sent" in msg, msg


@pytest.mark.slow
def test_nan_on_a_bf16_wire_propagates_instead(outcomes):
    """bf16 (and as-is) wires carry inf/NaN as SDPA would: nobody raises, the NaN shows in the output."""
    res = outcomes[("nan", "bf16")]
    assert [r[0] for r in res] == ["ok"] * 4
    assert res[BAD][1] and res[BAD + 1][1]  # zigzag causal: ranks 2 and 3 attend to rank 2's first chunk


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kernel", "stride"])
def test_rank_local_input_error_raises_on_every_rank(outcomes, fault):
    for rank, (kind, msg, elapsed) in enumerate(outcomes[(fault, None)]):
        assert elapsed < TIMEOUT_S, f"rank {rank} raised after {elapsed:.1f}s"
        if rank == BAD:
            assert kind == "ValueError", (kind, msg)
        else:
            assert kind == "RingInputError" and f"global rank(s) {BAD} rejected their input" in msg, (rank, kind, msg)


@pytest.mark.slow
def test_ring_still_works_after_the_errors(outcomes):
    assert [r[:2] for r in outcomes[("none", "fp8")]] == [("ok", False)] * 4


def test_error_types_are_value_errors():
    assert issubclass(RingInputError, ValueError) and issubclass(WireFiniteError, ValueError)


# --- the refusal's message sequence is the forward ring's (threads, every layout / mask / pieces) ----------

WORLD, S_LOCAL, H, H_KV, D = 4, 16, 8, 4, 16
MASKS = {  # name -> ring_attention keywords (thd: packed documents)
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(5, 0)),  # shortens the ring for contiguous: fewer than P steps
    "documents": dict(causal=True, qkv_format="thd",
                      cu_seqlens=torch.tensor([0, 9, 30, 47, WORLD * S_LOCAL - 3], dtype=torch.int32)),
}
SPLITS = [(1, 1), (1, 2), (1, 4), (2, 2), (4, 1)]  # (head_chunks, kv_pieces)


def _ring_with_a_refusing_rank(layout, mask, head_chunks, pieces_per_rank, wait_s=20.0):
    """Every rank calls ring_attention on its ThreadRing; rank BAD's q is refused by check_inputs (a
    non-contiguous head dim). Returns per-rank results and whether messages were left undelivered."""
    from tests.helpers.ring_fakes import ThreadRing

    rings = ThreadRing.make(WORLD)
    for r in rings:
        r.WAIT_S = wait_s
    kw = MASKS[mask]
    thd = kw.get("qkv_format") == "thd"
    results = [None] * WORLD

    def body(rank):
        g = torch.Generator().manual_seed(rank)
        shape = (S_LOCAL, H, D) if thd else (1, S_LOCAL, H, D)
        q = torch.randn(shape, generator=g)
        k = torch.randn((*shape[:-2], H_KV, D), generator=g)
        v = torch.randn(k.shape, generator=g)
        if rank == BAD:
            q = torch.randn((*shape[:-1], 2 * D), generator=g)[..., ::2]
        try:
            ring_attention(q, k, v, layout=layout, head_chunks=head_chunks, kv_pieces=pieces_per_rank[rank],
                           ring=rings[rank], **kw)
            results[rank] = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[rank] = (type(exc).__name__, str(exc))

    import threading
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * wait_s)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    left = sum(box.qsize() for box in rings[0]._queues.values())
    return results, hung, left


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_refusing_rank_sends_the_forward_rings_messages(layout, mask):
    """A rank whose input is refused takes part in the forward ring with exactly the messages of the
    others (same count, sizes, order, for every K/V-pieces / head-chunks split and ring length): every
    rank finishes, nothing is left undelivered, every rank raises, naming the refusing rank."""
    kw = MASKS[mask]
    rule = _attention_mask(kw["causal"], kw.get("cu_seqlens"), kw.get("window"), WORLD * S_LOCAL)
    steps = needed_steps(get_layout(layout), rule, WORLD, S_LOCAL)
    for head_chunks, kv_pieces in SPLITS:
        results, hung, left = _ring_with_a_refusing_rank(layout, mask, head_chunks, [kv_pieces] * WORLD)
        case = (layout, mask, head_chunks, kv_pieces, steps)
        assert not hung and left == 0, (case, hung, left, results)
        for rank, (kind, msg) in enumerate(results):
            if rank == BAD:
                assert kind == "ValueError" and "q" in msg, (case, kind, msg)
            else:
                assert kind == "RingInputError" and f"global rank(s) {BAD} rejected their input" in msg, \
                    (case, rank, kind, msg)


def test_a_diverging_message_sequence_is_caught():
    """The check above is not vacuous: a refusing rank that streams its K/V in other pieces than the
    others (a different message sequence) makes the run fail."""
    pieces = [2] * WORLD
    pieces[BAD] = 1
    results, hung, left = _ring_with_a_refusing_rank("zigzag", "causal", 1, pieces, wait_s=3.0)
    others = [results[r] for r in range(WORLD) if r != BAD]
    assert hung or left or any(kind != "RingInputError" for kind, _ in others), results
