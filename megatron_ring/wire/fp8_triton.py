"""The FP8 wire's scales on CUDA as ONE Triton kernel (Triton is imported at the first launch, so this module
imports without it): :class:`~.codecs.FP8Codec` computes each group's power-of-two scale from the tokens' max |x|
with about a dozen small torch ops per tensor (a float64 ``frexp``/``ldexp`` chain, the NaN rule, the reciprocal
and its repetition per token, the verdict); here one program per group does all of it
(:func:`fp8_scales`, registered as the op ``megatron_ring::fp8_scales`` with a fake implementation).

The scales are bit for bit the codec's (:meth:`~.codecs.FP8Codec._scales` on the device path: NaN for a group
with inf/NaN): ``tests/fake_cuda/test_triton_kernels.py`` checks it in Triton's interpreter, and compiles the kernel
for sm_80/sm_90.
"""
from __future__ import annotations

import functools

import torch

from megatron_ring.triton_launch import Launcher

__all__ = ["fp8_scales", "fp8_scales_reference", "pow2_scales", "EXP_LIMIT"]

_BLOCK = 64
#: scale exponents are clamped to [-EXP_LIMIT, EXP_LIMIT]: 2^±120 and its reciprocal stay normal fp32 (the kernel's
#: clamp is the same number)
EXP_LIMIT = 120


def pow2_scales(amax: torch.Tensor, emax: int, nan_where_not_finite: bool) -> torch.Tensor:
    """THE scale rule of the FP8 wire, in torch: ``2^ceil(log2(amax / fp8_max))`` with ``fp8_max = 1.75 * 2**emax``,
    clamped to ``2^[-EXP_LIMIT, EXP_LIMIT]``, 1 where ``amax == 0``, computed in float64 so that fp32-subnormal
    maxima do not underflow; NaN where ``amax`` is not finite if asked. The codec's CPU path and the kernel's
    reference (the kernel computes the same in integer arithmetic)."""
    mant, exp = torch.frexp(amax.double() / (1.75 * 2.0 ** emax))  # amax/fp8_max = mant * 2^exp, mant in [0.5, 1)
    exp = (exp - (mant == 0.5).int()).clamp_(-EXP_LIMIT, EXP_LIMIT)  # exact powers of two: no bump
    scale = torch.ldexp(torch.ones_like(amax), exp)
    if nan_where_not_finite:
        scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    return scale


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel: its module is imported (again, after a cache clear) here, so Triton is imported at the
    first launch and ``TRITON_INTERPRET`` is read then."""
    import importlib

    from megatron_ring.wire import _fp8_kernels

    return importlib.reload(_fp8_kernels).fp8_scales_kernel


_launch = Launcher(lambda: _kernel())  # looked up at each launch (tests replace it)


def _groups(n: int, group: int) -> int:
    return max(1, -(-n // group))


def fp8_scales(rows: torch.Tensor, scale: torch.Tensor, group: int, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows``: each token's max |x| ``[b, h, n]`` (NaN where the token has one). Writes each group's scale (``group``
    tokens; ``fp8_max = 1.75 * 2**emax``) into ``scale`` ``[b, h, g]`` and returns ``(inv [b, h, n] fp32: the
    reciprocal of each token's scale, bad [b * h * g] int8: the groups with inf/NaN)``. The implementation of the
    op ``megatron_ring::fp8_scales`` on CUDA."""
    b, h, n = rows.shape
    g = scale.shape[-1]
    inv = torch.empty(b, h, n, dtype=torch.float32, device=rows.device)
    bad = torch.empty(b * h * g, dtype=torch.int8, device=rows.device)
    if b * h * n:
        mode = {torch.float32: 0, torch.bfloat16: 1}.get(rows.dtype, 2)
        if mode == 2 and rows.dtype != torch.float16:
            rows, mode = rows.float(), 0
        src = rows.view(torch.int32) if mode == 0 else rows.view(torch.int16) if mode == 1 else rows  # bits: views
        _launch((b * h, g), src, scale, inv, bad, *rows.stride(), *scale.stride(), h, n, g, group, emax, MODE=mode,
                BLOCK=_BLOCK)
    else:
        scale.fill_(1.0)
        bad.zero_()
    return inv, bad


def fp8_scales_reference(rows: torch.Tensor, scale: torch.Tensor, group: int,
                         emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_scales` in torch (the op's CPU implementation; the kernel's reference): the codec's own rule."""
    b, h, n = rows.shape
    g = scale.shape[-1]
    r = rows.float()
    if g * group != n:
        r = torch.nn.functional.pad(r, (0, g * group - n))
    amax = r.view(b, h, g, group).amax(dim=-1)
    got = pow2_scales(amax, emax, nan_where_not_finite=True)
    scale.copy_(got)
    inv = got.reciprocal().repeat_interleave(group, dim=-1)[..., :n]
    return inv.contiguous(), (~torch.isfinite(amax)).to(torch.int8).reshape(-1)


@torch.library.custom_op("megatron_ring::fp8_scales", mutates_args=("scale",))
def _op(rows: torch.Tensor, scale: torch.Tensor, group: int, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_scales_reference(rows, scale, group, emax)


@_op.register_kernel("cuda")
def _op_cuda(rows, scale, group, emax):
    return fp8_scales(rows, scale, group, emax)


@_op.register_fake
def _op_fake(rows, scale, group, emax):
    b, h, n = rows.shape
    return (rows.new_empty((b, h, n), dtype=torch.float32),
            rows.new_empty((b * h * scale.shape[-1],), dtype=torch.int8))
