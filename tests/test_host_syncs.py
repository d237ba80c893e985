"""No device-to-host synchronisation in steady state: 0 per forward+backward call after the first, in every
case (the FP8 and fp16 wires included: their value checks stay on the device, core/status.py).

The calls run on CPU tensors over the loopback transport, with the device seam's fake CUDA device
(:class:`fake_device.FakeCuda`) installed for ``cpu``: the engine then takes the CUDA code path (its status
codes copied to the host without blocking at the end of the forward ring and read in the backward ring,
before its first exchange, not read in the forward as on a real CPU) while the ops still compute.
:class:`fake_device.HostReadCounter` counts every host read of a value derived from q, k, v (taint tracked
through every op: ``item``/``bool``/``int`` (``_local_scalar_dense``), ``nonzero``, ``equal``, ``tolist``,
``numpy``, ...) and the fake device's host waits. Host-side plan tensors (positions, masks) are not
derived from the inputs and do not count.

Host-to-device copies (the other direction) are counted on the fake CUDA tier, where host and device
tensors differ: ``tests/fake_cuda/test_host_transfers.py`` (:class:`fake_device.HostTransferCounter`).

The one read the refusal protocol keeps: the status codes' host copy, read by the backward ring after its set-up
and before its first exchange; it
waits only if the device has not reached the end of that call's forward ring (counted below as a host wait
when the fake device says the copy is not complete yet).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.fake_device import FakeCuda, HostReadCounter
from megatron_ring import RingInputError, device, ring_attention
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring.wire.codecs import FP8Codec


@dataclasses.dataclass(frozen=True)
class SyncCase:
    P: int = 2
    causal: bool = True
    layout: str = "zigzag"
    fmt: str = "bshd"
    heads: tuple[int, int] = (4, 2)
    wire: str | None = None
    kv_pieces: int | None = None
    head_chunks: int = 1
    window: tuple[int, int] | None = None
    sink: bool = False
    dropout: float = 0.0
    device_seed: bool = False  # the dropout seed as a one-element tensor (derived from device data)
    dims: tuple[int, int] = (16, 16)
    max_logit: bool = False  # return_max_logit (QK-clip): its pass and accumulator stay on the device

    @property
    def id(self) -> str:
        base = SyncCase()
        return "-".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != base.__dict__[f.name]).replace(" ", "") or "base"


def _sync_cases() -> list[SyncCase]:
    out = [SyncCase(P=P, causal=c, wire=w) for P in (1, 2, 4) for c in (True, False)
           for w in (None, "bf16", "fp8", "fp16")]
    out += [SyncCase(P=4, layout=lay, wire="fp8") for lay in ("striped", "contiguous")]
    out += [SyncCase(P=4, fmt="sbhd", wire="fp8"), SyncCase(P=4, fmt="thd", wire="fp8"),
            SyncCase(P=4, heads=(8, 1), wire="fp8"), SyncCase(P=4, dims=(24, 16), wire="fp8"),
            SyncCase(P=4, window=(20, 0), wire="fp8"), SyncCase(P=4, sink=True, wire="fp8"),
            SyncCase(P=4, dropout=0.1, wire="fp8"), SyncCase(P=4, dropout=0.1, device_seed=True),
            SyncCase(P=4, dropout=0.1, device_seed=True, wire="fp8"),
            SyncCase(P=4, heads=(8, 4), kv_pieces=4, wire="fp8"),
            SyncCase(P=4, heads=(8, 4), head_chunks=2, kv_pieces=2, wire="fp8"),
            SyncCase(P=2, heads=(8, 4), head_chunks=4, wire="fp16")]
    out += [SyncCase(P=P, max_logit=True, wire="fp8") for P in (1, 2, 4)]
    out += [SyncCase(P=4, fmt="thd", window=(20, 0), max_logit=True), SyncCase(P=4, layout="striped", max_logit=True,
                                                                             heads=(8, 4), kv_pieces=4)]
    return out


def _call(case: SyncCase, counter: HostReadCounter) -> None:
    s = 16
    b = 1 if case.fmt == "thd" else 2
    h, hk = case.heads

    def make(heads, d):
        shape = {"bshd": (b, s, heads, d), "sbhd": (s, b, heads, d), "thd": (s, heads, d)}[case.fmt]
        return torch.randn(shape, requires_grad=True)

    q, k, v = make(h, case.dims[0]), make(hk, case.dims[0]), make(hk, case.dims[1])
    counter.taint(q, k, v)
    kw = dict(causal=case.causal, layout=case.layout, qkv_format=case.fmt, comm_dtype=case.wire,
              kv_pieces=case.kv_pieces, head_chunks=case.head_chunks, window=case.window)
    if case.fmt == "thd":
        kw["cu_seqlens"] = torch.tensor([0, 5, s * case.P - 3])  # host boundaries (a device tensor costs a read)
    if case.sink:
        kw["softmax_offset"] = torch.zeros(h, requires_grad=True)
    if case.dropout:
        seed = 7
        if case.device_seed:
            seed = torch.tensor(7)
            counter.taint(seed)
        kw.update(dropout_p=case.dropout, dropout_seed=seed)
    with counter:
        out = ring_attention(q, k, v, ring=LoopbackRing(case.P, case.P // 2, q.device), return_max_logit=case.max_logit,
                             **kw)
        if case.max_logit:
            out, max_logit = out
            counter.taint(max_logit)  # a read of it would count too
        out.float().square().sum().backward()


def count_syncs(case: SyncCase, calls: int = 3, dev: FakeCuda | None = None) -> list[dict]:
    """Host reads per call, for ``calls`` calls of ``case`` (the first one included)."""
    dev = dev or FakeCuda()
    per_call = []
    with device.use("cpu", dev):
        for _ in range(calls):
            counter = HostReadCounter(dev)
            _call(case, counter)
            per_call.append(dict(counter.reads))
    return per_call


CASES = _sync_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_no_host_sync_after_the_first_call(case):
    per_call = count_syncs(case)
    assert per_call[1:] == [{}, {}], per_call


def test_the_counter_sees_the_old_fp8_check(monkeypatch):
    """Not vacuous: the FP8 codec's host-side finiteness check (``bool(finite.all())``, what the wire did
    before the check moved to the device) is counted: 2 per piece and call (K and V) in the forward, and
    again in the backward's K/V ring."""
    monkeypatch.setattr(FP8Codec, "encode_flagged", lambda self, k, v, out: self.encode(k, v, out))
    per_call = count_syncs(SyncCase(P=2, wire="fp8", kv_pieces=1))
    assert per_call[-1] == {"aten::_local_scalar_dense": 4}, per_call


def test_a_host_that_runs_ahead_waits_once_per_ring_at_the_status_read():
    """Where the refusal protocol reads: the status copy, at the start of the backward ring. If the device
    has not reached the end of the forward ring by then, that read waits, once per forward ring (one per call:
    K/V pieces share the ring's status)."""
    per_call = count_syncs(SyncCase(P=2, heads=(4, 4), kv_pieces=2), dev=FakeCuda(events_done=False))
    assert per_call[-1] == {"host wait (event)": 1}, per_call


def _order_of_the_status_read(monkeypatch, kv_pieces: int = 1) -> list[str]:
    """What happens around the backward's status read on the CUDA path, in order: the backward's K/V written into
    its wire slots (``bwd kv write``), the host wait for the forward's end (``wait``; the fake device says the
    copy is not complete: a host that runs ahead), the exchanges by channel."""
    from megatron_ring.core import kv_stream
    from megatron_ring.transport import ring as ring_mod

    log: list[str] = []
    dev = FakeCuda(events_done=False)
    waits = dev.wait_event_host
    monkeypatch.setattr(dev, "wait_event_host", lambda event: (log.append("wait"), waits(event))[1])
    writes = kv_stream.foreach_into

    def write(dsts, srcs, **kw):
        log.append("kv write")
        return writes(dsts, srcs, **kw)

    monkeypatch.setattr(kv_stream, "foreach_into", write)
    exchange = ring_mod.LoopbackRing.exchange
    monkeypatch.setattr(ring_mod.LoopbackRing, "exchange",
                        lambda self, send, recv, channel, step: (log.append(channel), exchange(self, send, recv,
                                                                                              channel, step))[1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 4, 16, generator=g).requires_grad_() for _ in range(3))
    with device.use("cpu", dev):
        ring_attention(q, k, v, causal=True, ring=LoopbackRing(2, 1, q.device), kv_pieces=kv_pieces).sum().backward()
    return log


def _read_after_set_up(log: list[str]) -> bool:
    """The wait comes after the backward's K/V write and before any backward exchange."""
    at = log.index("wait")
    backward = [i for i, x in enumerate(log) if x.startswith("bwd_")]
    writes = [i for i, x in enumerate(log) if x == "kv write"]
    return log.count("wait") == 1 and writes[-1] < at < backward[0]


@pytest.mark.parametrize("kv_pieces", [1, 2])
def test_the_status_read_waits_after_the_backward_set_up_before_its_first_exchange(monkeypatch, kv_pieces):
    """Where the host must wait for the forward's end (a backward that follows its forward at once: activation
    recomputation, a benchmark of one call), the backward's set-up is already launched by then (its buffers,
    its K/V written into the wire), and no backward exchange is: a rank that refused is not on this ring."""
    log = _order_of_the_status_read(monkeypatch, kv_pieces)
    assert _read_after_set_up(log), log


def test_the_status_read_order_check_fails_on_a_read_before_the_set_up(monkeypatch):
    """Negative control: the read at the very start of the backward ring (before its K/V write), as it was."""
    from megatron_ring.core import engine

    made = engine.KVStream

    def read_first(plan, *args, **kw):
        if args[2] == "bwd_kv":
            plan.checks.check()
        return made(plan, *args, **kw)

    monkeypatch.setattr(engine, "KVStream", read_first)
    log = _order_of_the_status_read(monkeypatch)
    assert not _read_after_set_up(log), log


def test_a_device_side_refusal_still_raises_on_every_rank():
    """The FP8 check on the device: the refusing rank's status travels the ring; the other ranks (and the
    refusing one, with the element named) raise at the status read, the start of the backward."""
    from tests.helpers.ring_fakes import run_threads
    from megatron_ring.errors import WireFiniteError

    def body(rank, ring):
        q = torch.randn(1, 8, 2, 8, requires_grad=True)
        k = torch.randn(1, 8, 2, 8)
        if rank == 1:
            k[0, 3, 1, 2] = float("inf")
        out = ring_attention(q, k.requires_grad_(), k.detach().clone().requires_grad_(), ring=ring,
                             comm_dtype="fp8")
        out.sum().backward()

    with device.use("cpu", FakeCuda()):
        results = run_threads(body, 3)
    for rank, res in enumerate(results):
        assert isinstance(res, WireFiniteError), (rank, res)
        if rank == 1:
            assert "contains inf/NaN at [b, h, group]" in str(res)
        else:
            assert "global rank(s) 1" in str(res)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_call_without_backward_reads_once_at_the_forward_end(requires_grad):
    """torch.no_grad with a value-checking wire: nothing would read the codes later, so the forward's end
    does (one read per forward ring); every rank raises there. Without a checking wire: no read. The same where
    the inputs require grad (parameters' projections in an evaluation under no_grad): no backward follows a call
    made with grad mode off, whatever its inputs require."""
    from tests.helpers.ring_fakes import run_threads
    from megatron_ring.errors import WireFiniteError

    def body(rank, ring, wire, bad):
        k = torch.randn(1, 8, 2, 8)
        if bad and rank == 2:
            k[0, 1, 0, 0] = float("nan")
        k.requires_grad_(requires_grad)
        counter = HostReadCounter()
        counter.taint(k)
        with counter, torch.no_grad():
            ring_attention(k, k, k, ring=ring, comm_dtype=wire)
        return counter.total()

    with device.use("cpu", FakeCuda()):
        assert run_threads(lambda r, ring: body(r, ring, "fp8", False), 3) == [1, 1, 1]
        assert run_threads(lambda r, ring: body(r, ring, "bf16", False), 3) == [0, 0, 0]
        results = run_threads(lambda r, ring: body(r, ring, "fp8", True), 3)
    assert all(isinstance(res, WireFiniteError) for res in results), results


# --- the collective comm types (all_gather, a2a, a2a+p2p): their wire checks on the device too -------------

COLLECTIVE_TYPES = ("all_gather", "a2a", "a2a+p2p")


def _collective_worker(rank, world, wires, bad_rank=None, old_check=False, max_logit=False):
    """Per comm type and wire: the host reads per call of 3 forward+backward calls (fake CUDA device), or,
    with ``bad_rank``, the error every rank raises when that rank's K holds an inf."""
    from megatron_ring.strategies import make_hierarchical_groups

    if old_check:  # what the collectives did before: the codec's host check at every encode
        FP8Codec.encode_flagged = lambda self, k, v, out: self.encode(k, v, out)
    hier = make_hierarchical_groups(2)
    out = {}
    for comm_type in COLLECTIVE_TYPES:
        for wire in wires:
            dev = FakeCuda()
            per_call = []
            with device.use("cpu", dev):
                for call in range(3):
                    g = torch.Generator().manual_seed(call)
                    q, k, v = (torch.randn(2, 8, 4, 16, generator=g).requires_grad_(True) for _ in range(3))
                    if bad_rank == rank:
                        with torch.no_grad():
                            k[0, 3, 1, 2] = float("inf")
                    counter = HostReadCounter(dev)
                    counter.taint(q, k, v)
                    try:
                        with counter:
                            o = ring_attention(q, k, v, causal=True, comm_type=comm_type, comm_dtype=wire,
                                               hierarchical_groups=hier if comm_type == "a2a+p2p" else None,
                                               return_max_logit=max_logit)
                            o = o[0] if max_logit else o
                            o.float().square().sum().backward()
                    except Exception as exc:  # noqa: BLE001 - the refusal: reported as its type and text
                        per_call.append(f"{type(exc).__name__}: {exc}")
                        break
                    per_call.append(dict(counter.reads))
            out[f"{comm_type}/{wire}"] = per_call
    return out


@pytest.mark.slow
def test_collective_comm_types_make_no_host_sync_after_the_first_call():
    """all_gather, a2a and a2a+p2p with the FP8 / fp16 / bf16 wires: 0 host reads per call after the first
    (their codecs' value checks run on the device, the verdict joins the status the ranks all-gather, read
    at the start of the backward on CUDA)."""
    from tests.helpers.launch import run_distributed

    for rank, res in enumerate(run_distributed(_collective_worker, 4, ("fp8", "fp16", "bf16"), timeout=300)):
        for case, per_call in res.items():
            assert per_call[1:] == [{}, {}], (rank, case, per_call)


@pytest.mark.slow
def test_collective_comm_types_with_max_logit_make_no_host_sync_after_the_first_call():
    """return_max_logit on all_gather, a2a (its rows' all-to-all home) and a2a+p2p: still 0 host reads per call
    after the first."""
    from tests.helpers.launch import run_distributed

    for rank, res in enumerate(run_distributed(_collective_worker, 4, ("fp8",), None, False, True, timeout=300)):
        for case, per_call in res.items():
            assert per_call[1:] == [{}, {}], (rank, case, per_call)


@pytest.mark.slow
def test_the_collective_counter_sees_the_old_host_check():
    """Not vacuous: with the FP8 codec's host check at every encode (as before), reads are counted."""
    from tests.helpers.launch import run_distributed

    for rank, res in enumerate(run_distributed(_collective_worker, 4, ("fp8",), None, True, timeout=300)):
        for case, per_call in res.items():
            assert all(n.get("aten::_local_scalar_dense", 0) > 0 for n in per_call[1:]), (rank, case, per_call)


@pytest.mark.slow
def test_a_device_side_refusal_of_a_collective_still_raises_on_every_rank():
    """The verdict travels in the status the ranks all-gather: every rank raises WireFiniteError at the
    start of the backward (CUDA's path), the refusing rank naming the element, the others naming it."""
    from tests.helpers.launch import run_distributed

    for rank, res in enumerate(run_distributed(_collective_worker, 4, ("fp8",), 1, timeout=300)):
        for case, per_call in res.items():
            assert len(per_call) == 1 and per_call[0].startswith("WireFiniteError"), (rank, case, per_call)
            if rank == 1:
                assert "inf/NaN at [b, h, group]" in per_call[0], (rank, case, per_call)
            else:
                assert "global rank(s) 1" in per_call[0], (rank, case, per_call)


# --- under CUDA-graph capture (the device seam's ``capturing``): no host read, no event, the codes asserted --

def test_under_capture_the_status_is_asserted_on_the_device_not_read():
    """While the stream is captured: no host read, no host copy of the codes, no event recorded or queried
    by the status (a query invalidates a capture; what the host decided would not replay); the codes are
    checked by a device-side assert instead, once per forward ring. Eagerly: one host copy per ring, no
    assert."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Asserts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._assert_async.msg or func is torch.ops.aten._assert_async.default:
                Asserts.n += 1
            return func(*args, **(kwargs or {}))

    for capturing, wire in ((True, "fp8"), (True, None), (False, "fp8")):
        dev = FakeCuda(capturing=capturing)
        case = SyncCase(P=4, heads=(4, 2), kv_pieces=2, wire=wire)
        Asserts.n = 0
        with device.use("cpu", dev), Asserts():
            for _ in range(2):
                counter = HostReadCounter(dev)
                _call(case, counter)
                assert dict(counter.reads) == {}, (capturing, counter.reads)
        if capturing:
            assert dev.log["to_host"] == 0 and dev.log["event_query"] == 0, dev.log
            assert Asserts.n == 2, Asserts.n  # one status per ring (forward and backward), K/V pieces included
        else:
            assert dev.log["to_host"] == 2 and Asserts.n == 0, (dev.log, Asserts.n)


def test_under_capture_a_refusal_stops_every_rank_at_the_device_assert():
    """A rank whose K/V the FP8 wire refuses, under capture: its code travels the ring as usual and every
    rank's device-side assert fails (on a GPU: the replay stops; here, CPU tensors, it raises at once)."""
    from tests.helpers.ring_fakes import run_threads

    def body(rank, ring):
        k = torch.randn(1, 8, 2, 8)
        if rank == 1:
            k[0, 3, 1, 2] = float("inf")
        ring_attention(k.clone().requires_grad_(), k.requires_grad_(), k.detach().clone().requires_grad_(),
                       ring=ring, comm_dtype="fp8")

    with device.use("cpu", FakeCuda(capturing=True)):
        results = run_threads(body, 3)
    assert all(isinstance(r, RuntimeError) and "refused its input" in str(r) for r in results), results


@pytest.mark.parametrize("capturing", [True, False])
def test_ranks_that_made_different_calls_stop_every_rank(monkeypatch, capturing):
    """The call's tag (core/status.py) as a process group's check gives it, rank 1's another (it made another call):
    under capture every rank's device-side assert fails (the replay would stop) and the pattern the graph reads is
    kept for the process; eagerly every rank raises RingInputError naming rank 1 (before its backward ring's first
    exchange)."""
    from megatron_ring import call as call_mod
    from megatron_ring.core import status
    from tests.helpers.ring_fakes import run_threads

    real = call_mod._agreed_codec
    monkeypatch.setattr(call_mod, "_agreed_codec",
                        lambda ring, *a, **kw: (real(ring, *a, **kw)[0], 8 if ring.rank == 1 else 7))
    kept = len(status.CAPTURED)

    def body(rank, ring):
        k = torch.randn(1, 8, 2, 8, requires_grad=True)
        ring_attention(k, k, k, ring=ring).sum().backward()  # eagerly on CUDA the codes are read by the backward

    with device.use("cpu", FakeCuda(capturing=capturing)):
        results = run_threads(body, 3)
    if capturing:
        assert all(isinstance(r, RuntimeError) and "different calls" in str(r) for r in results), results
        assert len(status.CAPTURED) > kept
    else:
        assert all(isinstance(r, RingInputError) and "global rank(s) 1 called it otherwise" in str(r)
                   for r in (results[0], results[2])), results
        assert isinstance(results[1], RingInputError) and "global rank(s) 0, 2 called it otherwise" in str(results[1])


def test_under_capture_the_exchange_deadline_is_not_watched(monkeypatch):
    """The exchange's deadline (an event per launch, watched by a thread that queries it) is skipped while
    capturing: a query during capture would invalidate it. Eagerly the launch is watched."""
    from tests.helpers.ring_fakes import NcclLikeWork, ring_as
    import torch.distributed as dist
    from megatron_ring.transport.deadline import watchdog

    watched = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [NcclLikeWork()])
    monkeypatch.setattr(watchdog, "watch", lambda *a, **kw: watched.append(a))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for capturing in (True, False):
            dev = FakeCuda(capturing=capturing)
            with device.use("cpu", dev):
                ring = ring_as(2, 4, coalesced=True, timeout_s=30)
                ring.watchdog_deadline = True
                ring.exchange(torch.zeros(4), torch.empty(4), "fwd_kv", 0)
            assert (len(watched), dev.log["record_event"]) == ((0, 0) if capturing else (1, 1)), (watched, dev.log)
            watched.clear()
    finally:
        dist.destroy_process_group()


def test_cuda_status_copies_reuse_their_pinned_buffers(monkeypatch):
    """CudaOps.to_host: a pinned host buffer per forward ring is taken from those given back after their
    read (PendingChecks.check), not allocated per call (torch.empty(pin_memory=True) counted here, on CPU)."""
    made = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        t = real_empty(*shape, **kw)
        made.append(pin_memory)
        return t

    ops = device.CudaOps()
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(device.CudaOps, "record_event", lambda self, stream=None: None)
    codes = torch.zeros(4)
    first, _ = ops.to_host(codes)
    ops.give_host(first)
    again, _ = ops.to_host(codes)
    held, _ = ops.to_host(codes)  # the first is in use: a second buffer
    assert again is first and held is not first and made == [True, True], made


def test_a_device_cu_seqlens_is_read_once_per_tensor_and_version():
    """``cu_seqlens`` as a device tensor: read on the host to plan the schedule, ONCE per tensor object and
    version (every layer of a step passes the same tensor): 1 read at the first call, 0 after; an in-place
    change (version bump) or a new tensor reads again."""
    dev = FakeCuda()
    cu = torch.tensor([0, 5, 29])
    reads = []
    with device.use("cpu", dev):
        for step in range(5):
            if step == 3:
                cu[1] = 7  # in place: the version counter moves, the values are read again
            if step == 4:
                cu = torch.tensor([0, 9, 29])  # a new batch's tensor
            q, k, v = (torch.randn(16, 2, 8, requires_grad=True) for _ in range(3))
            counter = HostReadCounter(dev)
            counter.taint(q, k, v, cu)
            with counter:
                out = ring_attention(q, k, v, ring=LoopbackRing(2, 1, q.device), causal=True, qkv_format="thd",
                                     cu_seqlens=cu)
                out.sum().backward()
            reads.append(counter.total())
    assert reads == [1, 0, 0, 1, 1], reads


def test_a_device_dropout_seed_is_never_read_on_the_host():
    """A tensor seed (as the Megatron glue draws it on the device) costs no read, the first call included,
    beyond what the same call with an int seed costs there (the once-per-signature cross-rank check)."""
    with_int = count_syncs(SyncCase(P=4, dropout=0.1), calls=2)
    with_tensor = count_syncs(SyncCase(P=4, dropout=0.1, device_seed=True), calls=2)
    assert with_tensor == with_int, (with_tensor, with_int)


@pytest.mark.parametrize("swap", [True, False])
def test_a_diverging_backward_order_is_raised_by_every_rank_at_the_next_backward(monkeypatch, swap):
    """On the CUDA path the backward ring's status (which call's backward each rank runs, core/backward_check.py:
    BackwardTag) is not read at its end (that would synchronise): its host copy is read with the next call's forward
    codes, at that call's backward ring's start, where every rank raises RingInputError naming the others; with no
    host sync of its own (no host wait: the copy is complete by then). Negative control: in order, nothing raises."""
    from megatron_ring import call as call_mod
    from tests.helpers.ring_fakes import run_threads

    real = call_mod._agreed_codec
    monkeypatch.setattr(call_mod, "_agreed_codec", lambda ring, *a, **kw: (real(ring, *a, **kw)[0], 7))
    dev = FakeCuda()

    def body(rank, ring):
        def call(i):
            g = torch.Generator().manual_seed(10 * i + rank)
            k = torch.randn(1, 8, 2, 8, generator=g, requires_grad=True)
            return ring_attention(k, k, k, ring=ring)

        outs = [call(0), call(1)]
        for i in ([1, 0] if swap and rank == 0 else [0, 1]):
            outs[i].sum().backward()  # not raised here: read with the next call's forward codes
        after = call(2)
        try:
            after.sum().backward()
        except RingInputError as exc:
            return exc
        return None

    with device.use("cpu", dev):
        results = run_threads(body, 3)
    assert dev.host_waits == 0, dev.host_waits
    if not swap:
        assert results == [None] * 3, results
        return
    assert all(isinstance(r, RingInputError) and "ran the backward of different calls" in str(r) for r in results), \
        results
    assert "global rank(s) 1, 2 backpropagated another call" in str(results[0]), results[0]
    assert all("global rank(s) 0 backpropagated another call" in str(r) for r in results[1:]), results


@pytest.mark.parametrize("then", ["inference", "training", "alike"])
def test_calls_without_backward_are_judged_at_a_later_call(monkeypatch, then):
    """On the CUDA path a call without a backward, on a wire that checks no values, leaves its status codes' host
    copy on the ring (core/status.py: defer): ranks that made different calls (rank 1's tag another) return, and
    every rank raises RingInputError at a later call, naming rank 1 and saying an earlier call's results were not
    valid: in an inference loop once LATE_CHECKS more such calls are left (2 here), in training at the next call's
    backward. No host sync (no host wait: the copies are complete by then). Negative control: alike calls never
    raise."""
    from megatron_ring import call as call_mod
    from megatron_ring.core import status
    from tests.helpers.ring_fakes import run_threads

    monkeypatch.setattr(status, "LATE_CHECKS", 2)
    real = call_mod._agreed_codec
    monkeypatch.setattr(call_mod, "_agreed_codec", lambda ring, *a, **kw: (
        real(ring, *a, **kw)[0], 8 if ring.rank == 1 and then != "alike" and not ring.later else 7))
    dev = FakeCuda()

    def body(rank, ring):
        ring.later = False
        k = torch.randn(1, 8, 2, 8, requires_grad=True)
        with torch.no_grad():
            ring_attention(k, k, k, ring=ring)  # the divergent call: returns
        ring.later = True
        got = []
        for _ in range(3):
            try:
                if then == "training":
                    ring_attention(k, k, k, ring=ring).sum().backward()
                else:
                    with torch.no_grad():
                        ring_attention(k, k, k, ring=ring)
                got.append(None)
            except RingInputError as exc:
                got.append(str(exc))
        return got

    with device.use("cpu", dev):
        results = run_threads(body, 3)
    assert dev.host_waits == 0, dev.host_waits
    if then == "alike":
        assert results == [[None] * 3] * 3, results
        return
    at = 0 if then == "training" else 1  # the 3rd no-backward call leaves a 3rd check: the oldest is read then
    for rank, got in enumerate(results):
        assert all(g is None for i, g in enumerate(got) if i != at), (rank, got)
        msg = got[at]
        assert msg and "made different calls" in msg and "EARLIER call" in msg, (rank, got)
        assert ("global rank(s) 1 called it otherwise" in msg) if rank != 1 else ("0, 2 called it otherwise" in msg)


@pytest.mark.parametrize("capturing", [True, False])
def test_plan_tensors_a_capture_reads_are_held_whatever_the_caches_evict(capturing):
    """A CUDA graph reads the plan's device tensors made before its capture (a masked task's ``cum_seq_q/k`` on the
    variable-length kernel, dropout's global positions, the status patterns) at every replay; the caches holding them
    evict (by count and bytes), which would free memory the replay still reads. Read under capture, each is held for
    the process (``device.CAPTURED``); eagerly (the negative control) none is."""
    from megatron_ring.kernels import varlen, varlen_plan
    from megatron_ring.schedules import masks, on_device

    for cache in (masks._CACHE, on_device._CACHE):
        cache.clear()
    varlen_plan._PLANS.clear()
    ids_before = set(device.CAPTURED)
    q = torch.randn(24, 2, 8)
    with varlen.cpu_stand_in(), device.use("cpu", FakeCuda(capturing=capturing)):
        ring_attention(q, q, q, ring=LoopbackRing(2, 0, q.device), qkv_format="thd", cu_seqlens=[0, 11, 30, 48],
                       layout="striped", causal=True)
        ring_attention(q[None], q[None], q[None], ring=LoopbackRing(2, 0, q.device), causal=True, dropout_p=0.1,
                       dropout_seed=3)
    cum = [t for plan in list(varlen_plan._PLANS.values()) if plan is not None
           for got in plan._on.values() for pair in got for t in pair]
    positions = [t for key, (t, _) in on_device._CACHE._entries.items() if key[0][0] == "positions"]
    assert cum and positions
    held = [id(t) in device.CAPTURED for t in cum + positions]
    assert all(held) if capturing else not any(held), held
    if not capturing:
        assert set(device.CAPTURED) == ids_before
