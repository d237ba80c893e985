"""megatron_ring/triton_launch.py: a launch reuses a compiled kernel only where Triton's JIT would specialise it the
same way, in the tiers that have Triton (no GPU needed).

* soundness: the real launchers (the merge, the list op, the FP8 scales) are run over shapes, dtypes, strides and
  address alignments, each launch recorded; for every two launches of one kernel whose keys are equal, Triton's
  own binder (``create_function_from_signature`` for an sm_90 target, as a GPU launch binds) gives the same
  specialisation. Negative control: a key without the addresses' alignment maps launches that Triton specialises
  apart to one key.
* the launcher: the first launch of a key goes through ``kernel[grid](...)``; later ones call the kept compiled
  kernel with every argument in the kernel's order; a new value of an int, a new kernel object (a cleared getter),
  Triton's interpreter (no compiled kernel returned) and a call leaving a parameter to its default go through
  Triton again.
"""
from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_ring import triton_launch as TL  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402


class _Recording:
    """Stands in for a jitted kernel: ``k[grid](*args, **kwargs)`` records the launch and launches nothing."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _misaligned(shape, dtype):
    """A tensor of ``shape`` whose address is not a multiple of 16 bytes."""
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


def _record(monkeypatch):
    """Every launch of the three launchers over the variants, per kernel: {name: (jitted kernel, [(args, kwargs)])}."""
    from megatron_ring.core import foreach_triton as F
    from megatron_ring.core import merge_triton as M
    from megatron_ring.wire import fp8_triton as W

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = {}
    for mod, name in ((M, "merge"), (F, "foreach"), (W, "fp8")):
        mod._kernel.cache_clear()
        fn = mod._kernel()
        mod._kernel.cache_clear()
        got[name] = (fn, [])
        monkeypatch.setattr(mod, "_kernel", lambda fn=fn, rec=got[name][1]: _Recording(fn, rec))
    makers = (lambda shape, dtype: torch.zeros(shape, dtype=dtype), _misaligned)
    for shape, make, dt in itertools.product(((1, 1, 1, 1), (1, 1, 1, 8), (2, 4, 16, 64), (1, 3, 5, 128)),
                                             makers, (torch.bfloat16, torch.float16, torch.float32)):
        acc, blk = make(shape, torch.float32), make(shape, dt)
        lse, blk_lse = torch.zeros(shape[:3]), make(shape[:3], torch.float32)
        M.merge_triton(acc, lse, blk, blk_lse, False)
        M.merge_triton(acc, lse, blk.transpose(1, 2).contiguous().transpose(1, 2), blk_lse, True, posinf_empty=True)
        F.foreach_triton([acc, make(shape, dt)], [blk, acc], [F.ADD, F.COPY])
        F.foreach_triton([acc, blk, acc, acc], [blk, None, acc, blk], [F.ADD, F.ZERO, F.COPY, F.FLIP])
        rows = make(shape[:3], dt).abs()
        g = -(-shape[2] // 4)
        W.fp8_scales(rows, torch.zeros(shape[0], shape[1], g), 4, 8)
    return got


def _specialisation(fn, args, kwargs):
    """Triton's own binding of a launch for an sm_90 target: the specialisation its JIT keys the kernel on."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    bind = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return repr(bind(*args, **kwargs)[1])


def _collisions(got, key) -> list:
    """Pairs of launches of one kernel with equal ``key`` but different specialisations."""
    bad = []
    for name, (fn, launches) in got.items():
        seen: dict = {}
        for args, kwargs in launches:
            k, spec = key(args, kwargs), _specialisation(fn, args, kwargs)
            if seen.setdefault(k, spec) != spec:
                bad.append((name, seen[k], spec))
    return bad


def test_equal_keys_are_equal_specialisations(monkeypatch):
    got = _record(monkeypatch)
    assert all(len(launches) >= 24 for _, launches in got.values())
    assert _collisions(got, TL.launch_key) == []
    # the launches are varied enough to tell keys apart: more than one key per kernel
    assert all(len({TL.launch_key(a, k) for a, k in launches}) > 4 for _, launches in got.values())


def test_a_key_without_the_alignment_would_reuse_a_kernel_specialised_otherwise(monkeypatch):
    """Negative control: drop the address alignment from the key and launches Triton specialises apart collide."""
    def no_alignment(args, kwargs):
        return tuple(a if isinstance(a, int) else a.dtype for a in args), tuple(kwargs.items())

    assert _collisions(_record(monkeypatch), no_alignment)


class _Compiled(CompiledKernel):
    """A compiled kernel that records its launches (``compiled[grid](*args)``); like Triton's own runner it reads
    three grid dims (a one-dim grid passed as it is failed on an H200: IndexError)."""

    def __init__(self, runs: list) -> None:  # noqa: super().__init__ needs a real compilation
        self.runs = runs

    def __getitem__(self, grid):
        return lambda *args: self.runs.append(((grid[0], grid[1], grid[2]), args))


class _Jit:
    """A jitted kernel ``k(a, b, X: constexpr, Y: constexpr)`` whose launch records itself and returns ``result``."""
    arg_names = ["a", "b", "X", "Y"]

    def __init__(self, result) -> None:
        self.result, self.launches = result, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.result
        return launch


def test_the_launcher_calls_the_kept_kernel_for_the_same_key_only():
    runs: list = []
    jit = _Jit(_Compiled(runs))
    launch = TL.Launcher(lambda: jit)
    t = torch.zeros(8)
    launch((4,), t, 16, X=1, Y=2)
    assert len(jit.launches) == 1 and runs == []
    launch((7,), torch.ones(8), 16, X=1, Y=2)  # same key: the kept kernel, every argument in the kernel's order
    assert len(jit.launches) == 1 and len(runs) == 1
    grid, args = runs[0]
    assert grid == (7, 1, 1) and args[1:] == (16, 1, 2) and torch.equal(args[0], torch.ones(8))
    launch((7,), t, 17, X=1, Y=2)  # another int value: Triton's path
    launch((7,), t.half(), 16, X=1, Y=2)  # another dtype
    launch((7,), torch.zeros(9)[1:], 16, X=1, Y=2)  # another alignment
    launch((7,), t, 16, X=1, Y=3)  # another constexpr
    assert len(jit.launches) == 5 and len(runs) == 1
    launch((7,), torch.zeros(9)[1:], 16, X=1, Y=2)
    assert len(jit.launches) == 5 and len(runs) == 2


def test_the_launcher_keeps_nothing_it_cannot_call_again():
    runs: list = []
    jits = [_Jit(_Compiled(runs))]
    launch = TL.Launcher(lambda: jits[-1])
    t = torch.zeros(8)
    launch((1,), t, 3, X=1, Y=2)
    jits.append(_Jit(_Compiled(runs)))  # a getter whose cache was cleared: a new jitted kernel
    launch((1,), t, 3, X=1, Y=2)
    assert len(jits[1].launches) == 1 and runs == []
    fresh = TL.Launcher(lambda: _Jit(_Compiled(runs)))  # a new kernel object at every launch, freed after it
    for _ in range(4):  # (its address, and so its id, is often reused by the next: never taken for the same)
        fresh((1,), t, 3, X=1, Y=2)
    assert runs == []
    interp = _Jit(None)  # Triton's interpreter returns no compiled kernel
    launch = TL.Launcher(lambda: interp)
    for _ in range(2):
        launch((1,), t, 3, X=1, Y=2)
    assert len(interp.launches) == 2
    default = _Jit(_Compiled(runs))  # Y left to its default: not every argument would be passed again
    launch = TL.Launcher(lambda: default)
    for _ in range(2):
        launch((1,), t, 3, X=1)
    assert len(default.launches) == 2 and runs == []
    other = _Jit(_Compiled(runs))  # an argument of a type the key does not derive: Triton's path
    launch = TL.Launcher(lambda: other)
    for _ in range(2):
        launch((1,), t, 0.5, X=1, Y=2)
    assert len(other.launches) == 2 and runs == []
