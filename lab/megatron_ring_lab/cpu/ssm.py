"""The CPU opt-in's part for Megatron's Mamba-2 and Gated-DeltaNet layers (HybridModel ``M`` and ``G``).

Megatron's ``MambaMixer`` and ``GatedDeltaNet`` refuse to build without ``mamba_ssm`` / flash-linear-attention
(their kernels are CUDA and Triton) and put their parameters on ``torch.cuda.current_device()``. While the
CPU opt-in is active (:func:`install`, called by ``enable_cpu_support``), and only where those packages
are missing, the layers' kernel names are bound to the pure-torch kernels of :mod:`.ssm_kernels` and their
constructors / forward see the CPU as the current device. Megatron's own context-parallel code for these
layers (``mamba_context_parallel.py``, the GDN all-to-alls, its undoing of attention's zigzag order) runs
unchanged: it is torch collectives over the CP group, which gloo serves. The GDN helpers Megatron
compiles with ``jit_fuser`` (``torch.compile``: 5-30 s per process on CPU) run as the plain functions.

Installed packages always win: a name is replaced only when its import failed (the module holds
``None`` / a ``MagicMock`` / ``HAVE_* = False``), so on a GPU machine with the kernels nothing changes.
What is replaced is listed by :func:`planned` (module, attribute) and recorded in the lab's patch ledger
(owner ``cpu.ssm``; ``torch.cuda.current_device`` only while a wrapped constructor / forward runs), which
``disable_cpu_support`` restores.
``einops`` is still needed (Megatron's Mamba code imports it; it is pinned in requirements/).
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from megatron_ring_lab import patches
from megatron_ring_lab.cpu import ssm_kernels as kernels

__all__ = ["install", "planned"]

Patch = Callable[[Any, str, Any], None]

#: the mamba_ssm entry points ``MambaMixer`` calls in training and prefill. Some megatron-core lines bind them
#: to None when mamba_ssm is missing; others (0.16) leave them unbound (the names are assigned only inside the
#: ``try`` of the import), so the opt-in binds them either way (and removes them again on exit).
MIXER_KERNELS = ("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined")


def _load(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a module whose own optional imports fail on this install
        return None


def _missing(value: Any) -> bool:
    """Whether a kernel name holds the stand-in Megatron binds when the import failed."""
    return value is None or type(value).__module__.startswith("unittest.mock")


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cpu_current_device() -> list[tuple[Any, str, Any]]:
    """``torch.cuda.current_device()`` is the CPU during the call (only where CUDA is unavailable)."""
    return [] if torch.cuda.is_available() else [(torch.cuda, "current_device", _cpu_device)]


def _on_cpu(fn: Callable) -> Callable:
    return patches.during(fn, "cpu.ssm", _cpu_current_device)


def _wrapped(fn: Any) -> bool:
    return hasattr(fn, "ledger_during")


@functools.lru_cache(maxsize=1)
def _extended_rms_norm_class() -> type:
    """``mamba_mixer.ExtendedRMSNorm`` on the pure-torch gated RMSNorm (same parameters, same checkpoint
    sharding: the weight split along dim 0 over tensor parallelism)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from megatron_ring.megatron import compat

    class ExtendedRMSNorm(kernels.RMSNormGated):
        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            from megatron.core import parallel_state

            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            kwargs = dict(state_dict=self.state_dict(prefix="", keep_vars=True), prefix=prefix,
                          tensor_parallel_layers_axis_map={"weight": 0}, sharded_offsets=sharded_offsets,
                          tp_group=tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
            return compat.call_with_supported_kwargs(make_sharded_tensors_for_checkpoint, kwargs,
                                                     defaults={"tp_group": tp_group, "dp_cp_group": None})

    return ExtendedRMSNorm


def _packing_supported(*args: Any, **kwargs: Any) -> tuple[bool, None]:
    """The pure-torch kernels take ``seq_idx`` (packed documents) in training and prefill."""
    return True, None


def planned() -> list[tuple[Any, str, Any]]:
    """``(module, attribute, replacement)`` for every name the opt-in replaces on this install."""
    out: list[tuple[Any, str, Any]] = []
    mixer = _load("megatron.core.ssm.mamba_mixer")
    if mixer is not None and not getattr(mixer, "HAVE_MAMBA_SSM", True):
        out += [(mixer, "HAVE_MAMBA_SSM", True),
                (mixer, "ExtendedRMSNorm", _extended_rms_norm_class()),
                *((mixer, name, getattr(kernels, name)) for name in MIXER_KERNELS)]
        if hasattr(mixer, "_check_mamba_sequence_packing_support"):
            out.append((mixer, "_check_mamba_sequence_packing_support", _packing_supported))
    if mixer is not None and _missing(getattr(mixer, "causal_conv1d_fn", None)):
        out.append((mixer, "causal_conv1d_fn", kernels.causal_conv1d_fn))
    if mixer is not None and not _wrapped(mixer.MambaMixer.__init__):
        out.append((mixer.MambaMixer, "__init__", _on_cpu(mixer.MambaMixer.__init__)))
    # Gated DeltaNet: a package (common.py + gdn.py) on newer lines, one module on older ones
    common = _load("megatron.core.ssm.gated_delta_net.common") or _load("megatron.core.ssm.gated_delta_net")
    gdn = _load("megatron.core.ssm.gated_delta_net.gdn") or common
    if common is not None and not getattr(common, "HAVE_FLA", True):
        out += [(common, "HAVE_FLA", True), (common, "l2norm", kernels.l2norm)]
        for module in {id(common): common, id(gdn): gdn}.values():
            for name, fn in (("causal_conv1d", kernels.fla_causal_conv1d),
                             ("chunk_gated_delta_rule", kernels.chunk_gated_delta_rule)):
                if hasattr(module, name) and _missing(getattr(module, name)):
                    out.append((module, name, fn))
    if gdn is not None and hasattr(gdn, "GatedDeltaNet"):
        classes = [gdn.GatedDeltaNet] + [c for c in gdn.GatedDeltaNet.__mro__[1:] if c.__module__ == common.__name__]
        for cls in classes:
            for name in ("__init__", "reset_parameters", "forward"):
                fn = cls.__dict__.get(name)
                if fn is not None and not _wrapped(fn):
                    out.append((cls, name, _on_cpu(fn)))
            for name, fn in list(cls.__dict__.items()):  # jit_fuser (torch.compile): seconds per process on CPU
                orig = getattr(fn, "_torchdynamo_orig_callable", None)
                if callable(orig):
                    out.append((cls, name, orig))
    # any other name this megatron-core never binds (0.16's single-module GDN has no ``l2norm`` without FLA; its
    # GDN is not part of its hybrid stack) is left alone; the mixer's kernels are bound even where absent
    return [(obj, attr, new) for obj, attr, new in out
            if hasattr(obj, attr) or (obj is mixer and attr in MIXER_KERNELS)]


def install(patch: Patch) -> None:
    """Apply :func:`planned` through the CPU opt-in's ``patch(obj, attr, new)`` (the ledger's, which records it)."""
    for obj, attr, new in planned():
        patch(obj, attr, new)
