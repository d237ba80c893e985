"""Ranks whose sequences of calls diverge onto signatures each has seen before (the cross-rank all-gather is
skipped for a seen signature) are still caught: every call's K/V carry the call's tag in their status
(core/status.py), and every rank raises RingInputError naming the ranks that called otherwise. Before, such a
call ran and its result followed neither call (found by randomized testing; docs/design.md)."""
import pytest
import torch

from megatron_ring import RingInputError, ring_attention
from megatron_ring.core.status import tag_value
from megatron_ring.core.validation import call_tag
from tests.helpers.launch import run_distributed

pytestmark = pytest.mark.slow


def _inputs(rank, s=16, h=4, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(1, s, h, d, generator=g, dtype=dtype) for _ in range(3)]


def _outcome(fn):
    try:
        fn()
    except RingInputError as exc:
        return "RingInputError", str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)
    return None, ""


def _diverge_worker(rank, world, case):
    """Both ranks make calls A and B once (both signatures checked and seen), then rank 0 makes A while the others
    make B; then both make A again. Returns (outcome of the divergent call, whether the last call's output is
    A's first output bit for bit: the ring is still in step)."""
    q, k, v = _inputs(rank)
    kw = dict(case.get("kw", {}))
    a, b = {**kw, **case["a"]}, {**kw, **case["b"]}
    first = ring_attention(q, k, v, **a)
    ring_attention(q, k, v, **b)
    got = _outcome(lambda: ring_attention(q, k, v, **(a if rank == 0 else b)))
    return got, torch.equal(ring_attention(q, k, v, **a), first)


CASES = {
    "p2p causal": dict(a=dict(causal=True), b=dict(causal=False)),
    "p2p softmax_scale": dict(a=dict(causal=True), b=dict(causal=True, softmax_scale=0.2)),
    "all_gather": dict(kw=dict(comm_type="all_gather"), a=dict(causal=True), b=dict(causal=False)),
    "a2a": dict(kw=dict(comm_type="a2a"), a=dict(causal=True), b=dict(causal=False)),
    "fp8 wire": dict(kw=dict(comm_dtype="fp8"), a=dict(causal=True), b=dict(causal=False)),
    "bf16 wire": dict(kw=dict(comm_dtype=torch.bfloat16), a=dict(causal=True), b=dict(causal=False)),
    "dropout seed": dict(a=dict(causal=True, dropout_p=0.1, dropout_seed=7),
                         b=dict(causal=True, dropout_p=0.1, dropout_seed=8)),
    # two alike calls from different sites (e.g. layers): the same signature, told apart by their call ids
    "call_id": dict(a=dict(causal=True, call_id=1), b=dict(causal=True, call_id=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_divergent_calls_raise_on_every_rank(name):
    case = CASES[name]
    results = run_distributed(_diverge_worker, 2, case, timeout=180)
    for rank, ((kind, msg), in_step) in enumerate(results):
        assert kind == "RingInputError", (name, rank, kind, msg)
        assert "made different calls" in msg and f"global rank(s) {1 - rank} called it otherwise" in msg, msg
        assert in_step, (name, rank)


def _reference_worker(rank, world, case):
    """Negative control: the same calls on every rank raise nothing (the tags agree) and the results are exact."""
    q, k, v = _inputs(rank)
    a = {**case.get("kw", {}), **case["a"]}
    outs = [_outcome(lambda: ring_attention(q, k, v, **a)) for _ in range(2)]
    return outs


@pytest.mark.parametrize("name", ["p2p causal", "a2a", "fp8 wire"])
def test_same_calls_raise_nothing(name):
    for outs in run_distributed(_reference_worker, 2, CASES[name], timeout=180):
        assert outs == [(None, "")] * 2, outs


def _window_worker(rank, world):
    """A window that shortens the ring (P=4: 2 of 4 steps), so the tags of the farther ranks travel by
    RingStatus.spread; rank 2 diverges (another scale)."""
    q, k, v = _inputs(rank, s=8)
    a = dict(causal=True, window=(3, 0), layout="contiguous")
    b = dict(a, softmax_scale=0.5)
    ring_attention(q, k, v, **a)
    ring_attention(q, k, v, **b)
    return _outcome(lambda: ring_attention(q, k, v, **(b if rank == 2 else a)))


def test_divergence_in_a_window_shortened_ring_reaches_every_rank():
    results = run_distributed(_window_worker, 4, timeout=240)
    for rank, (kind, msg) in enumerate(results):
        assert kind == "RingInputError", (rank, kind, msg)
        assert "made different calls" in msg, msg
        if rank != 2:
            assert "global rank(s) 2 called it otherwise" in msg, msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8])
def test_tag_values_are_exact_and_never_a_failure_code(dtype):
    """The tag's value is representable in the status element (exact: it survives copies and the maximum merge)
    and above the failure codes; 0 (no tag) stays OK."""
    assert tag_value(0, dtype) == 0
    for tag in [1, 2, 3, 255, 256, (1 << 63) - 1] + [call_tag((i, 7, 9)) for i in range(50)]:
        value = tag_value(tag, dtype)
        assert value >= 3
        assert torch.tensor([value], dtype=dtype).tolist() == [value]
    if dtype == torch.uint8:  # the FP8 wire's bytes: every value from 3 to 255 is some call's
        assert {tag_value(call_tag((i,)), dtype) for i in range(5000)} == set(range(3, 256))
    else:  # at least 14k values: 200 calls share a value with about 200**2 / (2 * 14336) = 1.4 others
        assert len({tag_value(call_tag((i,)), dtype) for i in range(200)}) >= 190


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8])
def test_backward_values_on_the_device_are_the_hosts(dtype):
    """The backward ring's status values (core/backward_check.py: BackwardTag): the device pattern, made by integer
    arithmetic, holds exactly the values the host compares with; they are distinct, finite and above the failure
    codes, for small tags and tags near the range's end (the pattern wraps)."""
    from megatron_ring.core.backward_check import BACKWARD_CYCLE, backward_pattern, backward_values

    for tag in (1, 7, 252, 253, 16000, (1 << 63) - 1, call_tag((3, 4))):
        values = backward_values(tag, dtype)
        device = backward_pattern(tag, dtype, torch.device("cpu"))
        assert device.dtype == dtype and device.tolist() == list(values), (tag, dtype)
        assert len(set(values)) == BACKWARD_CYCLE and min(values) >= 3
        assert all(torch.isfinite(torch.tensor(x, dtype=torch.float64)) for x in values)


def _hierarchical_worker(rank, world):
    """a2a+p2p at P=4 (2x2): rank 3 diverges (not causal); the end-of-forward status all-gather sees it (the outer
    ring's plan carries no tag)."""
    from megatron_ring.strategies import make_hierarchical_groups

    hier = make_hierarchical_groups(2)
    q, k, v = _inputs(rank, s=8)
    a = dict(causal=True, comm_type="a2a+p2p", hierarchical_groups=hier)
    b = dict(a, causal=False)
    ring_attention(q, k, v, **a)
    ring_attention(q, k, v, **b)
    got = _outcome(lambda: ring_attention(q, k, v, **(b if rank == 3 else a)))
    return got, torch.equal(ring_attention(q, k, v, **a), ring_attention(q, k, v, **a))


def test_divergence_under_a2a_p2p_raises_on_every_rank():
    for rank, ((kind, msg), in_step) in enumerate(run_distributed(_hierarchical_worker, 4, timeout=240)):
        assert kind == "RingInputError", (rank, kind, msg)
        assert "3" in msg, msg
        assert in_step


def _local_refusal_worker(rank, world, what):
    """Rank 1 alone passes a value the cross-rank check does not compare and the call refuses (a float device seed;
    an integer offset tensor); then a call made alike everywhere."""
    q, k, v = _inputs(rank)
    if what == "seed":
        kw = dict(dropout_p=0.1, dropout_seed=torch.tensor([5.0]) if rank == 1 else torch.tensor([5]))
    else:
        kw = dict(softmax_offset=torch.ones(4, dtype=torch.int64) if rank == 1 else torch.ones(4))
    got = _outcome(lambda: ring_attention(q, k, v, timeout_s=60, **kw))
    return got, _outcome(lambda: ring_attention(q, k, v, causal=True, timeout_s=60))


@pytest.mark.parametrize("what", ["seed", "sink"])
def test_a_rank_local_refusal_after_the_check_is_raised_on_every_rank_at_once(what):
    """Before, rank 1 raised its ValueError at once and rank 0 waited out its timeout in the ring (then every later
    call failed): the seed's and the offset's own checks now refuse through ``Call.refusing``, as the others."""
    (mine0, after0), (mine1, after1) = run_distributed(_local_refusal_worker, 2, what, timeout=120)
    assert mine0[0] == "RingInputError" and "rank(s) 1 rejected their input" in mine0[1], mine0
    assert mine1[0] == "ValueError", mine1
    assert after0 == after1 == (None, ""), (after0, after1)


def _short_message_worker(rank, world):
    """kv_pieces 1 and 2 both seen; then rank 1 streams 2 pieces where rank 0 streams 1: rank 0 receives messages
    half as long as its buffers (gloo takes a shorter message; rank 1 receives a longer one, which gloo aborts).
    Rank 0 must not return: its status element, first in the buffer, is the sender's, not an older call's."""
    q, k, v = _inputs(rank)
    kw = dict(causal=True, timeout_s=15)
    ring_attention(q, k, v, kv_pieces=1, **kw)
    ring_attention(q, k, v, kv_pieces=2, **kw)
    ring_attention(q, k, v, kv_pieces=1, **kw)  # rank 0's buffers now end as its own call's left them
    return _outcome(lambda: ring_attention(q, k, v, kv_pieces=2 if rank == 1 else 1, **kw))


def test_a_shorter_message_is_not_read_with_an_older_status():
    """Found by randomized testing: rank 0 returned garbage (4.6e23 against 3.4) while rank 1 aborted in gloo; the
    status element sat at the buffer's end, so a shorter message left the previous call's status there. Now rank 0
    raises (rank 1's abort is gloo's, on a message longer than its buffer: docs/design.md): RingInputError where the
    short message arrives first, RingPeerError where rank 1's connection closed first (a race of the two)."""
    got = run_distributed(_short_message_worker, 2, timeout=120, pg_timeout=25, return_exceptions=True)
    assert isinstance(got[0], tuple) and got[0][0] in ("RingInputError", "RingPeerError"), got[0]


def _backward_order_worker(rank, world, swap, check, kw=None, diverging=0):
    """Two calls of one signature (two alike layers), their forwards alike on every rank; each rank backpropagates
    them one after the other, rank 0 in the other order where ``swap``. Returns the outcome of each backward and the
    gradients' max abs difference from the same calls backpropagated in order on every rank first (the reference),
    so the negative control (``check`` False: the backward status not compared) shows what the check prevents."""
    from megatron_ring.core import kv_stream

    kw = {"causal": True, **(kw or {})}
    s = kw.pop("s", 16)
    if not check:  # the backward rings' status not compared
        class Unchecked(kv_stream.BackwardTag):
            def settle(self):
                pass

        kv_stream.BackwardTag = Unchecked

    def run(order):
        calls = []
        for i in range(2):
            q, k, v = (t.requires_grad_() for t in _inputs(rank + 10 * i, s=s))
            calls.append(((q, k, v), ring_attention(q, k, v, **kw)))
        outcomes = []
        for i in order:
            out = calls[i][1]
            outcomes.append(_outcome(lambda: out.backward(torch.ones_like(out))))
        return outcomes, [[t.grad for t in leaves] for leaves, _ in calls]

    _, ref = run([0, 1])
    outcomes, got = run([1, 0] if swap and rank == diverging else [0, 1])
    if any(kind for kind, _ in outcomes):
        return outcomes, None
    return outcomes, max(float((a - b).abs().max()) for x, y in zip(got, ref) for a, b in zip(x, y))


@pytest.mark.parametrize("world", [2, 3])
def test_a_diverging_backward_order_raises_on_every_rank(world):
    """Found by randomized testing: forwards alike, rank 0 backpropagating call A while rank 1 backpropagates B
    (one signature) gave wrong gradients silently. The backward ring's status now says which call's backward each
    rank runs (core/backward_check.py: BackwardTag); on CPU every rank raises at the end of that backward ring."""
    for rank, (outcomes, _) in enumerate(run_distributed(_backward_order_worker, world, True, True, timeout=180)):
        kind, msg = outcomes[0]
        assert kind == "RingInputError", (rank, outcomes)
        assert "ran the backward of different calls" in msg, msg
        assert ("global rank(s) 0 " in msg) if rank else all(f"{r}" in msg for r in range(1, world)), msg


@pytest.mark.parametrize("world,diverging", [(3, 1), (3, 2), (4, 0), (4, 2)])
def test_a_diverging_backward_order_in_a_window_shortened_ring_raises_on_every_rank(world, diverging):
    """A window that shortens the ring (contiguous, causal, window 3, 8 rows per rank: 2 of P steps): a rank out of
    the diverged rank's reach received no block of its, yet got its dK/dV back from it: wrong gradients, silently
    (found by randomized testing). The values now travel the remaining hops (BackwardTag.spread): every rank
    raises. Negative control: in order, nothing raises and the gradients are the reference's bit for bit."""
    kw = dict(layout="contiguous", window=(3, 0), s=8)
    got = run_distributed(_backward_order_worker, world, True, True, kw, diverging, timeout=180)
    for rank, (outcomes, _) in enumerate(got):
        assert outcomes[0][0] == "RingInputError" and "ran the backward of different calls" in outcomes[0][1], (
            rank, outcomes)
    for outcomes, err in run_distributed(_backward_order_worker, world, False, True, kw, timeout=180):
        assert all(kind is None for kind, _ in outcomes) and err == 0.0, (outcomes, err)


def test_a_diverging_backward_order_unchecked_gives_wrong_gradients():
    """Negative control: without the comparison the same backward passes raise nothing and their gradients are
    wrong; in order they raise nothing either, and equal the reference bit for bit."""
    swapped = run_distributed(_backward_order_worker, 2, True, False, timeout=180)
    assert all(all(kind is None for kind, _ in outcomes) for outcomes, _ in swapped), swapped
    assert max(err for _, err in swapped) > 1e-2, swapped
    in_order = run_distributed(_backward_order_worker, 2, False, True, timeout=180)
    assert all(all(kind is None for kind, _ in outcomes) for outcomes, _ in in_order), in_order
    assert max(err for _, err in in_order) == 0.0, in_order


def _reentrant_worker(rank, world, with_ids, diverge=True):
    """Two alike layers under REENTRANT activation checkpointing (the forward under no_grad, recomputed in the
    backward), backpropagated in different orders: rank 0 layer 1 first, rank 1 layer 2 first, so the ranks
    recompute different layers at once (``diverge`` False: one order on every rank). Returns (outcome,
    max |grad - the plain run's grad|)."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(7 + rank)
    xs = [[torch.randn(1, 16, 4, 8, generator=g) for _ in range(3)] for _ in range(2)]
    douts = [torch.randn(1, 16, 4, 8, generator=g) for _ in range(2)]

    def layer(i):
        return lambda q, k, v: ring_attention(q, k, v, causal=True, call_id=i if with_ids else None)

    def grads(ckpt):
        leaves = [[t.clone().requires_grad_() for t in x] for x in xs]
        outs = [checkpoint(layer(i), *leaves[i], use_reentrant=True) if ckpt else layer(i)(*leaves[i])
                for i in range(2)]
        for i in ((0, 1) if rank == 0 or not ckpt or not diverge else (1, 0)):
            outs[i].backward(douts[i])
        return torch.cat([t.grad.flatten() for x in leaves for t in x])

    plain = grads(False)
    got = _outcome(lambda: grads(True))
    if got[0] is not None:
        return got, None
    return got, (grads(True) - plain).abs().max().item()


def test_reentrant_checkpointing_in_different_orders_raises_with_call_ids():
    """With call ids (the Megatron layers pass their layer numbers) the ranks' recomputed forwards carry different
    tags: every rank raises RingInputError. Negative control: without them the recomputed rings mix the two layers'
    K/V and the gradients are wrong with no error (the case docs/design.md listed as not caught)."""
    for rank, ((kind, msg), _) in enumerate(run_distributed(_reentrant_worker, 2, True, timeout=180)):
        assert kind == "RingInputError", (rank, kind, msg)
        assert "made different calls" in msg and f"global rank(s) {1 - rank} called it otherwise" in msg, msg
    control = run_distributed(_reentrant_worker, 2, False, timeout=180)
    assert all(outcome == (None, "") for outcome, _ in control), control
    assert all(diff > 0.1 for _, diff in control), control


def test_reentrant_checkpointing_in_one_order_with_call_ids_is_exact():
    """No false report: the same recompute order on every rank raises nothing, and the gradients are the plain
    run's bit for bit (the recomputed forward is the same computation)."""
    for outcome, diff in run_distributed(_reentrant_worker, 2, True, False, timeout=180):
        assert outcome == (None, "") and diff == 0.0, (outcome, diff)
