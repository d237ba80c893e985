"""No host<->device transfer of any kind in steady state, on the CUDA path: 0 per forward+backward call after
the first, BOTH directions (:class:`fake_device.HostTransferCounter`): device-to-host reads, and host-to-device
copies (a copy from pageable host memory synchronises the host with the device, which is what
``torch.cuda.set_sync_debug_mode("error")`` flags on a GPU). ``tests/test_host_syncs.py`` counts the reads
of input-derived values on the CPU tier; there a host tensor and a device tensor are both CPU tensors, so the
copies are counted here, where the device is fake CUDA and the host is the CPU.

The cases where a GPU run found host-to-device copies at every call: packed THD with documents (the
explicit masks' index vectors) and dropout (the global positions its hash keys on, and its row ids);
windows take the same mask path. The plan's index tensors now live on the device, copied once per
signature (``schedules/on_device.py``, ``BlockMask.vectors``; a masked task's segment plan on the
variable-length flash kernel, ``SegmentPlan.cum`` in ``kernels/varlen_plan.py``): the first call copies, later
ones do not.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ring import device, ring_attention
from megatron_ring.core import plan as plan_module
from megatron_ring.kernels import varlen_plan
from megatron_ring.schedules import masks
from megatron_ring.transport.ring import LoopbackRing
from tests.fake_cuda.test_fake_cuda import Case, _inputs, _plan_on_host, fake_backward
from tests.helpers.fake_device import FakeCuda, HostTransferCounter

pytestmark = pytest.mark.fake_cuda

CASES = [Case(P=4), Case(P=4, wire="fp8"), Case(P=4, heads=(8, 2), kv_pieces=2),
         Case(P=4, fmt="thd"), Case(P=2, fmt="thd", causal=False), Case(P=4, window=(40, 0)),
         Case(P=2, causal=False, window=(64, 64), layout="contiguous"),
         Case(kernel="auto", P=4, dropout=0.1),  # the seed a CUDA tensor (P > 1)
         Case(kernel="auto", P=1, dropout=0.1, comm_type="all_gather"),
         Case(kernel="auto", P=4, fmt="thd", dropout=0.1), Case(kernel="auto", P=2, dtype=torch.float32),
         Case(kernel="auto", P=4, fmt="thd", dtype=torch.float32)]  # fp32 on CUDA: masked tasks on the math kernel


def transfers_per_call(case: Case, calls: int = 3, seam: list | None = None) -> list[dict]:
    """Host<->device transfers of each of ``calls`` forward+backward calls of ``case`` (one fake device and
    one fake mode for all: the caches persist from call to call as on a GPU). ``seam``: gets, per call, the
    host-to-device copies made through the device seam (``device.to_device``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank = case.P // 2
    _plan_on_host(case, rank)
    out_counts = []
    dev = FakeCuda()
    with device.use("cuda", dev), FakeTensorMode(allow_non_fake_inputs=True):
        for _ in range(calls):
            q, k, v, kw, leaves = _inputs(case)
            before = dev.log["to_device"]
            with HostTransferCounter() as counter:
                out = ring_attention(q, k, v, ring=LoopbackRing(case.P, rank, q.device), **kw)
                fake_backward(out, torch.randn_like(out), leaves)
            out_counts.append(dict(counter.counts))
            if seam is not None:
                seam.append(dev.log["to_device"] - before)
    return out_counts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_no_host_transfer_after_the_first_call(case):
    per_call = transfers_per_call(case)
    assert per_call[1:] == [{}, {}], per_call


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_first_calls_copies_go_through_the_seam(case):
    """The first call of a signature copies the plan's index tensors to the device: each copy goes through the
    device seam (``device.to_device``), which on CUDA copies from pinned memory without making the host wait (a
    copy from pageable memory waits for the device's queue; packed batches with new documents make one in every
    micro-batch's first layer). Not vacuous: the cases with documents, dropout or a causal window copy something."""
    seam: list[int] = []
    per_call = transfers_per_call(case, calls=2, seam=seam)
    copies = [sum(n for what, n in c.items() if what.startswith("host->device")) for c in per_call]
    assert copies == seam, (per_call, seam)
    if case.fmt == "thd" or case.dropout or (case.window and case.causal):
        assert copies[0] > 0


def _copy_every_call(self, device="cpu"):
    return tuple(t.to(device) for t in (self.qpos, self.qdoc, self.kpos, self.kdoc))  # the seam bypassed, as before


def _cum_every_call(self, device, b):
    return [tuple(torch.tensor(c, dtype=torch.int32).to(device) for c in call.batched(b)) for call in self.calls]


def _positions_every_call(schedule, seq_len, world, rank, device):
    return schedule.positions(seq_len, world, rank).to(device)


@pytest.mark.parametrize("case, patch", [
    (Case(P=4, fmt="thd"), (varlen_plan.SegmentPlan, "cum", _cum_every_call)),
    (Case(kernel="auto", P=4, fmt="thd", dtype=torch.float32), (masks.BlockMask, "vectors", _copy_every_call)),
    (Case(kernel="auto", P=4, dropout=0.1), (plan_module, "positions_on", _positions_every_call)),
], ids=["thd-segments-copied-per-call", "thd-fp32-mask-copied-per-call", "dropout-positions-copied-per-call"])
def test_the_counter_sees_the_copies_the_gpu_run_found(monkeypatch, case, patch):
    """Not vacuous: with the index tensors copied to the device at every call (as before), every call
    counts host-to-device copies."""
    monkeypatch.setattr(*patch)
    per_call = transfers_per_call(case)
    assert all(n.get("host->device aten::_to_copy", 0) > 0 for n in per_call), per_call


def test_the_counter_sees_a_device_to_host_copy():
    """Not vacuous in the other direction: a copy of a CUDA tensor to the host is counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda()), FakeTensorMode(), HostTransferCounter() as counter:
        torch.ones(4, device="cuda").to("cpu")
        torch.ones(4, device="cuda")[torch.arange(2)]  # a host index into a device tensor: copied there
    assert counter.counts == {"device->host aten::_to_copy": 1, "host->device aten::index": 1}


def test_a_plans_index_tensors_are_copied_together():
    """``device.to_device_together`` (a segment plan's cumulative lengths, a mask's four vectors): tensors of one dtype
    in ONE copy through the seam, each a contiguous view of one device tensor with its values; of several dtypes, one
    copy each (the negative control of the count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    host = [torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
            torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)]
    dev = FakeCuda()
    with device.use("cuda", dev):
        with FakeTensorMode(allow_non_fake_inputs=True):
            got = device.to_device_together(host, "cuda")
            assert dev.log["to_device"] == 1
            assert [(g.shape, g.dtype, g.device.type, g.is_contiguous()) for g in got] == \
                [(h.shape, h.dtype, "cuda", True) for h in host]
            assert len({g.untyped_storage()._cdata for g in got}) == 1  # one device tensor
            device.to_device_together([host[0], host[1].long()], "cuda")
            assert dev.log["to_device"] == 3
        with device.use("cpu", dev):  # the values, on a device whose tensors can be read
            got = device.to_device_together(host, "cpu")
            assert all(torch.equal(g, h) for g, h in zip(got, host))
