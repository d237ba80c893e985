"""The project's two Triton kernels (core/merge_triton.py, core/_foreach_kernels.py), checked without a GPU, in
the tier that has Triton (.venv312):

* semantics: each kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors) against its torch
  reference (the checks of tests/test_merge_fused.py and tests/test_foreach_fused.py, with their bounds);
* compilation: each is compiled the whole way to a cubin for sm_80 (A100) and sm_90 (H100/H200) with Triton's own
  ptxas, in the variants the engine launches (the merge fresh and not, with the status rider and the +inf lse;
  the list op with 4 pairs of mixed dtypes), so an error the interpreter does not see (a type that differs between
  two branches, an op the compiler does not take) fails here, not on the first GPU run. A negative control shows
  that a kernel the compiler refuses fails this check.
"""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from tests.helpers.triton_interp import run_interpreted  # noqa: E402

TARGETS = [(80, "sm_80"), (90, "sm_90")]


def test_merge_kernel_in_the_interpreter(monkeypatch):
    from megatron_ring.core.merge_triton import _kernel
    from tests.test_merge_fused import check_triton_against_reference

    run_interpreted(monkeypatch, _kernel, check_triton_against_reference)


def test_list_kernel_in_the_interpreter(monkeypatch):
    from megatron_ring.core.foreach_triton import _kernel
    from tests.test_foreach_fused import check_triton_against_torch

    run_interpreted(monkeypatch, _kernel, check_triton_against_torch)


def _compile(fn, signature: dict, constexprs: dict, arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in constexprs:
        signature[name] = "constexpr"
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32))


def _merge_signature(fn) -> dict:
    bf16 = ("blk_ptr", "st_dst", "st_src")
    return {n: ("*bf16" if n in bf16 else "*fp32") if n.endswith("_ptr") or n.startswith("st_") else "i32"
            for n in fn.arg_names if n not in ("FRESH", "STATUS", "POSINF", "BLOCK_D")}


def _list_signature(fn) -> dict:
    # the backward's adds (fp32 accumulator + bf16 block), a K/V write (bf16 -> bf16), a conversion (fp32 -> bf16),
    # a zeroing (src: the dst itself)
    kinds = {"0": ("*fp32", "*bf16"), "1": ("*bf16", "*bf16"), "2": ("*bf16", "*fp32"), "3": ("*bf16", "*bf16")}
    sig = {}
    for n in fn.arg_names:
        if n in ("N", "BLOCK_R", "BLOCK_C"):
            continue
        if n.startswith(("dst", "src")):
            sig[n] = kinds[n[-1]][0 if n.startswith("dst") else 1]
        else:
            sig[n] = "i64"
    return sig


@pytest.mark.parametrize("arch,name", TARGETS, ids=[t[1] for t in TARGETS])
def test_the_kernels_compile_to_a_cubin(arch, name, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    from megatron_ring.core import foreach_triton, merge_triton

    # made afresh: an interpreter test before this one left interpreted kernels in the caches
    merge_triton._kernel.cache_clear()
    foreach_triton._kernel.cache_clear()
    merge = merge_triton._kernel()
    for fresh in (False, True):
        got = _compile(merge, _merge_signature(merge), {"FRESH": fresh, "STATUS": True, "POSINF": True,
                                                        "BLOCK_D": 128}, arch)
        assert got.asm["cubin"] and name in got.asm["ptx"]
    fn = foreach_triton._kernel()
    got = _compile(fn, _list_signature(fn), {"N": 4, "BLOCK_R": 32, "BLOCK_C": 128}, arch)
    assert got.asm["cubin"] and name in got.asm["ptx"]


def test_a_kernel_the_compiler_refuses_fails_the_check(tmp_path, monkeypatch):
    """Negative control: a value of two types in two branches (the interpreter runs it, the compiler refuses)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from tests.fake_cuda import _bad_kernel

    with pytest.raises(Exception, match="(?i)type|mismatch|yield"):
        _compile(_bad_kernel.bad, {"out": "*fp32", "flag": "i32"}, {"BLOCK": 16}, 90)
