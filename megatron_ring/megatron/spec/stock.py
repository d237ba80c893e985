"""What a spec run by stock Megatron needs: the ring core attention for Megatron's own (zigzag) batch split,
the layout check, the swap, and the start-up line naming the core attentions a spec holds."""
from __future__ import annotations

from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["ring_core", "check_stock_layout", "swap", "transformer_config", "describe_core_attention", "announce"]


def ring_core() -> Any:
    """Core attention for specs run by stock Megatron: batches split by Megatron (zigzag)."""
    from megatron_ring.megatron.attention.module import RingDotProductAttention

    return ModuleSpec(module=RingDotProductAttention, params={"batch_split": "megatron"})


def check_stock_layout() -> None:
    from megatron_ring.megatron.config import ContextParallelConfigError
    from megatron_ring.megatron.env import ring_config_from_env
    from megatron_ring.megatron.groups.provider import get_ring_state, is_context_parallel_initialized

    registered = is_context_parallel_initialized()
    cfg = get_ring_state().config if registered else ring_config_from_env()
    if cfg.layout != "zigzag":
        where = "RingConfig.layout (initialize_context_parallel)" if registered else "MEGATRON_RING_LAYOUT"
        raise ContextParallelConfigError(
            where, f"layout {cfg.layout!r} needs a batch split and RoPE that stock Megatron does not do (it splits "
                   "zigzag); use zigzag with --spec / ring_spec, or run examples/pretrain_ring_gpt.py --cp-layout ... "
                   "or the patch in patches/")


def swap(spec: Any) -> Any:
    from megatron_ring.megatron.spec.layers import with_ring_attention

    check_stock_layout()
    return with_ring_attention(spec, ring_core())


def transformer_config(config: Any) -> Any:
    """The ``TransformerConfig`` inside a ``GPTModelConfig`` (or the config itself)."""
    return getattr(config, "transformer", config)


def describe_core_attention(spec: Any) -> str:
    """``"RingDotProductAttention x2, DotProductAttention x1"``: the core attentions named in a spec tree."""
    import dataclasses

    seen: dict[str, int] = {}

    def walk(node: Any, memo: set) -> None:
        if id(node) in memo:
            return
        memo.add(id(node))
        if isinstance(node, (list, tuple)):
            for x in node:
                walk(x, memo)
        elif isinstance(node, ModuleSpec):
            core = getattr(node.submodules, "core_attention", None) if node.submodules is not None else None
            if core is not None:
                mod = core.module if isinstance(core, ModuleSpec) else core
                name = getattr(mod, "__name__", type(mod).__name__)
                seen[name] = seen.get(name, 0) + 1
            else:
                walk(node.submodules, memo)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), memo)

    walk(spec, set())
    return ", ".join(f"{k} x{v}" for k, v in seen.items()) or "none"


def announce(where: str, spec: Any, config: Any, note: str = "") -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from megatron_ring.megatron.env import ring_config_from_env
    from megatron_ring.megatron.groups.provider import get_ring_state, is_context_parallel_initialized

    cfg = get_ring_state().config if is_context_parallel_initialized() else ring_config_from_env()
    tc = transformer_config(config)
    from megatron_ring.megatron.config import normalize_comm_type

    model_ct = normalize_comm_type(getattr(tc, "cp_comm_type", None))  # Megatron's --cp-comm-type wins
    comm = (model_ct if isinstance(model_ct, str) else ",".join(model_ct)) if model_ct else ",".join(cfg.cp_comm_type)
    print(f"> megatron_ring ({where}): core attention of the layer spec: {describe_core_attention(spec)} "
          f"(CP={getattr(tc, 'context_parallel_size', '?')}, layout {cfg.layout}, wire {cfg.comm_dtype}, "
          f"comm {comm}; CP group from Megatron at each call){'; ' + note if note else ''}", flush=True)


