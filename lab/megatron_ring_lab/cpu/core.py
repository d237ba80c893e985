"""Explicit, scoped opt-in that lets megatron-core run on CPU with the gloo backend.

megatron-core 0.16 calls CUDA in a few places that its CPU-initialised path still reaches:

* ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on ``torch.cuda.current_device()``
  (used by the local ``DotProductAttention``);
* the RNG tracker (``tensor_parallel.random``) forks *CUDA* generator states;
* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to CUDA;
* ``transformer.utils.get_default_causal_mask`` (the local softmax's mask when none is passed) is built
  on CUDA (also bound by name in ``fusions.fused_softmax``);
* ``rope_utils.get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory`` + ``.cuda()``
  (and is also bound by name in the rotary / YaRN modules);
* packed (THD) batches at CP > 1: Megatron's own batch split and Mamba's undo of attention's order call
  TransformerEngine's ``thd_get_partitioned_indices``; where TE is missing, its pure-torch equivalent
  (:mod:`megatron_ring.megatron.data.token_order`) is put where they look it up.
* Megatron's Mamba-2 and Gated-DeltaNet layers (HybridModel ``M`` / ``G``) need ``mamba_ssm``,
  ``causal_conv1d`` / flash-linear-attention (CUDA / Triton kernels): where those are missing,
  :mod:`.ssm` binds pure-torch kernels of the same math (:mod:`.ssm_kernels`) for the scope.

:func:`enable_cpu_support` replaces exactly these with CPU equivalents and :func:`disable_cpu_support`
puts the originals back; :func:`megatron_cpu` is the context-manager form. Nothing is patched at import
time. Calls nest (a counter), so a library and its caller may both opt in. Every replacement goes through the
lab's patch ledger (:mod:`megatron_ring_lab.patches`, owners ``cpu.core``, ``cpu.thd_partitioner``, ``cpu.ssm``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import threading
from functools import reduce
from typing import Callable, Iterator

import torch

from megatron_ring import get_layout
from megatron_ring_lab import patches

__all__ = ["enable_cpu_support", "disable_cpu_support", "megatron_cpu", "cpu_support_enabled"]

_lock = threading.Lock()
_depth = 0
_scope: patches.Scope | None = None


# ----------------------------------------------------------------------------------------------
# CPU replacements
# ----------------------------------------------------------------------------------------------
def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None):
    """``GlobalMemoryBuffer.get_tensor`` that allocates on the CPU."""
    required_len = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """``get_default_causal_mask`` on the CPU: ``[sq, sq]`` bool, True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move of ``inv_freq`` to CUDA. Shape ``[s, 1, 1, dim]``."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _cpu_get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's zigzag slice of a positional embedding, with the index built on ``pos_emb.device``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    pos = get_layout("zigzag").positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank())
    return pos_emb.index_select(seq_dim, pos.to(pos_emb.device))


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The Megatron RNG tracker, but forking the CPU default generator instead of CUDA's."""

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


# ----------------------------------------------------------------------------------------------
# enable / disable
# ----------------------------------------------------------------------------------------------
def _apply(scope: patches.Scope) -> None:
    from megatron.core import utils as mutils
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mrandom

    scope.apply(mutils.GlobalMemoryBuffer, "get_tensor", _cpu_get_tensor)
    scope.apply(tutils, "get_default_causal_mask", _cpu_default_causal_mask)
    scope.apply(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)
    scope.apply(rotary_pos_embedding.RotaryEmbedding, "get_emb", _cpu_get_emb)
    scope.apply(rope_utils, "get_pos_emb_on_this_cp_rank", _cpu_get_pos_emb_on_this_cp_rank)
    scope.apply(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", _cpu_get_pos_emb_on_this_cp_rank)
    try:
        yarn = importlib.import_module("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
        scope.apply(yarn, "get_pos_emb_on_this_cp_rank", _cpu_get_pos_emb_on_this_cp_rank)
    except ImportError:  # pragma: no cover - optional module
        pass
    # packed THD at CP > 1 (Megatron's batch split, Mamba's undo): TE's partitioner in pure torch where TE is missing
    from megatron_ring.megatron.data.token_order import install_thd_partitioner

    install_thd_partitioner(scope.patcher("cpu.thd_partitioner"))
    from megatron_ring_lab.cpu import ssm

    ssm.install(scope.patcher("cpu.ssm"))  # Mamba-2 / GDN kernels where mamba_ssm / causal_conv1d / FLA are missing
    scope.apply(mrandom, "CudaRNGStatesTracker", _make_cpu_tracker_class())
    # Megatron's tracker state, held by the ledger (restored on exit); Megatron then builds a (CPU) tracker there
    scope.apply(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    scope.apply(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    mrandom.initialize_rng_tracker()


def enable_cpu_support() -> None:
    """Patch megatron-core's CUDA-only calls with CPU versions (nestable; undo with :func:`disable_cpu_support`).

    Also replaces the RNG tracker with a CPU one, so call it before
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``. Where a replacement fails, those made are undone.
    """
    global _depth, _scope
    with _lock:
        if _depth == 0:
            scope = patches.Scope("cpu.core")
            try:
                _apply(scope)
            except BaseException:
                scope.restore()
                raise
            _scope = scope
        _depth += 1


def disable_cpu_support() -> None:
    """Undo one :func:`enable_cpu_support`; the last one restores every original."""
    global _depth, _scope
    with _lock:
        if _depth == 0:
            raise RuntimeError("disable_cpu_support() called without a matching enable_cpu_support()")
        _depth -= 1
        if _depth == 0 and _scope is not None:
            _scope.restore()
            _scope = None


def cpu_support_enabled() -> bool:
    """Whether the CPU opt-in is currently active."""
    return _depth > 0


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """``with megatron_cpu(): ...`` runs megatron-core on CPU/gloo inside the block only."""
    enable_cpu_support()
    try:
        yield
    finally:
        disable_cpu_support()
