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

from dist_utils import run_distributed
from megatron_ring import ring_attention
from megatron_ring.errors import WireFiniteError
from megatron_ring.errors import RingInputError

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
                kernel = "sdpa_cuda"  # a kernel this rank's device cannot run (rank-local: not in the signature)
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


@pytest.mark.parametrize("fault, comm_dtype", [("nan", "fp8"), ("huge", "fp16")])
def test_refused_kv_on_one_rank_raises_on_every_rank(outcomes, fault, comm_dtype):
    for rank, (kind, msg, elapsed) in enumerate(outcomes[(fault, comm_dtype)]):
        assert kind == "WireFiniteError", (rank, kind, msg)
        assert elapsed < TIMEOUT_S, f"rank {rank} raised after {elapsed:.1f}s: a time-out, not the in-band status"
        if rank == BAD:
            assert ("contains inf/NaN" if fault == "nan" else "fp16 max") in msg, msg  # the detailed local error
        else:
            assert f"global rank(s) {BAD} cannot be sent" in msg, msg


def test_nan_on_a_bf16_wire_propagates_instead(outcomes):
    """bf16 (and as-is) wires carry inf/NaN as SDPA would: nobody raises, the NaN shows in the output."""
    res = outcomes[("nan", "bf16")]
    assert [r[0] for r in res] == ["ok"] * 4
    assert res[BAD][1] and res[BAD + 1][1]  # zigzag causal: ranks 2 and 3 attend to rank 2's first chunk


@pytest.mark.parametrize("fault", ["kernel", "stride"])
def test_rank_local_input_error_raises_on_every_rank(outcomes, fault):
    for rank, (kind, msg, elapsed) in enumerate(outcomes[(fault, None)]):
        assert elapsed < TIMEOUT_S, f"rank {rank} raised after {elapsed:.1f}s"
        if rank == BAD:
            assert kind == "ValueError", (kind, msg)
        else:
            assert kind == "RingInputError" and f"global rank(s) {BAD} rejected their input" in msg, (rank, kind, msg)


def test_ring_still_works_after_the_errors(outcomes):
    assert [r[:2] for r in outcomes[("none", "fp8")]] == [("ok", False)] * 4


def test_error_types_are_value_errors():
    assert issubclass(RingInputError, ValueError) and issubclass(WireFiniteError, ValueError)
