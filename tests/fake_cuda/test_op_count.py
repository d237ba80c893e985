"""Device ops per call on the CUDA path, counted on the fake-CUDA tier (issue 34: a ring step should be its
attention kernel plus one fused epilogue).

One forward + backward of ``ring_attention`` on :class:`LoopbackRing` (rank 1, kernel ``auto``) is traced as in
``test_fake_cuda.run_case`` (FakeTensorMode, the fake CUDA device) under :class:`OpCounter`, a dispatch mode
that sees every aten op the engine issues. The counting rule:

- an op counts when one of its tensor arguments or results is on ``cuda`` (host ops of the planner do not);
- view and metadata ops are not launches and never count: every op whose schema says it returns an alias
  (``func.is_view``: view, as_strided, t, permute, expand, slice, select, unbind, detach, alias, ...) and the
  allocations (``empty``, ``empty_strided``, ``new_empty``, ``empty_like``: no kernel runs), plus
  ``_unsafe_view`` (a view without the alias annotation), ``record_stream`` (host bookkeeping) and the ``prim``
  namespace (``prim::device``: a tensor's device, metadata);
- an attention op is one of the kernels' aten ops (``_scaled_dot_product_*``, ``_flash_attention_*``,
  ``_efficient_attention_*``, ``_cudnn_attention_*``); everything else (copies, element-wise math, fills,
  reductions, our fused ``megatron_ring::merge_``) is "other".

On a GPU each counted op is one kernel launch (or one copy); issue 34 matched this count (131 ops at P=4) to the
127 launches the torch profiler counted on an H200. The test prints a table per case and asserts two things:
``other`` stays within :data:`CEILING` (the numbers measured when this test was written: a regression fails),
and the target of issue 34, at most 3 other ops per attention op, in :func:`test_target_three_ops_per_kernel`
(``xfail``, not strict, until the exchange copies, slot writes, layout copies and lse conversions are gone; GQA's
K/V expansion is, where torch's SDPA takes GQA as it is).
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ring import device, ring_attention
from megatron_ring.transport.ring import LoopbackRing
from tests.fake_cuda.test_fake_cuda import Case, _inputs, _plan_on_host, fake_backward
from tests.helpers.fake_device import FakeCuda

pytestmark = pytest.mark.fake_cuda

_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
_NOT_LAUNCHES = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "record_stream",
                 "_unsafe_view"}


def _on_cuda(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if isinstance(obj, (list, tuple)):
        return any(_on_cuda(o) for o in obj)
    if isinstance(obj, dict):
        return any(_on_cuda(o) for o in obj.values())
    return False


class OpCounter(TorchDispatchMode):
    """Counts the device ops dispatched under it (the rule: the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = 0
        self.other: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if (getattr(func, "is_view", False) or name in _NOT_LAUNCHES or func.namespace == "prim"
                or not _on_cuda((args, kwargs, out))):
            return out
        if name.startswith(_ATTENTION):
            self.attention += 1
        else:
            self.other[f"{func.namespace}::{name}"] += 1
        return out


def count(case: Case, rank: int = 1) -> OpCounter:
    """One forward + backward of ``case`` on fake CUDA, counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _plan_on_host(case, rank)
    counter = OpCounter()
    with device.use("cuda", FakeCuda()), FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, kw, leaves = _inputs(case)  # made before counting: the caller's tensors
        dout = torch.ones(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)  # the caller's gradient
        with counter:
            out = ring_attention(q, k, v, ring=LoopbackRing(case.P, rank, q.device), **kw)
            fake_backward(out, dout, leaves)
    return counter


def _case(name: str, P: int) -> Case:
    base = dict(kernel="auto", P=P, heads=(4, 4))  # MHA; "gqa": 8 query heads on 2 K/V heads
    return {"causal": Case(**base), "full": Case(**base, causal=False), "gqa": Case(**{**base, "heads": (8, 2)}),
            "thd": Case(**base, fmt="thd")}[name]


NAMES = ("causal", "full", "gqa", "thd")
PS = (2, 4, 8)
#: (attention ops, other ops) per case at the time of writing: ``other`` may only go down
CEILING = {
    ("causal", 2): (4, 22), ("causal", 4): (8, 35), ("causal", 8): (16, 59),
    ("full", 2): (4, 22), ("full", 4): (8, 34), ("full", 8): (16, 58),
    # GQA: the kernel takes the fewer K/V heads as they are (FakeCuda's takes_gqa: a torch whose cuDNN path takes
    # GQA); with K/V expanded per call (an older torch) it was 34 / 59 / 107: repeat_interleave and dK/dV sums
    ("gqa", 2): (4, 22), ("gqa", 4): (8, 35), ("gqa", 8): (16, 59),
    # packed documents: the tasks cut by a document boundary run on the variable-length flash kernel
    # (kernels/varlen.py; on the math kernel before it: 132 / 204 / 228 other ops), whose lse fix-ups
    # (+inf <-> -inf: one nan_to_num each; eq + masked_fill before, 34 / 57 / 81) count as "other", and so do the
    # first call's copies of the plan's cumulative lengths to the device (4 / 6 / 6; none on later calls)
    ("thd", 2): (4, 30), ("thd", 4): (10, 51), ("thd", 8): (18, 75),
}


def _table(results: dict) -> str:
    rows = ["| case | P | attention ops | other ops | other per attention op |", "|---|---|---|---|---|"]
    for (name, P), c in results.items():
        rows.append(f"| {name} | {P} | {c.attention} | {sum(c.other.values())} | "
                    f"{sum(c.other.values()) / max(c.attention, 1):.2f} |")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def counts():
    got = {(name, P): count(_case(name, P)) for name in NAMES for P in PS}
    print("\n" + _table(got))
    for key, c in got.items():
        print(key, dict(c.other.most_common()))
    return got


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("P", PS)
def test_other_ops_within_ceiling(counts, name, P):
    c = counts[(name, P)]
    attention, other = CEILING[(name, P)]
    assert c.attention == attention, (c.attention, attention)
    assert sum(c.other.values()) <= other, (sum(c.other.values()), other, dict(c.other.most_common()))


@pytest.mark.xfail(strict=False, reason="issue 34: the loopback's exchange copies, the K/V slot writes, the "
                                        "results' layout copies and the in-band status still count")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("P", PS)
def test_target_three_ops_per_kernel(counts, name, P):
    c = counts[(name, P)]
    assert sum(c.other.values()) <= 3 * c.attention, (sum(c.other.values()), c.attention)


def test_the_counter_counts_launches_not_views():
    """Negative control: an element-wise op counts, views and allocations do not, host ops do not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with device.use("cuda", FakeCuda()), FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
        with OpCounter() as c:
            x.t().permute(1, 0).view(32).narrow(0, 0, 4)
            torch.empty_like(x)
            torch.ones(3).add_(1)  # host
        assert (c.attention, sum(c.other.values())) == (0, 0)
        with OpCounter() as c:
            x.add_(1)
            x.exp()
        assert sum(c.other.values()) == 2
