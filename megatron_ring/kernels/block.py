"""Local block attention kernels that also return the log-sum-exp, with matching backward.

All tensors are BHSD: ``q [b, h, sq, d]``, ``k, v [b, h_kv, sk, d]`` with ``h % h_kv == 0`` (GQA is
handled inside the kernel; K/V are never repeated on the wire). ``forward`` returns
``(out [b, h, sq, d] in q.dtype, lse [b, h, sq] float32, natural log)``; ``backward`` returns
``(dq, dk, dv)`` shaped like ``q, k, v``. ``causal`` is the top-left mask (key j visible to query i iff
j <= i), ALSO when ``sq != sk``: a kernel whose library aligns a rectangular causal mask bottom-right
(flash_attn; and the CUDA ops, to be safe) runs it as a square causal block plus a full block
(:func:`causal_sub_blocks`), so the alignment convention never reaches the library. Callers never pass a
block with a fully masked query row (see ``layouts``).

``unsupported(q, head_dim)`` says why a kernel cannot run a case (device, dtype, head dim, GPU
architecture; None: it can) and ``supports`` is its negation; ``auto`` takes the first kernel of
``_AUTO_ORDER`` (fastest first) that supports the case and so falls back instead of crashing, and a kernel
named explicitly that cannot run the case is refused with that reason, before any kernel runs. Determinism
is a property of the kernel object a call's plan holds (``BlockKernel.deterministic``; set by
:func:`select_kernel` from the call's ``deterministic``): a deterministic kernel refuses cases it has no
deterministic backward for and asks its library for a deterministic one. A call that does not say follows
the process default, :func:`deterministic` (torch's deterministic mode,
``torch.are_deterministic_algorithms_enabled()``, which Megatron-LM's ``--deterministic-mode`` turns on;
:func:`set_deterministic` overrides it for the process).

Masks (documents, windows; see :mod:`~megatron_ring.schedules.masks`): a kernel with ``supports_mask = True``
also accepts the keyword ``mask=`` (a :class:`~megatron_ring.schedules.masks.BlockMask`, ``causal`` is then
False). With a mask, query rows that see no key of the block return out 0 and lse -inf, and ``backward``
accepts lse = -inf for rows that see no key at all (their gradients are 0). The engine sends the masked tasks
of a kernel without ``supports_mask`` to the variable-length flash kernel for a fused CUDA kernel
(:mod:`~megatron_ring.kernels.varlen`), else to :class:`MathKernel`, so a new kernel works unchanged.

Kernels are picked once per device by :func:`select_kernel` and can be forced by name.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_ring.device import ops_for
from megatron_ring.kernels.base import BlockKernel, _finite_lse, deterministic, set_deterministic
from megatron_ring.kernels.math_kernel import MathKernel

__all__ = ["BlockKernel", "operand_head_dim", "MathKernel", "FlashCPUKernel", "CudaSDPAKernel",
           "TorchFlashCudaKernel", "CudnnKernel", "TEFusedKernel", "select_kernel", "KERNELS", "causal_sub_blocks",
           "set_deterministic", "ReversedKernel"]


_process_default = deterministic  # for select_kernel, whose argument has the same name


def causal_sub_blocks(sq: int, sk: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """The top-left causal block ``[sq, sk]`` as (query rows, key cols, causal) sub-blocks that are square
    causal or full: alignment-free for every library. Non-causal or square: the block itself."""
    if not causal or sq == sk:
        return [(slice(0, sq), slice(0, sk), causal)]
    if sq < sk:  # keys j >= sq are hidden from every query
        return [(slice(0, sq), slice(0, sq), True)]
    return [(slice(0, sk), slice(0, sk), True), (slice(sk, sq), slice(0, sk), False)]


def operand_head_dim(kernel: BlockKernel, head_dim: int) -> int:
    """The head dim ``kernel``'s operands have for a call of ``head_dim`` (the larger of Q/K's and V's): rounded up
    to the kernel's :attr:`~BlockKernel.head_dim_multiple` (the fused CUDA kernels take multiples of 8)."""
    m = kernel.head_dim_multiple
    return -(-head_dim // m) * m


def _cuda_arch(q: torch.Tensor) -> tuple[int, int]:
    """The GPU architecture of ``q``'s device, through the device seam ((0, 0): not a GPU)."""
    return ops_for(q.device).capability(q.device) or (0, 0)


def _cuda_only(q: torch.Tensor) -> str | None:
    return None if q.device.type == "cuda" else f"it runs on CUDA devices only, not {q.device.type}"


def _fused_cuda_case(q: torch.Tensor, d: int, max_head_dim: int) -> str | None:
    """What the fused CUDA attention kernels share: sm80+, fp16/bf16, head dim ``d`` a multiple of 8 (their
    :attr:`~BlockKernel.head_dim_multiple`: a call's operands are padded to one) and at most ``max_head_dim``.
    Returns why not (None: the case fits)."""
    if why := _cuda_only(q):
        return why
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 or bf16, not {q.dtype}"
    if d % 8 or d > max_head_dim:
        return f"it takes a head dim that is a multiple of 8 and at most {max_head_dim}, not {d}"
    arch = _cuda_arch(q)
    if arch < (8, 0):
        return f"it needs an sm80 or newer GPU, this one is sm{arch[0]}{arch[1]}"
    return None


def _flash_backward_gap(q: torch.Tensor, d: int) -> str | None:
    """torch's flash backward does not run head dims 193..224 on sm86, sm89 and sm120/121 (torch's dispatcher
    refuses it there: sdp_utils ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``; the
    kernel's own checks do not, so a direct call would fail or compute on a path not built for it)."""
    arch = _cuda_arch(q)
    if 192 < d <= 224 and ((8, 6) <= arch <= (8, 9) or (12, 0) <= arch <= (12, 1)):
        return (f"torch's flash backward does not run head dim {d} on sm{arch[0]}{arch[1]} (193 to 224 on sm86, "
                "sm89, sm120)")
    return None


def _turned_off_in_torch(backend: str) -> str | None:
    """torch's SDPA switches (``torch.backends.cuda.enable_flash_sdp`` / ``enable_cudnn_sdp``, or the
    ``torch.nn.attention.sdpa_kernel`` context): a backend the user turned off there (e.g. to avoid a bug of it)
    is not run here either."""
    on = {"flash": torch.backends.cuda.flash_sdp_enabled, "cudnn": torch.backends.cuda.cudnn_sdp_enabled}[backend]
    if on():
        return None
    return (f"torch's {backend} attention is turned off (torch.backends.cuda.enable_{backend}_sdp(False) or "
            "torch.nn.attention.sdpa_kernel)")


def _torch_switches() -> tuple[bool, bool, bool]:
    """What :func:`_turned_off_in_torch` and :func:`_deterministic_refusal` read of torch's state (part of
    ``auto``'s cached choice)."""
    return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
            _torch_deterministic())


def _torch_deterministic() -> bool:
    """torch's deterministic mode, strict (``torch.use_deterministic_algorithms(True)``, not ``warn_only``): where
    torch's flash backward runs its deterministic algorithm (``_flash_attention_backward`` reads it)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _deterministic_refusal(kernel: BlockKernel, torch_flash: bool = False) -> str | None:
    """Why ``kernel`` cannot run a deterministic call. ``torch_flash``: the kernel's backward is torch's flash
    backward, deterministic under torch's strict deterministic mode (Megatron's ``--deterministic-mode`` sets it)."""
    if not kernel.is_deterministic() or (torch_flash and _torch_deterministic()):
        return None
    if torch_flash:
        return ("its backward is deterministic only under torch.use_deterministic_algorithms(True) (not warn_only), "
                "and deterministic mode is on without it")
    return "it has no deterministic backward and deterministic mode is on"


class _SquareCausal(BlockKernel):
    """Runs rectangular causal blocks as square-causal + full sub-blocks (see :func:`causal_sub_blocks`)."""

    def forward(self, q, k, v, causal, scale):
        blocks = causal_sub_blocks(q.shape[2], k.shape[2], causal)
        if len(blocks) == 1:
            rows, cols, c = blocks[0]
            if rows.stop == q.shape[2]:
                return self._fwd(q, k[:, :, cols], v[:, :, cols], c, scale)
        outs, lses = zip(*(self._fwd(q[:, :, r], k[:, :, c_], v[:, :, c_], c, scale) for r, c_, c in blocks))
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        blocks = causal_sub_blocks(q.shape[2], k.shape[2], causal)
        if len(blocks) == 1 and blocks[0][1].stop == k.shape[2]:
            return self._bwd(dout, q, k, v, out, lse, causal, scale)
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for r, c_, c in blocks:
            a, b_, d = self._bwd(dout[:, :, r], q[:, :, r], k[:, :, c_], v[:, :, c_], out[:, :, r],
                                 lse[:, :, r].contiguous(), c, scale)
            dq[:, :, r] = a
            dk[:, :, c_] += b_
            dv[:, :, c_] += d
        return dq, dk, dv

    def _fwd(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError


class FlashCPUKernel(BlockKernel):
    """torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) and its backward."""

    name = "flash_cpu"
    supports_mask = True  # as a float additive mask in q's dtype

    def unsupported(self, q, head_dim):
        if q.device.type != "cpu":
            return f"it runs on CPU only, not {q.device.type}"
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            return f"it does not take {q.dtype}"
        return None

    def forward(self, q, k, v, causal, scale, mask=None):
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        allowed = mask.allowed(q.device)
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=additive, scale=scale)
        empty = ~allowed.any(-1)  # this kernel returns lse 0 (not -inf) for rows that see no key
        return out.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, float("-inf"))

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        additive = mask.additive(q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, _finite_lse(lse).contiguous(), 0.0, False, attn_mask=additive, scale=scale)


class ReversedKernel(BlockKernel):
    """``inner`` on query and key rows taken in reverse order, results put back in order.

    A square block whose visible pairs are key row >= query row (a sliding window's lower edge) is a
    top-left causal block once both orders are reversed: it then runs unmasked on any kernel (at the
    cost of copying the block's rows), instead of as an explicitly masked call. Keywords go to ``inner``
    (``dims``: kernels/head_dim.py)."""

    def __init__(self, inner: BlockKernel) -> None:
        self.inner, self.name = inner, f"reversed({inner.name})"

    def forward(self, q, k, v, causal, scale, **kw):
        out, lse = self.inner.forward(q.flip(2), k.flip(2), v.flip(2), causal, scale, **kw)
        return out.flip(2), lse.flip(-1)

    def backward(self, dout, q, k, v, out, lse, causal, scale, **kw):
        grads = self.inner.backward(dout.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(-1),
                                    causal, scale, **kw)
        return tuple(g.flip(2) for g in grads)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _kv_groups(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """By how many times a fused kernel of torch's ``backend`` needs K/V expanded here: 1 where torch's own SDPA
    (``enable_gqa=True``) hands it these fewer K/V heads as they are (the device seam asks torch's dispatch
    rule), so it is called as torch calls it: no ``repeat_interleave`` before it, no dK/dV sums after it;
    else the number of query heads per K/V head. Forward and backward of a block ask with the same tensors."""
    g = q.shape[1] // k.shape[1]
    return 1 if g == 1 or ops_for(q.device).takes_gqa(backend, q, k, v, causal) else g


def _sum_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


class CudaSDPAKernel(_SquareCausal):
    """torch's memory-efficient CUDA SDPA op (returns the lse). GQA K/V are expanded locally only.

    NOT VERIFIED ON A GPU: :func:`select_kernel` refuses it by name and ``auto`` never picks it (see
    ``UNVERIFIED``). Its backward is called as torch's autograd calls it (``tests/fake_cuda/test_conformance.py``):
    ``out`` and ``dout`` in the layout the forward produces (BSHD memory: the op's backward reads ``out``
    with a row stride of ``heads * head_dim`` whatever strides it is given), the lse padded to a multiple of
    32 query rows, the forward's philox outputs (unused: no dropout).
    """

    name = "sdpa_cuda"
    head_dim_multiple = 8

    def unsupported(self, q, d):
        if why := _cuda_only(q):
            return why
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"it takes fp16, bf16 or fp32, not {q.dtype}"
        if d % 8 or d > 512:
            return f"it takes a head dim that is a multiple of 8 and at most 512, not {d}"
        return None

    def _fwd(self, q, k, v, causal, scale):
        g = q.shape[1] // k.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]].float()

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[1] // k.shape[1]
        sq = q.shape[2]
        lse_padded = lse.new_zeros(*lse.shape[:-1], -(-sq // 32) * 32)  # the kernel's row granularity
        lse_padded[..., :sq] = lse
        seed, offset = _unused_rng(q, torch.int64, ())
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bshd_memory(dout), q, _repeat_kv(k, g), _repeat_kv(v, g), None, _bshd_memory(out), lse_padded,
            seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)


def _bshd_memory(x: torch.Tensor) -> torch.Tensor:
    """``x`` (BHSD) with BSHD memory, as the memory-efficient forward lays out its output (no copy if so)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _unused_rng(q: torch.Tensor, dtype: torch.dtype, seed_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The philox seed and offset a fused forward returns without dropout (dtype, shapes and device as the
    forward makes them); its backward reads them only with dropout, so they are left uninitialised."""
    return (torch.empty(seed_shape, dtype=dtype, device=q.device), torch.empty((), dtype=dtype, device=q.device))


class FlashAttnKernel(_SquareCausal):
    """The ``flash_attn`` package (imported lazily; CUDA only). Uses its BSHD layout internally.

    flash_attn aligns a rectangular causal mask bottom-right; the square-causal split keeps the
    top-left contract. Needs sm80+, fp16/bf16, head dim <= 256 and a multiple of 8."""

    name = "flash_attn"
    head_dim_multiple = 8

    def __init__(self) -> None:
        self._mod = None

    def _impl(self):
        if self._mod is None:
            import flash_attn.flash_attn_interface as fa  # noqa: PLC0415 - optional, GPU only
            self._mod = fa
        return self._mod

    def unsupported(self, q, head_dim):
        why = _fused_cuda_case(q, head_dim, 256)
        if why:
            return why
        try:
            self._impl()
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            return "the flash_attn package is not installed (or does not import)"
        return None

    def _fwd(self, q, k, v, causal, scale):
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        res = self._impl()._flash_attn_forward(t(q), t(k), t(v), 0.0, scale, causal=causal,
                                               window_size_left=-1, window_size_right=-1,
                                               softcap=0.0, alibi_slopes=None, return_softmax=False)
        return res[0].transpose(1, 2), res[1].float()

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        bshd = lambda x: x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3])  # noqa: E731 - no copy
        dq, dk, dv = bshd(q), bshd(k), bshd(v)
        # rng_state: flash_attn's own autograd passes its forward's; without dropout it is unread (None)
        self._impl()._flash_attn_backward(t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), dq, dk, dv,
                                          0.0, scale, causal, -1, -1, 0.0, None, self.is_deterministic(), rng_state=None)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class TorchFlashCudaKernel(_SquareCausal):
    """torch's own CUDA flash kernel (``aten._scaled_dot_product_flash_attention``): sm80+, fp16/bf16,
    head dim <= 256 and a multiple of 8. GQA K/V are passed as they are where torch's SDPA would pass them
    (:func:`_kv_groups`), else expanded locally only."""

    name = "flash_cuda"
    head_dim_multiple = 8

    def unsupported(self, q, head_dim):
        return (_fused_cuda_case(q, head_dim, 256) or _flash_backward_gap(q, head_dim)
                or _turned_off_in_torch("flash") or _deterministic_refusal(self, torch_flash=True))

    def _fwd(self, q, k, v, causal, scale):
        g = _kv_groups("flash", q, k, v, causal)
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, causal, False, scale=scale)
        return res[0], res[1].float()

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        g = _kv_groups("flash", q, k, v, causal)
        sq, sk = q.shape[2], k.shape[2]
        rng_state, unused = _unused_rng(q, torch.uint64, (2,))
        # cum_seq_q/k undefined (None), as the forward returns them for dense batches: defined ones (even
        # empty) select the variable-length path
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _repeat_kv(k, g), _repeat_kv(v, g), out, lse.contiguous(), None, None, sq, sk, 0.0, causal,
            rng_state, unused, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)


class CudnnKernel(_SquareCausal):
    """cuDNN attention (``aten._scaled_dot_product_cudnn_attention``): sm80+, fp16/bf16, head dim <= 128
    and a multiple of 8 (cuDNN's fused flash path). GQA K/V are passed as they are where torch's SDPA would
    pass them (:func:`_kv_groups`: torch releases whose cuDNN path takes GQA), else expanded locally only."""

    name = "cudnn"
    head_dim_multiple = 8

    def unsupported(self, q, head_dim):
        why = _fused_cuda_case(q, head_dim, 128) or _turned_off_in_torch("cudnn") or _deterministic_refusal(self)
        if why is None and not torch.backends.cudnn.is_available():
            return "cuDNN is not available to this torch"
        return why

    def unsupported_head_dims(self, q, k, v):
        # everything but the head dims as for one head dim (8 passes its head-dim check), then the head dims as
        # torch's own rule checks them
        why = self.unsupported(q, 8)
        if why is None and not ops_for(q.device).takes_head_dims("cudnn", q, k, v):
            why = (f"torch's own SDPA does not hand cuDNN head dims {q.shape[-1]} (Q, K) and {v.shape[-1]} (V) on "
                   "this GPU, cuDNN and torch release")
        return why

    def _instead(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockKernel | None:
        """The kernel that runs a (sub-)block cuDNN must not: one key (torch's ``check_cudnn_tensor_shapes``
        refuses key length 1, a cuDNN frontend error, pytorch#138529), or one query row on sm100 and newer
        (wrong numbers with few K/V heads on cuDNN 9.19/9.20, pytorch#193893). torch's flash kernel, which takes
        every case cuDNN's does here but V of another head dim, else the math kernel. Chosen by shape alone, so
        the forward and the backward of a block run on the same kernel."""
        if k.shape[2] != 1 and not (q.shape[2] == 1 and _cuda_arch(q) >= (10, 0)):
            return None
        flash = TorchFlashCudaKernel()
        flash.deterministic = self.deterministic
        same_dims = v.shape[-1] == q.shape[-1]
        return flash if same_dims and flash.unsupported(q, q.shape[-1]) is None else MathKernel()

    def _fwd(self, q, k, v, causal, scale):
        if (other := self._instead(q, k, v)) is not None:  # a square block: forward is its _fwd
            return other.forward(q, k, v, causal, scale)
        g = _kv_groups("cudnn", q, k, v, causal)
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, _repeat_kv(k, g), _repeat_kv(v, g), None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[:3]).float()

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        if (other := self._instead(q, k, v)) is not None:
            return other.backward(dout, q, k, v, out, lse, causal, scale)
        g = _kv_groups("cudnn", q, k, v, causal)
        sq, sk = q.shape[2], k.shape[2]
        seed, offset = _unused_rng(q, torch.int64, ())
        # attn_bias, cum_seq_q, cum_seq_k undefined (None), as torch's autograd passes them
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, _repeat_kv(k, g), _repeat_kv(v, g), out, lse.reshape(*lse.shape, 1).contiguous(),
            seed, offset, None, None, None, sq, sk, 0.0, causal, scale=scale)
        return dq, _sum_kv(dk, g), _sum_kv(dv, g)


class TEFusedKernel(_SquareCausal):
    """TransformerEngine's fused attention (imported lazily, only when TransformerEngine is installed).

    TransformerEngine's low-level API moves between releases, so this kernel verifies itself once per
    (device, dtype, head dim) against :class:`MathKernel` on a small block (forward and lse) and is
    reported unsupported -- ``auto`` falls back -- if the call fails or disagrees.

    Stateless between forward and backward (one object serves every layer and call): the backward rebuilds
    TransformerEngine's ``aux_ctx_tensors``, which for ``F16_arbitrary_seqlen`` without dropout or bias are
    ``[softmaxStats [b, h, sq, 1] fp32, rng_state [2] int64]``: the stats from the (global) lse it is given,
    the rng state as an unused placeholder on the device (read only with dropout, which this kernel never
    runs)."""

    name = "te_fused"
    head_dim_multiple = 8

    def __init__(self) -> None:
        self._fa = None
        self._te_dtype: dict | None = None  # torch dtype -> TransformerEngine's DType (its backward's dqkv_dtype)
        self._verified: dict[tuple, bool] = {}

    def _impl(self):
        if self._fa is None:
            from transformer_engine.pytorch.constants import TE_DType  # noqa: PLC0415
            from transformer_engine.pytorch.cpp_extensions import fused_attn as fa  # noqa: PLC0415
            self._fa, self._te_dtype = fa, TE_DType
        return self._fa

    def unsupported(self, q, head_dim):
        why = _fused_cuda_case(q, head_dim, 256)
        if why:
            return why
        key = (q.device, q.dtype, q.shape[-1])
        if key not in self._verified:
            self._verified[key] = self._self_check(q)
        return None if self._verified[key] else "TransformerEngine is not installed or failed its self-check"

    def _self_check(self, q) -> bool:
        try:
            self._impl()
            x = torch.randn(1, 2, 64, q.shape[-1], device=q.device, dtype=q.dtype)
            out, lse = self._fwd(x, x, x, True, 0.125)
            ref_out, ref_lse = MathKernel().forward(x, x, x, True, 0.125)
            return bool(torch.allclose(out.float(), ref_out.float(), atol=2e-2)
                        and torch.allclose(lse, ref_lse, atol=2e-2))
        except Exception:  # noqa: BLE001 - missing, or an API this code does not match: not available
            return False

    def _args(self, q, k, causal):
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        cu = lambda s: torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)  # noqa: E731
        return dict(max_seqlen_q=sq, max_seqlen_kv=sk, cu_seqlens_q=cu(sq), cu_seqlens_kv=cu(sk),
                    qkv_layout="bshd_bshd_bshd", attn_mask_type="causal" if causal else "no_mask")

    def _fwd(self, q, k, v, causal, scale):
        fa = self._impl()
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        kw = self._args(q, k, causal)
        out, aux = fa.fused_attn_fwd(True, kw.pop("max_seqlen_q"), kw.pop("max_seqlen_kv"),
                                     kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_kv"), t(q), t(k), t(v),
                                     q.dtype, fa.FusedAttnBackend["F16_arbitrary_seqlen"],
                                     attn_scale=scale, dropout=0.0, **kw)
        return out.transpose(1, 2), aux[0].reshape(q.shape[:3]).float()

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        fa = self._impl()
        t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        kw = self._args(q, k, causal)
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused without dropout
        aux = [lse.reshape(*lse.shape, 1).contiguous(), rng_state]
        dq, dk, dv, *_ = fa.fused_attn_bwd(kw.pop("max_seqlen_q"), kw.pop("max_seqlen_kv"),
                                           kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_kv"), t(q), t(k), t(v),
                                           t(out), t(dout), q.dtype, self._te_dtype[dout.dtype], aux,
                                           fa.FusedAttnBackend["F16_arbitrary_seqlen"], attn_scale=scale,
                                           dropout=0.0, deterministic=self.is_deterministic(), **kw)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


KERNELS: dict[str, Callable[[], BlockKernel]] = {
    "flash_cpu": FlashCPUKernel,
    "math": MathKernel,
    "sdpa_cuda": CudaSDPAKernel,
    "flash_attn": FlashAttnKernel,
    "flash_cuda": TorchFlashCudaKernel,
    "cudnn": CudnnKernel,
    "te_fused": TEFusedKernel,
}
# Fastest first (designed from the libraries' published figures, not measured here: no GPU). The math
# kernel supports everything, so `auto` always finds one.
# fp32 on CUDA therefore runs on the math kernel (the fused kernels take fp16/bf16 only).
_AUTO_ORDER = ("cudnn", "flash_attn", "te_fused", "flash_cuda", "flash_cpu", "math")
#: kernels refused by name until a GPU run passes (their classes and conformance tests stay)
UNVERIFIED = {"sdpa_cuda": "torch's memory-efficient CUDA op"}
_instances: dict[tuple[str, bool], BlockKernel] = {}
_auto_choice: dict[tuple, BlockKernel] = {}
_AUTO_KEPT = 4096  # choices kept, cleared when full


def _instance(name: str, det: bool) -> BlockKernel:
    """The kernel ``name`` with its determinism fixed to ``det`` (one object per pair; kernels keep no per-call
    state, so one object serves every call and layer)."""
    if (name, det) not in _instances:
        kernel = KERNELS[name]()
        kernel.deterministic = det
        _instances[name, det] = kernel
    return _instances[name, det]


def _refusal(kernel: BlockKernel, q: torch.Tensor, d: int, kv: tuple | None) -> str | None:
    """Why ``kernel`` cannot run the case (None: it can): with MLA head dims (``kv``: K and V, V of another head
    dim than q's; None: one head dim) as they are, where it takes them so
    (:meth:`~BlockKernel.unsupported_head_dims`), else its operands padded to ``d`` as :func:`operand_head_dim`
    pads them."""
    if kv is None:
        return kernel.unsupported(q, operand_head_dim(kernel, d))
    if (as_is := kernel.unsupported_head_dims(q, *kv)) is None:
        return None
    padded = kernel.unsupported(q, operand_head_dim(kernel, d))
    return padded and f"{padded} (MLA head dims {q.shape[-1]}/{kv[1].shape[-1]} as they are: {as_is})"


def select_kernel(q: torch.Tensor, kernel: str | BlockKernel = "auto", head_dim: int | None = None,
                  deterministic: bool | None = None, kv: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> BlockKernel:
    """The kernel for ``q``: ``"auto"`` picks the first kernel of ``_AUTO_ORDER`` that supports the case,
    once per (device, dtype, head dim, determinism, torch's flash / cuDNN SDPA switches; with MLA head dims, the
    shapes too), and caches it.
    ``head_dim``: the call's head dim (default q's; with MLA head dims, the larger of Q/K's and V's: the operands
    are padded to it), which each kernel is asked about rounded up as :func:`operand_head_dim` pads it (a head dim
    that is not a multiple of 8 runs on the fused CUDA kernels zero-padded, as torch's SDPA runs it on flash).
    ``kv``: the call's BHSD K and V: with V of another head dim than q's (MLA), a kernel that takes them as they
    are (:meth:`~BlockKernel.unsupported_head_dims`: cuDNN where torch's own SDPA hands it those head dims) is
    asked about them, not about the padded dim.
    ``deterministic``: the call's determinism (None: the process default, :func:`deterministic`); the kernel
    returned carries it. A kernel named that cannot run the case is refused here, with the reason.
    A kernel object is returned as it is (its own ``deterministic`` applies)."""
    if isinstance(kernel, BlockKernel):
        return kernel
    det = _process_default() if deterministic is None else bool(deterministic)
    d = q.shape[-1] if head_dim is None else head_dim
    kv = kv if kv is not None and kv[1].shape[-1] != q.shape[-1] else None  # MLA head dims, else None
    if kernel != "auto":
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; use 'auto' or one of {sorted(KERNELS)}")
        if kernel in UNVERIFIED:
            raise ValueError(f"kernel {kernel!r} ({UNVERIFIED[kernel]}) is not verified on a GPU yet and is "
                             "refused; use kernel='auto', 'cudnn' or 'flash_cuda' (fp16/bf16, sm80+) or "
                             "kernel='math' (any dtype, fp32 included)")
        named = _instance(kernel, det)
        dk = operand_head_dim(named, d)
        why = _refusal(named, q, d, kv)
        if why:
            padded = f" (padded to {dk})" if dk != d else ""
            raise ValueError(f"kernel {kernel!r} does not support {q.dtype} tensors with head dim {d}{padded} on "
                             f"{q.device.type}: {why}; use kernel='auto' (it picks a kernel that can) or "
                             "kernel='math'")
        return named
    # with MLA head dims, per shape: torch's rule (cuDNN as they are) reads them, and Call.padded asks it again
    shapes = None if kv is None else (tuple(q.shape), tuple(kv[0].shape), tuple(kv[1].shape), q.requires_grad)
    key = (q.device, q.dtype, d, det, _torch_switches(), shapes)
    if key not in _auto_choice:
        if len(_auto_choice) >= _AUTO_KEPT:  # shapes vary with packed batches: bounded
            _auto_choice.clear()
        _auto_choice[key] = next(k for k in (_instance(n, det) for n in _AUTO_ORDER) if _refusal(k, q, d, kv) is None)
    return _auto_choice[key]
