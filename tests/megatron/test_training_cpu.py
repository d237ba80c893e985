"""The scoped CPU opt-in for Megatron-LM's training loop, and the Megatron-LM 0.19 config glue (no launches)."""
from __future__ import annotations

import argparse
import importlib
import types

import pytest
import torch

from megatron_ring.megatron.compat import has_megatron_training

pytestmark = pytest.mark.skipif(not has_megatron_training(), reason="megatron.training is not installed "
                                "(megatron-core >= 0.19 wheel or a Megatron-LM checkout)")

#: every function megatron_training_cpu() replaces, by name (keep in sync with docs/megatron-lm.md)
EXPECTED = {
    ("torch.cuda", "synchronize"), ("torch.cuda", "current_device"), ("torch.cuda", "Stream"),
    ("torch.cuda", "Event"), ("torch.cuda", "current_stream"), ("torch.cuda", "default_stream"),
    ("torch.cuda", "stream"), ("torch.cuda", "set_stream"), ("torch.cuda", "empty_cache"),
    ("torch.cuda", "memory_allocated"), ("torch.cuda", "max_memory_allocated"), ("torch.cuda", "memory_reserved"),
    ("torch.cuda", "max_memory_reserved"), ("torch.cuda", "reset_peak_memory_stats"),
    ("torch.cuda", "reset_max_memory_allocated"), ("torch.cuda", "memory_stats"), ("torch.cuda", "manual_seed"),
    ("torch.cuda", "manual_seed_all"), ("torch.cuda", "ipc_collect"),
    ("torch.cuda", "get_rng_state"), ("torch.cuda", "set_rng_state"),
    ("megatron.training.training", "initialize_megatron"),
    ("megatron.training.initialize", "_initialize_distributed"),
    ("megatron.training.initialize", "_set_random_seed"),
    ("megatron.training.initialize", "_compile_dependencies"),
    ("megatron.training.training", "set_jit_fusion_options"),
    ("megatron.training.arguments", "get_device_arch_version"),
    ("megatron.training.arguments", "is_te_min_version"),
    ("megatron.training.training", "clip_qk"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
}


def _current():
    return {(m, a): getattr(importlib.import_module(m), a) for m, a in EXPECTED}


def test_training_cpu_replaces_exactly_the_named_functions_and_restores_them():
    from megatron_ring_lab.cpu import cpu_support_enabled
    from megatron_ring_lab.cpu.training import REPLACED, megatron_training_cpu, training_cpu_enabled
    from megatron_ring_lab.patches import during_calls, list_patches

    assert set(REPLACED) == EXPECTED and len(REPLACED) == len(EXPECTED)
    before = _current()
    with megatron_training_cpu():
        inside = _current()
        assert all(inside[k] is not before[k] for k in EXPECTED), [k for k in EXPECTED if inside[k] is before[k]]
        # read from the lab's patch ledger: what it applied for the loop, and what its wrappers swap per call
        assert [(p.where, p.name) for p in list_patches() if p.owner == "cpu.training"] == list(REPLACED)
        assert sorted((p.during, p.name) for p in during_calls() if p.owner == "cpu.training") == [
            ("_initialize_distributed", "device_count"), ("_initialize_distributed", "set_device"),
            ("_set_random_seed", "device_count"), ("_set_random_seed", "set_device")]
        assert training_cpu_enabled() and cpu_support_enabled()
        t = torch.zeros(3, device="cuda")  # device='cuda' lands on the CPU
        assert t.device.type == "cpu" and t.cuda() is t and t.to("cuda").device.type == "cpu"
        assert t.to(torch.float64, True).dtype == torch.float64 and t.to(0).device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"  # what Megatron's optimizers/clip_grads compare against
        with pytest.raises(RuntimeError, match="already active"):
            with megatron_training_cpu():
                pass
    after = _current()
    assert all(after[k] is before[k] for k in EXPECTED)
    assert not training_cpu_enabled() and not cpu_support_enabled() and not list_patches()
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_training_cpu_restores_everything_on_an_exception():
    from megatron_ring_lab.cpu.training import megatron_training_cpu, training_cpu_enabled
    from megatron_ring_lab.patches import list_patches

    before = _current()
    with pytest.raises(KeyError):
        with megatron_training_cpu():
            raise KeyError("inside the loop")
    after = _current()
    assert all(after[k] is before[k] for k in EXPECTED) and not list_patches() and not training_cpu_enabled()


def test_training_cpu_is_never_active_on_cuda(monkeypatch):
    from megatron_ring_lab.cpu.training import megatron_training_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        with megatron_training_cpu():
            pass


def _args(**kw):
    from megatron.core.transformer.enums import AttnBackend

    base = dict(context_parallel_size=2, attention_backend=AttnBackend.auto, cp_layout="striped",
                cp_comm_dtype="none", cp_comm_type=["p2p"], hierarchical_context_parallel_sizes=None,
                seq_length=64, cp_timeout_seconds=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_gpt_config_glue_puts_ring_into_the_spec_and_refuses_attention_backend_local(monkeypatch):
    from megatron.core.transformer.enums import AttnBackend

    from megatron_ring.megatron import ContextParallelConfigError, RingDotProductAttention, compat
    from megatron_ring.megatron.spec import megatron_lm

    cfg = types.SimpleNamespace(transformer_layer_spec=None, pre_wrap_hooks=[])
    assert megatron_lm.use_ring_attention_in_gpt_config(_args(context_parallel_size=1), cfg) is cfg
    assert cfg.transformer_layer_spec is None and cfg.pre_wrap_hooks == []  # CP = 1: Megatron's attention
    with pytest.raises(ContextParallelConfigError, match="--attention-backend"):
        megatron_lm.use_ring_attention_in_gpt_config(_args(attention_backend=AttnBackend.local), cfg)
    with pytest.raises(ContextParallelConfigError, match="--attention-backend"):  # set in the model config
        megatron_lm.use_ring_attention_in_gpt_config(
            _args(), types.SimpleNamespace(transformer_layer_spec=None, pre_wrap_hooks=[],
                                           attention_backend=AttnBackend.local))

    local = compat.gpt_layer_local_spec(normalization="RMSNorm")
    cfg = types.SimpleNamespace(transformer_layer_spec=local, pre_wrap_hooks=[])
    registered = []
    monkeypatch.setattr(megatron_lm, "initialize_context_parallel", lambda c, **k: registered.append(c))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    megatron_lm.use_ring_attention_in_gpt_config(_args(), cfg)
    spec = cfg.transformer_layer_spec(None, vp_stage=0)  # what GPTModelBuilder calls
    assert spec.submodules.self_attention.submodules.core_attention is RingDotProductAttention
    assert registered and registered[0].layout == "striped" and len(cfg.pre_wrap_hooks) == 1
    assert local.submodules.self_attention.submodules.core_attention is not RingDotProductAttention


@pytest.mark.slow  # starts a process
def test_each_replaced_cuda_function_is_its_own_object():
    """dynamo keeps one trace rule per torch object: one stand-in under several torch.cuda names made the first
    torch.compile inside the opt-in assert "Duplicate torch object" (Megatron's compiled MoE router). dynamo builds
    its rule map once per process (importing megatron-core already does), so the test rebuilds it inside the opt-in
    (the old stand-ins fail exactly there), then compiles a function."""
    import os
    import subprocess
    import sys

    code = ("import torch\n"
            "from megatron_ring_lab.cpu.training import megatron_training_cpu\n"
            "with megatron_training_cpu():\n"
            "    from torch._dynamo import trace_rules\n"
            "    trace_rules.get_torch_obj_rule_map.cache_clear()\n"
            "    trace_rules.get_torch_obj_rule_map()\n"
            "    f = torch.compile(lambda x: torch.sigmoid(x) * 2, backend='eager', fullgraph=True)\n"
            "    assert torch.equal(f(torch.ones(3)), torch.sigmoid(torch.ones(3)) * 2)\n"
            "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_clip_qk_gets_fp32_chunks_in_the_shape_it_walks():
    """Megatron's clip_qk walks ``chunk.module.module`` (DDP, then the bf16/fp16 wrapper): an fp32 chunk (DDP around
    the model) raises AttributeError there; the opt-in's entry hands it the model at that depth, bf16 chunks as
    they are."""
    from megatron.core.optimizer.qk_clip import clip_qk
    from megatron_ring_lab.cpu.training import _clip_qk_any_precision

    seen = set()  # the layers clip_qk reached

    class Attention:
        core_attention = types.SimpleNamespace(current_max_attn_logits=None)  # reset: clip_qk skips it

        def clip_qk(self):
            raise AssertionError("nothing to clip")

    class Layer:
        @property
        def self_attention(self):
            seen.add(self)
            return Attention()

    class Model(torch.nn.Module):  # a module without .module, as GPTModel
        def __init__(self):
            super().__init__()
            self.decoder = types.SimpleNamespace(layers=[Layer(), Layer()])

    fp32 = types.SimpleNamespace(module=Model())  # DDP(model)
    with pytest.raises(AttributeError, match="module"):  # control: Megatron's own walk
        clip_qk([fp32], log_max_only=True)
    assert _clip_qk_any_precision(clip_qk)([fp32], log_max_only=True) == 0 and len(seen) == 2
    bf16 = types.SimpleNamespace(module=types.SimpleNamespace(module=Model()))  # DDP(Float16Module(model))
    assert _clip_qk_any_precision(clip_qk)([bf16], log_max_only=True) == 0 and len(seen) == 4
