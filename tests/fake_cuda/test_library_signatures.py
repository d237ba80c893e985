"""Our calls into flash_attn and TransformerEngine match those libraries' function signatures at the
versions we name (neither can be installed here: no GPU, no CUDA toolkit).

The expected signatures are DATA, read from the libraries' sources (the Python ``def`` of each function:
its parameters in order and which have no default):

* flash_attn v2.8.3, ``flash_attn/flash_attn_interface.py``: ``_flash_attn_forward``, ``_flash_attn_backward``;
* TransformerEngine v2.9, ``transformer_engine/pytorch/cpp_extensions/fused_attn.py``: ``fused_attn_fwd``,
  ``fused_attn_bwd`` and the keys of ``FusedAttnBackend``.

The kernels (``kernels/block.py``: ``FlashAttnKernel``, ``TEFusedKernel``) run against stand-in modules
whose functions bind each call to the recorded signature (``inspect.Signature.bind``: a missing required
argument, an unknown keyword or too many positional arguments fail) and return tensors of the documented
shapes. A library release that changes these signatures needs a new row here and, where they differ, a
new call in the kernel.
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


def _signature(params: list[str], required: int) -> inspect.Signature:
    P = inspect.Parameter
    return inspect.Signature([P(p, P.POSITIONAL_OR_KEYWORD, **({} if i < required else {"default": None}))
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
        sig = _signature(params, required)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError if our call does not fit the signature
            self.calls.append((name, bound.arguments))
            return self.results[name](bound.arguments)
        return call


def _qkv(dtype=torch.float16):
    return [torch.randn(2, 4, 32, 64, dtype=dtype) for _ in range(3)]  # BHSD


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
    fwd, bwd = rec.calls
    assert fwd[1]["causal"] is causal and fwd[1]["softmax_scale"] == 0.125 and fwd[1]["q"].shape[1] == 32  # BSHD
    assert bwd[1]["dq"].shape == (2, 32, 4, 64) and bwd[1]["deterministic"] in (True, False)


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_engine_calls_match_its_signatures(causal):
    results = {
        "fused_attn_fwd": lambda a: (torch.zeros_like(a["q"]),
                                     [torch.zeros(a["q"].shape[0], a["q"].shape[2], a["q"].shape[1], 1), None]),
        "fused_attn_bwd": lambda a: (torch.zeros_like(a["q"]), torch.zeros_like(a["k"]), torch.zeros_like(a["v"])),
    }
    rec = _Recorder("transformer_engine", results)
    kern = K.TEFusedKernel()
    kern._fa = rec
    q, k, v = _qkv(torch.bfloat16)
    out, lse = kern._fwd(q, k, v, causal, 0.125)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    dq, dk, dv = kern._bwd(out, q, k, v, out, lse, causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    (_, fwd), (_, bwd) = rec.calls
    for call in (fwd, bwd):
        assert call["qkv_layout"] == "bshd_bshd_bshd" and call["fused_attention_backend"] == "F16_arbitrary_seqlen"
        assert call["attn_mask_type"] == ("causal" if causal else "no_mask") and call["attn_scale"] == 0.125
    assert fwd["is_training"] is True and bwd["aux_ctx_tensors"][0].shape == (*q.shape[:3], 1)


def test_the_recorder_refuses_a_call_that_does_not_fit():
    """Not vacuous: a call with a renamed keyword (flash_attn 2.5's ``window_size``) is refused."""
    rec = _Recorder("flash_attn", {"_flash_attn_forward": lambda a: None})
    q = torch.zeros(1)
    with pytest.raises(TypeError):
        rec._flash_attn_forward(q, q, q, 0.0, 1.0, causal=True, window_size=(-1, -1), softcap=0.0,
                                alibi_slopes=None, return_softmax=False)
