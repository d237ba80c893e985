"""torch.compile of a model that calls ``ring_attention`` (docs/compile.md).

``ring_attention`` is ONE graph break: torch.compile never traces the ring (its exchanges wait on the
host, its in-band status is read on the host); the layers before and after it compile with inductor and
the ring runs eagerly between them, forward and backward. The counting test (fast) pins the break count
and its reason; the inductor test (slow: inductor's C++ compile takes about a minute on this CPU) checks
that the compiled model equals the eager one, output and gradients."""
import math
import os

import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.transport.ring import LoopbackRing

D_MODEL, HEADS, HEAD_DIM, SEQ = 32, 4, 8, 16


class _Attn(torch.nn.Module):
    """QKV projection, ring attention, output projection: the shape of a transformer's attention block."""

    def __init__(self, ring) -> None:
        super().__init__()
        self.ring = ring
        self.qkv = torch.nn.Linear(D_MODEL, 3 * HEADS * HEAD_DIM)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).unbind(2)
        out = ring_attention(q, k, v, causal=True, ring=self.ring)
        return torch.nn.functional.gelu(self.proj(out.reshape(b, t, HEADS * HEAD_DIM)))


@pytest.fixture(autouse=True)
def _inductor_cache_per_capability(monkeypatch):
    """One inductor cache per forced ``ATEN_CPU_CAPABILITY`` (scripts/numerics_matrix.sh): torch 2.13's inductor
    caches do not key on the vector ISA that variable selects, so a graph cached under another capability comes
    back with that ISA's C++ (``at::vec::Vectorized<float>`` of 16 lanes under ``default``: "'at::vec' has not
    been declared"; with the caches off, or this, it compiles)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    if cap:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), f"aten-cpu-capability-{cap}"))


def _ring(world: int):
    return None if world == 1 else LoopbackRing(world, world - 1, torch.device("cpu"))


@pytest.mark.parametrize("world", [1, 4])
def test_ring_attention_is_one_graph_break(world):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Attn(_ring(world))
    ex = torch._dynamo.explain(model)(torch.randn(2, SEQ, D_MODEL))
    assert ex.graph_break_count == 1 and ex.graph_count == 2, [b.reason for b in ex.break_reasons]
    assert "torch.compiler.disable" in ex.break_reasons[0].reason
    assert "ring_attention" in ex.break_reasons[0].reason


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_inductor_matches_eager(world):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Attn(_ring(world))
    x = torch.randn(2, SEQ, D_MODEL)
    compiled = torch.compile(model, backend="inductor")
    runs = []
    for fn in (model, compiled, compiled):  # the second compiled call reuses the graphs
        model.zero_grad()
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(torch.ones_like(y))
        runs.append((y.detach(), xi.grad, *(p.grad.clone() for p in model.parameters())))
    # Tolerance: inductor may re-associate fp32 sums (matmul, bias, GELU fusion); each of the 3 stages
    # between input and output (QKV matmul, attention over <= SEQ keys, output matmul) adds a relative
    # error of at most ~sqrt(reduction length) * eps per element; gradients pass the same stages again.
    eps = torch.finfo(torch.float32).eps
    rel = 2 * 3 * math.sqrt(max(D_MODEL, HEADS * HEAD_DIM, SEQ)) * eps
    for got_run in runs[1:]:
        for want, got in zip(runs[0], got_run):
            torch.testing.assert_close(got, want, rtol=rel, atol=rel * float(want.abs().max()))
