"""The collective comm types (``all_gather``, ``a2a``, ``a2a+p2p``) on the CUDA path at P > 1, traced on the
fake-CUDA tier: before, the tier ran them at P = 1 only (a loopback has no process group), where every comm type is
the local computation.

Here each case runs as rank 1 of a process group of torch's ``fake`` backend (its collectives return at once and
move nothing: enough for shapes, dtypes, devices and the ops the engine issues), forward and backward
(:func:`~tests.fake_cuda.test_fake_cuda.fake_backward` walks the strategies' autograd graph). FakeTensorMode refuses
any host read of a device value, so a traced call proves the strategy makes no device-to-host synchronisation.
Before this test the strategies' status (:mod:`megatron_ring.strategies.refusal`: the all-gathered input codes) was
read from the device at the start of every call's backward, one synchronisation per layer per step; now it is read
as the ring reads its own (a host copy, read in the backward). Negative control: a device whose host reads are free
reads the codes in the forward, and the trace refuses that read.

The ops are counted as in ``test_op_count.py`` (:class:`~tests.fake_cuda.test_op_count.OpCounter`), the collectives
(``c10d::``, one launch each on NCCL) apart: :data:`CEILING` holds the numbers measured when this test was written
(a regression fails). While a CUDA graph is captured the codes are checked on the device (one device-side assert per
call), with no host copy, event or query. After a signature's first call no host<->device transfer of any kind is
made (documents, dropout, a window, the FP8 wire), and every op runs on a stream that waited for its inputs.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ring import device, ring_attention
from megatron_ring.kernels import block as K
from tests.fake_cuda.test_fake_cuda import Case, _documents, _inputs, _layout_of, _plan_on_host, fake_backward
from tests.fake_cuda.test_op_count import OpCounter
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda

RANK = 1
INNER = 2  # a2a+p2p: the inner (all-to-all) group's size


@pytest.fixture
def group(request):
    """Rank 1 of a ``fake``-backend process group of ``request.param`` ranks, and a2a+p2p's groups (None at P = 2)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_ring.strategies import hierarchical_usable, make_hierarchical_groups
    from megatron_ring.transport.groups import forget, ring_over

    world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world)
    try:
        hier = make_hierarchical_groups(INNER) if world > INNER else None
        if hier is not None:  # the one read per new pair of groups (a first call's), made before tracing
            plan = types.SimpleNamespace(ring=ring_over(dist.group.WORLD, torch.device("cpu"), None))
            assert hierarchical_usable(plan, hier, required=True, device=torch.device("cpu"))
        yield world, hier
    finally:
        forget()
        dist.destroy_process_group()


def _plan_views_on_host(case: Case, comm_type: str) -> None:
    """As ``_plan_on_host`` for the strategies' schedules (:mod:`megatron_ring.schedules.views`; a2a: the whole
    sequence in its order, and that order): their host tensors, which FakeTensorMode would make fake."""
    from megatron_ring.call import attention_mask
    from megatron_ring.kernels.dropout import FusedDropoutKernel
    from megatron_ring.kernels.varlen_plan import one_task, plan_for
    from megatron_ring.schedules.layouts import TaskKind, get_layout
    from megatron_ring.schedules.masks import needed_steps, schedule
    from megatron_ring.schedules.views import GatheredView, GroupedView

    P, s = case.P, case.s_local
    lay = get_layout(_layout_of(case))
    if comm_type == "a2a":  # the whole sequence in its order (strategies/a2a.py: sequence_order)
        GroupedView(lay, P).sequence_order(s * P)
    rule = attention_mask(case.causal, _documents(case), case.window, s * P)
    if rule.plain:
        return
    if comm_type == "all_gather":
        views = [(GatheredView(lay, P, RANK), 1, 0, 0, s * P)]
    elif comm_type == "a2a":
        views = [(get_layout("contiguous"), 1, 0, 0, s * P)]
    else:
        n = INNER if comm_type == "a2a+p2p" else P
        m, o = P // n, RANK // n
        views = [(GroupedView(lay, n), m, o, (o - t) % m, s * n) for t in range(m)]
    for view, world, rank, src, rows in views:
        needed_steps(view, rule, world, rows)
        # whole blocks on the fused dropout kernels, and as one task where the variable-length kernel takes it
        for one in (FusedDropoutKernel.one_task, one_task):
            for task in schedule(view, rule, world, rank, src, rows, rows, one):
                if task.kind is TaskKind.MASKED:
                    plan_for(task.mask)


def _case(name: str, P: int) -> Case:
    base = dict(kernel="auto", P=P, heads=(8, 8))
    return {"causal": Case(**base), "full": Case(**base, causal=False), "gqa": Case(**{**base, "heads": (8, 2)}),
            "thd": Case(**base, fmt="thd")}[name]


def trace(case: Case, comm_type: str, hier, dev: FakeCuda | None = None, calls: int = 2) -> list[OpCounter]:
    """``calls`` forward + backward calls of ``case`` with ``comm_type`` on fake CUDA, each counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _plan_on_host(case, RANK)
    _plan_views_on_host(case, comm_type)
    K._auto_choice.clear()
    counters = [OpCounter() for _ in range(calls)]
    with device.use("cuda", dev or FakeCuda()), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, kw, leaves = _inputs(case)
        # the cross-rank check of a new signature reads its all-gather once (a first call's): left out here
        kw.update(comm_type=comm_type, hierarchical_groups=hier, check_consistency=False)
        dout = torch.ones(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
        for counter in counters:
            with counter:
                out = ring_attention(q, k, v, **kw)
                fake_backward(out, dout, leaves)
    return counters


def _split(counter: OpCounter) -> tuple[int, int, int]:
    """(attention ops, collectives, other ops)."""
    coll = sum(n for name, n in counter.other.items() if name.startswith("c10d::"))
    return counter.attention, coll, sum(counter.other.values()) - coll


COMM_TYPES = ("all_gather", "a2a", "a2a+p2p")
NAMES = ("causal", "full", "gqa", "thd")
#: (attention ops, collectives, other ops of the first call, of a warm call) per case, rank 1, when this test was
#: written: may only go down. The collectives: all_gather, K/V gathered in 2 groups of heads forward and backward
#: (4), dK/dV reduce-scattered (2) and the status gather (1); a2a, Q, K/V, O forward, dO, dQ, dK/dV backward (6)
#: and the status gather; a2a+p2p, those over the inner group and the outer ring's exchanges (send and receive
#: each count). a2a runs the whole sequence in its order: 2 attention ops a call (before, every pair of shards: 8 /
#: 32 / 128 at P = 2 / 4 / 8, each with its merge: 48 / 90 / 222 other ops with the collectives). all_gather and
#: a2a+p2p join the full tasks of neighbouring shards (schedules/views.py: coalesced): before, all_gather made
#: 8 / 16 / 32 attention ops at P = 2 / 4 / 8 causal and not, a2a+p2p 16 / 32 at P = 4 / 8. The all-to-alls of Q,
#: O, dO, dQ and dK/dV pack their chunks in one copy (strategies/a2a.py: exchange_split; before, one per chunk: a2a
#: warm causal 41 / 55 / 83 other ops at P = 2 / 4 / 8, GQA 41 / 67 / 103, a2a+p2p causal 48 / 56 at P = 4 / 8)
CEILING = {
    ("all_gather", 2): {"causal": (8, 7, 44, 44), "full": (4, 7, 38, 38), "gqa": (8, 7, 44, 44), "thd": (8, 7, 44, 42)},
    ("all_gather", 4): {"causal": (12, 7, 50, 50), "full": (4, 7, 38, 38), "gqa": (12, 7, 50, 50),
                        "thd": (20, 7, 63, 60)},
    ("all_gather", 8): {"causal": (12, 7, 50, 50), "full": (4, 7, 38, 38), "gqa": (12, 7, 50, 50),
                        "thd": (36, 7, 79, 76)},
    ("a2a", 2): {"causal": (2, 7, 38, 36), "full": (2, 7, 36, 36), "gqa": (2, 7, 36, 36), "thd": (2, 7, 38, 37)},
    ("a2a", 4): {"causal": (2, 7, 42, 40), "full": (2, 7, 40, 40), "gqa": (2, 7, 52, 52), "thd": (2, 7, 42, 41)},
    ("a2a", 8): {"causal": (2, 7, 50, 48), "full": (2, 7, 48, 48), "gqa": (2, 7, 68, 68), "thd": (2, 7, 50, 49)},
    ("a2a+p2p", 4): {"causal": (12, 15, 43, 43), "full": (4, 15, 28, 28), "gqa": (12, 15, 43, 43),
                     "thd": (20, 15, 57, 50)},
    ("a2a+p2p", 8): {"causal": (20, 27, 51, 51), "full": (8, 27, 32, 32), "gqa": (20, 27, 51, 51),
                     "thd": (36, 27, 77, 66)},
}


@pytest.fixture(scope="module")
def table():
    rows = ["| comm type | P | case | attention ops | collectives | other ops, first call | other ops, warm call |",
            "|---|---|---|---|---|---|---|"]
    yield rows
    print("\n" + "\n".join(rows))


@pytest.mark.parametrize("group", [2, 4, 8], indirect=True, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_collective_comm_types_trace_without_a_host_read(group, comm_type, table):
    world, hier = group
    if comm_type == "a2a+p2p" and hier is None:
        pytest.skip("a2a+p2p needs an outer group of two ranks or more")
    got = {}
    for name in NAMES:
        first, warm = trace(_case(name, world), comm_type, hier)
        (att, coll, other_first), (att_w, coll_w, other_warm) = _split(first), _split(warm)
        assert (att, coll) == (att_w, coll_w), (name, _split(first), _split(warm))
        got[name] = (att, coll, other_first, other_warm)
        table.append(f"| {comm_type} | {world} | {name} | {att} | {coll} | {other_first} | {other_warm} |")
    ceiling = CEILING[(comm_type, world)]
    for name, (att, coll, first, warm) in got.items():
        c_att, c_coll, c_first, c_warm = ceiling[name]
        assert (att, coll) == (c_att, c_coll) and first <= c_first and warm <= c_warm, (name, got[name], ceiling[name])


@pytest.mark.parametrize("group", [4], indirect=True, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_the_status_is_read_from_a_host_copy_and_under_capture_on_the_device(group, comm_type):
    """Eagerly the gathered codes are copied to the host in the forward and read at the backward's start (no host
    wait where the copy is complete; one where the device has not reached it: the fake device's events say so).
    Under capture: no host copy, no event queried, a device-side assert instead. Negative control: a device whose
    host reads are free reads the codes in the forward, and the trace refuses that read."""
    world, hier = group
    case = _case("causal", world)
    ring = comm_type == "a2a+p2p"  # its outer ring's codes: copied and read as the ring's (core/status.py)
    for done in (True, False):
        dev = FakeCuda(events_done=done)
        trace(case, comm_type, hier, dev, calls=1)
        assert dev.log["to_host"] == 1 + ring and dev.host_waits == (0 if done else 1 + ring), (dev.log, dev.host_waits)
    dev = FakeCuda(capturing=True)
    (counter,) = trace(case, comm_type, hier, dev, calls=1)
    assert dev.log["to_host"] == 0 and dev.log["event_query"] == 0, dev.log
    assert counter.other["aten::_assert_async"] == 1 + ring, dict(counter.other)
    reads = FakeCuda()
    reads.host_reads_free = True
    with pytest.raises(Exception, match="_local_scalar_dense"):
        trace(case, comm_type, hier, reads, calls=1)


TRANSFER_CASES = {"causal": dict(), "thd": dict(fmt="thd"), "gqa-dropout": dict(heads=(8, 2), dropout=0.1),
                  "thd-dropout": dict(fmt="thd", dropout=0.1), "window": dict(window=(40, 0)), "fp8": dict(wire="fp8")}


@pytest.mark.parametrize("group", [4], indirect=True, ids=lambda p: f"P{p}")
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_no_host_transfer_after_the_first_call_and_streams_in_order(group, comm_type):
    """As ``test_host_transfers.py`` for the ring: no host<->device transfer of any kind after a signature's first
    call (documents, dropout, a window, the FP8 wire), every op on a stream that waited for its inputs
    (:class:`~tests.helpers.fake_device.StreamChecker`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.helpers.fake_device import HostTransferCounter, StreamChecker

    world, hier = group
    for name, extra in TRANSFER_CASES.items():
        case = Case(**{"kernel": "auto", "P": world, "heads": (8, 8), **extra})
        _plan_on_host(case, RANK)
        _plan_views_on_host(case, comm_type)
        dev, per_call = FakeCuda(), []
        with device.use("cuda", dev), FakeTensorMode(allow_non_fake_inputs=True), StreamChecker(dev):
            for _ in range(3):
                q, k, v, kw, leaves = _inputs(case)
                kw.update(comm_type=comm_type, hierarchical_groups=hier, check_consistency=False)
                with HostTransferCounter() as counter:
                    out = ring_attention(q, k, v, **kw)
                    fake_backward(out, torch.randn_like(out), leaves)
                per_call.append(dict(counter.counts))
        assert per_call[1:] == [{}, {}], (name, per_call)
