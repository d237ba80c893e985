"""Refuse a RoPE model whose rotary positions do not follow the ring's split of the sequence.

Megatron applies RoPE before core attention, with positions of its own split: its zigzag for ``[s, b]`` batches
(``get_pos_emb_on_this_cp_rank``), TransformerEngine's per-document zigzag for packed (THD) batches. When the
batch was split by the ring's layout (``batch_split="ring"``: :func:`~megatron_ring.megatron.get_batch_on_this_cp_rank`
with ``striped`` / ``contiguous``, or any packed stream), those positions land on other tokens, and the model
trains with no error. :func:`~megatron_ring.megatron.data.rope.use_layout_rope` makes RoPE follow the layout; a
model built without it, or with it at another layout, is refused here, on every rank alike, before the ring runs.

The core attention does not see RoPE, so it learns whether the model applies it from its parent attention module:
when Megatron assigns the core attention into it (a module registration hook, installed while a ring core attention
waits for its parent), a forward pre-hook on the parent reads that module's first call (``rotary_pos_emb`` given,
or an MLA's own ``rotary_pos_emb`` module) and then removes itself. A core attention with no such parent (called on
its own) is never refused.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook

from megatron_ring.megatron.config import ContextParallelConfigError

__all__ = ["watch", "check"]

_waiting: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # ring core attentions not yet in a parent
_hook: list = []  # the registration hook's handle while any wait


def watch(ring: torch.nn.Module) -> None:
    """Note ``ring`` (a new core attention): its parent, once it is assigned into one, reports RoPE to it."""
    ring.rope_applied = None  # None: not known (no parent call seen); then True / False
    ring.rope_layout = None  # the layout use_layout_rope gave the model's RoPE (None: not called)
    _waiting.add(ring)
    if not _hook:
        _hook.append(register_module_module_registration_hook(_adopted))


def _adopted(parent: torch.nn.Module, name: str, child: Any) -> None:
    if isinstance(child, torch.nn.Module) and child in _waiting:
        _waiting.discard(child)
        if _first_call not in parent._forward_pre_hooks.values():
            parent.register_forward_pre_hook(_first_call, with_kwargs=True)


def _first_call(parent: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The parent's first call tells whether the model applies RoPE; then the hook goes (no host work later). It
    finds its rings and itself through ``parent``, so a deep copy of the model keeps a hook of its own."""
    given = _arguments(parent, args, kwargs)
    applied = isinstance(getattr(parent, "rotary_pos_emb", None), torch.nn.Module) or any(  # MLA: its own RoPE
        given.get(k) is not None for k in ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_cos_sin"))
    rings = [child for child in parent.children() if hasattr(child, "check_rope")]
    for ring in rings:
        ring.rope_applied = applied
    for key in [k for k, hook in parent._forward_pre_hooks.items() if hook is _first_call]:
        del parent._forward_pre_hooks[key]
        parent._forward_pre_hooks_with_kwargs.pop(key, None)
    if not _waiting and _hook:  # (not in _adopted: torch iterates over the registration hooks there)
        _hook.pop().remove()
    for ring in rings:  # before Megatron applies RoPE (its THD split can fail first, on its own terms)
        ring.check_rope(given.get("packed_seq_params"))


def _arguments(parent: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The parent's call arguments by name (Megatron passes them by keyword; a positional call is bound to the
    parent's signature)."""
    given = dict(kwargs)
    try:
        given.update(inspect.signature(parent.forward).bind_partial(*args).arguments)
    except (TypeError, ValueError):
        pass
    return given


def check(ring: Any, cp_size: int, layout: str, packed: bool) -> None:
    """Raise :class:`ContextParallelConfigError` if ``ring``'s model applies RoPE at positions other than those of
    the tokens this rank holds (``layout`` over ``cp_size`` ranks; ``packed``: a THD batch in the ring's order)."""
    if cp_size <= 1 or not ring.rope_applied:
        return
    fix = ("call megatron_ring.megatron.use_layout_rope(model) once after building the model (it takes the "
           "registered ring's layout)")
    if packed:
        if ring.packed_rope is None:
            why = (" (it hands packed batches' RoPE to the ring core attentions of a model chunk with one "
                   "RotaryEmbedding; this chunk has several)" if ring.rope_layout else "")
            raise ContextParallelConfigError(
                "--cp-layout", f"this model applies Megatron's own RoPE to a packed (THD) batch at context parallel "
                f"size {cp_size}: Megatron cuts each document into 2*CP pieces of its own, not the ring's "
                f"{layout!r} split of the packed stream, so tokens would get other tokens' positions; {fix}{why}")
        return
    rope = ring.rope_layout or "zigzag"  # Megatron's own slicing is its zigzag
    if rope != layout:
        where = (f"use_layout_rope(model, {rope!r}) set its RoPE positions for layout {rope!r}" if ring.rope_layout
                 else "this model applies Megatron's own RoPE, which takes positions of its zigzag split")
        raise ContextParallelConfigError(
            "--cp-layout", f"{where}, but the ring splits the sequence with layout {layout!r} at context parallel "
            f"size {cp_size}, so tokens would get other tokens' positions; {fix}, or use --cp-layout {rope}")
