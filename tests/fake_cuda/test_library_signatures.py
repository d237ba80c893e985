"""Our calls into flash_attn and TransformerEngine match those libraries' function signatures at the
versions we name (neither can be installed here: no GPU, no CUDA toolkit).

The expected signatures are DATA, read from the libraries' sources (the Python ``def`` of each function:
its parameters in order, which have no default, and the defaults of the ones our calls leave out):

* flash_attn v2.8.3, ``flash_attn/flash_attn_interface.py``: ``_flash_attn_forward``, ``_flash_attn_backward``;
* TransformerEngine v2.9, ``transformer_engine/pytorch/cpp_extensions/fused_attn.py``: ``fused_attn_fwd``,
  ``fused_attn_bwd`` and the keys of ``FusedAttnBackend``.

The kernels (``kernels/block.py``: ``FlashAttnKernel``, ``TEFusedKernel``) run against stand-in modules
whose functions bind each call to the recorded signature (``inspect.Signature.bind``: a missing required
argument, an unknown keyword or too many positional arguments fail) and return tensors of the documented
shapes. Every argument of each call, after the library's defaults are applied, is then compared with
``PINNED``: what the library's own autograd function passes for a dense, dropout-free, bias-free block
(flash_attn's ``FlashAttnFunc``, TransformerEngine's ``FusedAttnFunc``), so a value passed at the wrong
position, a default that changed meaning or a torch dtype where the library wants its own ``DType``
(TransformerEngine's ``dqkv_dtype``) fails here. A library release that changes these signatures needs a
new row here and, where they differ, a new call in the kernel.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron_ring.kernels import block as K

SIGNATURES = {
    ("flash_attn", "2.8.3", "flash_attn/flash_attn_interface.py"): {
        "_flash_attn_forward": (
            ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
             "softcap", "alibi_slopes", "return_softmax"], 11),
        "_flash_attn_backward": (
            ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p", "softmax_scale", "causal",
             "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic", "rng_state"], 17),
    },
    ("transformer_engine", "2.9", "transformer_engine/pytorch/cpp_extensions/fused_attn.py"): {
        "fused_attn_fwd": (
            ["is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
             "fake_dtype", "fused_attention_backend", "attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
             "page_table_k", "page_table_v", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
             "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
             "rng_gen", "softmax_offset", "return_max_logit"], 10),
        "fused_attn_bwd": (
            ["max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o",
             "fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend", "cu_seqlens_q_padded",
             "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer", "dqkv_quantizer", "attn_scale", "dropout",
             "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
             "deterministic"], 13),
        "FusedAttnBackend": (["F16_max512_seqlen", "F16_arbitrary_seqlen", "FP8", "No_Backend"], None),
    },
}


#: the defaults of the parameters our calls leave out (any other parameter without one: None)
DEFAULTS = {
    "_flash_attn_backward": {"rng_state": None},
    "fused_attn_fwd": {"dropout": 0.0, "fast_zero_fill": True, "qkv_layout": "sbh3d", "attn_bias_type": "no_bias",
                       "attn_mask_type": "padding", "softmax_type": "vanilla", "window_size": (-1, -1),
                       "return_max_logit": False},
    "fused_attn_bwd": {"dropout": 0.0, "fast_zero_fill": True, "qkv_layout": "sbh3d", "attn_bias_type": "no_bias",
                       "attn_mask_type": "padding", "softmax_type": "vanilla", "window_size": (-1, -1),
                       "deterministic": False},
}

#: the value each argument must have (after defaults), per call; "tensor:<what>" checks a tensor's layout
PINNED = {
    "_flash_attn_forward": dict(q="tensor:bshd", k="tensor:bshd", v="tensor:bshd", dropout_p=0.0,
                                softmax_scale=0.125, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                alibi_slopes=None, return_softmax=False),
    "_flash_attn_backward": dict(dout="tensor:bshd", q="tensor:bshd", k="tensor:bshd", v="tensor:bshd",
                                 out="tensor:bshd", softmax_lse="tensor:lse", dq="tensor:bshd", dk="tensor:bshd",
                                 dv="tensor:bshd", dropout_p=0.0, softmax_scale=0.125, window_size_left=-1,
                                 window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                 rng_state=None),
    "fused_attn_fwd": dict(is_training=True, max_seqlen_q=32, max_seqlen_kv=32, cu_seqlens_q="tensor:cu",
                           cu_seqlens_kv="tensor:cu", q="tensor:bshd", k="tensor:bshd", v="tensor:bshd",
                           fake_dtype=torch.bfloat16, fused_attention_backend="F16_arbitrary_seqlen", attn_bias=None,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
                           s_quantizer=None, o_quantizer=None, attn_scale=0.125, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="bshd_bshd_bshd", attn_bias_type="no_bias", softmax_type="vanilla",
                           window_size=(-1, -1), rng_gen=None, softmax_offset=None, return_max_logit=False),
    "fused_attn_bwd": dict(max_seqlen_q=32, max_seqlen_kv=32, cu_seqlens_q="tensor:cu", cu_seqlens_kv="tensor:cu",
                           q="tensor:bshd", k="tensor:bshd", v="tensor:bshd", o="tensor:bshd", d_o="tensor:bshd",
                           fake_dtype=torch.bfloat16, dqkv_dtype="TE:bfloat16", aux_ctx_tensors="aux",
                           fused_attention_backend="F16_arbitrary_seqlen", cu_seqlens_q_padded=None,
                           cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                           attn_scale=0.125, dropout=0.0, fast_zero_fill=True, qkv_layout="bshd_bshd_bshd",
                           attn_bias_type="no_bias", softmax_type="vanilla", window_size=(-1, -1),
                           deterministic=False),
}
B, H, S, D = 2, 4, 32, 64  # the blocks of these tests (BHSD)


def _pinned_ok(want, got) -> bool:
    if want == "tensor:bshd":
        return isinstance(got, torch.Tensor) and got.shape[:3] == (B, S, H) and got.is_contiguous()
    if want == "tensor:lse":
        return isinstance(got, torch.Tensor) and got.shape == (B, H, S) and got.dtype == torch.float32 \
            and got.is_contiguous()
    if want == "tensor:cu":
        return isinstance(got, torch.Tensor) and got.dtype == torch.int32 and got.tolist() == [0, S, 2 * S]
    if want == "aux":  # [softmaxStats, rng_state]: F16_arbitrary_seqlen without dropout or bias
        return isinstance(got, list) and len(got) == 2 and got[0].shape == (B, H, S, 1) \
            and got[0].dtype == torch.float32 and got[1].shape == (2,) and got[1].dtype == torch.int64
    return type(want) is type(got) and want == got


def mismatches(name: str, arguments: dict, causal: bool) -> list[str]:
    """Where a recorded call (defaults applied) differs from ``PINNED`` (``causal`` and the mask type by case)."""
    want = dict(PINNED[name])
    if "causal" in arguments:
        want["causal"] = causal
    if "attn_mask_type" in arguments:
        want["attn_mask_type"] = "causal" if causal else "no_mask"
    return [f"{name}.{k}: {arguments.get(k)!r}" for k in arguments if not _pinned_ok(want.get(k, "?"), arguments[k])]


def _signature(name: str, params: list[str], required: int) -> inspect.Signature:
    P = inspect.Parameter
    defaults = DEFAULTS.get(name, {})
    return inspect.Signature([P(p, P.POSITIONAL_OR_KEYWORD, **({} if i < required else {"default": defaults.get(p)}))
                              for i, p in enumerate(params)])


def _expected(lib: str) -> dict:
    return next(v for (name, _, _), v in SIGNATURES.items() if name == lib)


class _Recorder:
    def __init__(self, lib: str, results) -> None:
        self.calls, self.sigs, self.results = [], _expected(lib), results

    def __getattr__(self, name):
        params, required = self.sigs[name]
        if required is None:  # a table: its keys
            return {k: k for k in params}
        sig = _signature(name, params, required)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError if our call does not fit the signature
            bound.apply_defaults()
            self.calls.append((name, bound.arguments))
            return self.results[name](bound.arguments)
        return call


def _qkv(dtype=torch.float16):
    return [torch.randn(B, H, S, D, dtype=dtype) for _ in range(3)]  # BHSD


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_calls_match_its_signatures(causal):
    results = {
        "_flash_attn_forward": lambda a: (torch.zeros_like(a["q"]),
                                          torch.zeros(a["q"].shape[0], a["q"].shape[2], a["q"].shape[1]), None, None),
        "_flash_attn_backward": lambda a: torch.zeros(1),
    }
    rec = _Recorder("flash_attn", results)
    kern = K.FlashAttnKernel()
    kern._mod = rec
    q, k, v = _qkv()
    out, lse = kern._fwd(q, k, v, causal, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    dq, dk, dv = kern._bwd(out, q, k, v, out, lse, causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for name, arguments in rec.calls:
        assert mismatches(name, arguments, causal) == []


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_engine_calls_match_its_signatures(causal):
    results = {
        "fused_attn_fwd": lambda a: (torch.zeros_like(a["q"]),
                                     [torch.zeros(a["q"].shape[0], a["q"].shape[2], a["q"].shape[1], 1), None]),
        "fused_attn_bwd": lambda a: (torch.zeros_like(a["q"]), torch.zeros_like(a["k"]), torch.zeros_like(a["v"])),
    }
    rec = _Recorder("transformer_engine", results)
    kern = K.TEFusedKernel()
    kern._fa, kern._te_dtype = rec, {torch.bfloat16: "TE:bfloat16", torch.float16: "TE:float16"}
    q, k, v = _qkv(torch.bfloat16)
    out, lse = kern._fwd(q, k, v, causal, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    dq, dk, dv = kern._bwd(out, q, k, v, out, lse, causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for name, arguments in rec.calls:
        assert mismatches(name, arguments, causal) == []


def test_the_recorder_refuses_a_call_that_does_not_fit():
    """Not vacuous: a call with a renamed keyword (flash_attn 2.5's ``window_size``) is refused."""
    rec = _Recorder("flash_attn", {"_flash_attn_forward": lambda a: None})
    q = torch.zeros(1)
    with pytest.raises(TypeError):
        rec._flash_attn_forward(q, q, q, 0.0, 1.0, causal=True, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, return_softmax=False)


def test_the_pinned_values_catch_a_torch_dtype_where_te_wants_its_own():
    """Not vacuous: TransformerEngine's backward called as it was (``dqkv_dtype`` a torch dtype, where its own
    autograd passes ``TE_DType[d_out.dtype]``) and a flash_attn forward with a window are reported."""
    rec = _Recorder("transformer_engine", {
        "fused_attn_fwd": lambda a: (torch.zeros_like(a["q"]), [torch.zeros(B, H, S, 1), None]),
        "fused_attn_bwd": lambda a: (torch.zeros_like(a["q"]), torch.zeros_like(a["k"]), torch.zeros_like(a["v"]))})
    kern = K.TEFusedKernel()
    kern._fa, kern._te_dtype = rec, {torch.bfloat16: torch.bfloat16}  # the torch dtype passed through
    q, k, v = _qkv(torch.bfloat16)
    out, lse = kern._fwd(q, k, v, True, 0.125)
    kern._bwd(out, q, k, v, out, lse, True, 0.125)
    assert mismatches(*rec.calls[1], True) == ["fused_attn_bwd.dqkv_dtype: torch.bfloat16"]
    t = torch.zeros(B, S, H, D)
    fwd = dict(PINNED["_flash_attn_forward"], q=t, k=t, v=t, causal=True, window_size_left=128)
    assert mismatches("_flash_attn_forward", fwd, True) == ["_flash_attn_forward.window_size_left: 128"]
