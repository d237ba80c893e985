"""megatron_ring/triton_launch.py: a launch reuses a compiled kernel only where Triton's JIT would specialise it the
same way, in the tiers that have Triton (no GPU needed).

* soundness: the real launchers (the merge, the list op, the FP8 scales, the four attention dropout kernels) are run
  over shapes, dtypes, strides, address alignments and dropout seeds, each launch recorded; for every two launches
  of one kernel whose keys are equal, Triton's own binder (``create_function_from_signature`` for an sm_90 target,
  as a GPU launch binds) gives the same specialisation. Negative controls: a key without the addresses' alignment,
  and one without the width of the ints Triton does not specialise (the dropout seed), map launches that Triton
  specialises apart to one key.
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
    """Every launch of the launchers over the variants, per kernel: {name: (jitted kernel, [(args, kwargs)])}."""
    from megatron_ring.core import foreach_triton as F
    from megatron_ring.core import merge_triton as M
    from megatron_ring.kernels import dropout_triton as D
    from megatron_ring.wire import fp8_triton as W

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = {}
    D._kernels.cache_clear()
    dropout = D._kernels()
    D._kernels.cache_clear()
    for fn in dropout:
        got[fn.__name__] = (fn, [])
    recorders = tuple(_Recording(fn, got[fn.__name__][1]) for fn in dropout)
    monkeypatch.setattr(D, "_kernels", lambda: recorders)
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
    _dropout_launches(D)
    return got


def _dropout_launches(D) -> None:
    """The dropout kernels' launches (forward and backward, causal and masked) over seeds whose 32-bit folds fall
    below and above 2**31 (Triton's i32 and i64) and both address alignments."""
    from megatron_ring.kernels.dropout import DropoutSpec, FusedDropoutKernel
    from megatron_ring.schedules.masks import AttentionMask, BlockMask

    pos = torch.arange(64)
    rule = AttentionMask(True, (0, 20, 64), (16, 0))
    mask = BlockMask(rule, pos, rule.doc_ids(pos), pos, rule.doc_ids(pos))
    for seed, make in itertools.product((1, 2, 7, 2 ** 31 + 5, 2 ** 32 - 3, 3 * 2 ** 32 + 1),
                                        (lambda s, d: torch.zeros(s, dtype=d), _misaligned)):
        q = make((1, 2, 64, 64), torch.bfloat16)
        lse = torch.zeros(1, 2, 64)
        kern = FusedDropoutKernel(DropoutSpec(p=0.1, seed=seed, heads=2, seq_len=64))
        for causal, m in ((True, None), (False, mask)):
            args = kern._args(q, causal, 0.125, m, pos, pos)
            D.dropout_attention_forward(q, q, q, *args)
            D.dropout_attention_backward(q, q, q, q, q, lse, *args)


def _specialisation(fn, args, kwargs):
    """Triton's own binding of a launch for an sm_90 target: the specialisation its JIT keys the kernel on."""
    from tests.helpers.triton_launch import bind_launch

    return repr(bind_launch(fn, args, kwargs, 90)[2][1])


def _collisions(got, key) -> list:
    """Pairs of launches of one kernel with equal ``key`` but different specialisations."""
    bad = []
    for name, (fn, launches) in got.items():
        seen: dict = {}
        loose = frozenset(i for i, p in enumerate(fn.params) if p.do_not_specialize)
        for args, kwargs in launches:
            k, spec = key(args, kwargs, loose), _specialisation(fn, args, kwargs)
            if seen.setdefault(k, spec) != spec:
                bad.append((name, seen[k], spec))
    return bad


def test_equal_keys_are_equal_specialisations(monkeypatch):
    got = _record(monkeypatch)
    assert sorted(got) == ["dropout_bwd_kv", "dropout_bwd_q", "dropout_delta", "dropout_fwd", "foreach", "fp8",
                           "merge"]
    assert all(len(launches) >= 24 for _, launches in got.values()), {n: len(v[1]) for n, v in got.items()}
    assert _collisions(got, TL.launch_key) == []
    # the launches are varied enough to tell keys apart: several keys per kernel
    keys = {name: len({TL.launch_key(a, k) for a, k in launches}) for name, (_, launches) in got.items()}
    assert min(keys.values()) >= 2 and sum(keys.values()) >= 40, keys
    # and the dropout seed, which Triton does not specialise, does not split keys beyond its width
    fwd, launches = got["dropout_fwd"]
    loose = frozenset(i for i, p in enumerate(fwd.params) if p.do_not_specialize)
    assert loose and len({TL.launch_key(a, k, loose) for a, k in launches}) < len({TL.launch_key(a, k)
                                                                                    for a, k in launches})


def test_a_key_without_the_alignment_would_reuse_a_kernel_specialised_otherwise(monkeypatch):
    """Negative control: drop the address alignment from the key and launches Triton specialises apart collide."""
    def no_alignment(args, kwargs, loose):
        return TL.launch_key(tuple(a.float() if isinstance(a, torch.Tensor) and a.data_ptr() & 15 else a
                                   for a in args), kwargs, loose)

    assert _collisions(_record(monkeypatch), no_alignment)


def test_a_key_without_the_unspecialised_ints_width_would_reuse_a_kernel_specialised_otherwise(monkeypatch):
    """Negative control: key the ints Triton does not specialise by nothing (not their width) and the dropout seeds
    below and above 2**31 collide."""
    def no_width(args, kwargs, loose):
        return TL.launch_key(tuple(0 if i in loose else a for i, a in enumerate(args)), kwargs)

    bad = _collisions(_record(monkeypatch), no_width)
    assert bad and {name for name, *_ in bad} <= {"dropout_fwd", "dropout_bwd_kv", "dropout_bwd_q"}


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
    other = _Jit(_Compiled(runs))  # an argument of a type the key does not derive (a tuple): Triton's path
    launch = TL.Launcher(lambda: other)
    for _ in range(2):
        launch((1,), t, (1, 2), X=1, Y=2)
    assert len(other.launches) == 2 and runs == []
