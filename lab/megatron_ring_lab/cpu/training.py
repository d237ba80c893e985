"""Scoped CPU opt-in for Megatron-LM's own training loop (``megatron.training``: ``pretrain()``).

Megatron's loop assumes CUDA in about thirty places (``device='cuda'`` tensors, ``torch.cuda.*`` timers,
streams and memory queries, ``'torch.cuda.FloatTensor'`` type checks in the optimizers and clip_grads,
distributed/model-parallel set-up and RNG seeding only when ``device_count() > 0``, a JIT warm-up on
CUDA, ``compile_helpers()`` running ``make``). :func:`megatron_training_cpu` makes that loop run on the
CPU with gloo, for CI and laptops, inside a ``with`` block only:

* :data:`REPLACED` lists every function it replaces (module, attribute), each recorded in the lab's patch ledger
  (:mod:`megatron_ring_lab.patches`, owner ``cpu.training``); all are restored on exit, also on an exception;
* a :class:`torch.overrides.TorchFunctionMode` maps ``device='cuda'`` / ``.cuda()`` / ``.to('cuda')`` to
  the CPU and makes ``Tensor.type()`` report the CUDA type names Megatron compares against;
* it also enters :func:`~megatron_ring_lab.cpu.core.megatron_cpu` (megatron-core's own CUDA spots);
* it refuses to start where CUDA is available: on GPUs Megatron's loop runs unchanged.

Run with ``--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
--transformer-impl local --rerun-mode disabled`` (see examples/pretrain_ring_gpt.py).
"""
from __future__ import annotations

import contextlib
import functools
import types
import importlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_ring.megatron import compat
from megatron_ring_lab import patches
from megatron_ring_lab.cpu.core import megatron_cpu

__all__ = ["megatron_training_cpu", "REPLACED", "training_cpu_enabled"]


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> "_CpuEvent":
        return event or _CpuEvent()

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _CpuEvent:
    """Stands in for ``torch.cuda.Event`` (timing through ``time.perf_counter``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.t = 0.0

    def record(self, *args: Any) -> None:
        import time

        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end.t - self.t) * 1e3


def _stand_in(name: str, result: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object standing in for ``torch.cuda.<name>``: every replaced attribute gets its own, since
    dynamo keeps one trace rule per torch object and asserts on one object found under several names
    ("Duplicate torch object ... with different rules", met by Megatron's compiled MoE router)."""
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return result(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = f"cpu_{name}"
    return stand_in


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _peak_rss_bytes(*args: Any, **kwargs: Any) -> int:
    """Peak resident memory of this process (what Megatron's memory report shows on CPU)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


_DEVICE_COUNT_ONE = _stand_in("device_count", lambda *a, **k: 1)
_SET_DEVICE = _stand_in("set_device", _nothing)


def _one_device() -> list[tuple[Any, str, Any]]:
    return [(torch.cuda, "device_count", _DEVICE_COUNT_ONE), (torch.cuda, "set_device", _SET_DEVICE)]


def _with_one_device(fn: Callable) -> Callable:
    """Run ``fn`` with ``torch.cuda.device_count() == 1`` so Megatron builds its model-parallel groups and
    seeds its RNG tracker (both skipped when no device is seen); ``set_device`` is a no-op then."""
    return patches.during(fn, "cpu.training", _one_device)


def _allow_no_cuda(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return fn(*args, **kwargs)
    return wrapper


class _ChunkView:
    """An fp32 model chunk as Megatron's ``clip_qk`` walks it: ``chunk.module.module`` is the model (it assumes
    DDP around the bf16/fp16 wrapper, which an fp32 run does not build)."""

    def __init__(self, model: Any) -> None:
        self.module = types.SimpleNamespace(module=model)


def _clip_qk_any_precision(fn: Callable) -> Callable:
    """Megatron's own ``clip_qk`` (reduce, clip, reset unchanged), handed fp32 chunks the way it walks them: in an
    fp32 run ``chunk.module`` is the model itself and ``chunk.module.module`` raised AttributeError after the first
    optimizer step, whatever the attention (a Megatron-LM bug of every line up to main, not a CPU gap: on GPUs
    fp32 runs with --qk-clip fail the same way). bf16/fp16 chunks pass through as they are."""
    @functools.wraps(fn)
    def clip_qk(model: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = [c if hasattr(c.module, "module") else _ChunkView(c.module) for c in model]
        return fn(chunks, *args, **kwargs)
    return clip_qk


def _cpu_stream_context(stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


#: torch.cuda functions replaced in the scope: name -> what the stand-in returns (each a distinct function)
_TORCH_CUDA_RESULTS: dict[str, Callable[..., Any]] = {
    "synchronize": _nothing, "current_device": _zero,
    "current_stream": lambda *a, **k: _CpuStream(), "default_stream": lambda *a, **k: _CpuStream(),
    "stream": _cpu_stream_context, "set_stream": _nothing, "empty_cache": _nothing,
    "memory_allocated": _zero, "max_memory_allocated": _peak_rss_bytes, "memory_reserved": _zero,
    "max_memory_reserved": _peak_rss_bytes, "reset_peak_memory_stats": _nothing,
    "reset_max_memory_allocated": _nothing, "memory_stats": lambda *a, **k: {}, "manual_seed": _nothing,
    "manual_seed_all": _nothing, "ipc_collect": _nothing,
    # checkpoints save/restore the "CUDA" generator next to the RNG tracker states: on CPU, the CPU one
    "get_rng_state": _cpu_get_rng_state, "set_rng_state": _cpu_set_rng_state,
}
_TORCH_CUDA: dict[str, Any] = {"Stream": _CpuStream, "Event": _CpuEvent,
                               **{n: _stand_in(n, r) for n, r in _TORCH_CUDA_RESULTS.items()}}

#: megatron.training functions replaced in the scope: (module, attribute) -> wrapper factory / replacement
_MEGATRON = {
    ("megatron.training.training", "initialize_megatron"): _allow_no_cuda,   # asserts CUDA otherwise
    ("megatron.training.initialize", "_initialize_distributed"): _with_one_device,  # groups only if GPUs
    ("megatron.training.initialize", "_set_random_seed"): _with_one_device,  # RNG tracker only if GPUs
    ("megatron.training.initialize", "_compile_dependencies"): lambda fn: _nothing,  # runs `make`, CUDA kernels
    ("megatron.training.training", "set_jit_fusion_options"): lambda fn: _nothing,  # JIT warm-up on CUDA
    ("megatron.training.arguments", "get_device_arch_version"): lambda fn: _zero,  # CUDA query, TP/CP > 1
    # --qk-clip / --log-max-attention-logit ask for TE >= 2.9 (max logits): the ring's spec answers it (compat)
    ("megatron.training.arguments", "is_te_min_version"): compat.qk_clip_te_check,
    # Megatron's clip_qk walks chunk.module.module (DDP, then the bf16/fp16 wrapper): fp32 runs give it that shape
    ("megatron.training.training", "clip_qk"): _clip_qk_any_precision,
    # activation recompute saves/restores the "CUDA" RNG state: on CPU that is the CPU generator
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): lambda fn: _cpu_get_rng_state,
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): lambda fn: _cpu_set_rng_state,
}

#: every (module, attribute) the opt-in replaces, for the test and the docs
REPLACED: tuple[tuple[str, str], ...] = tuple(
    [("torch.cuda", n) for n in _TORCH_CUDA] + list(_MEGATRON))


def _to_cpu(dev: Any) -> Any:
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, int) and not isinstance(dev, bool):  # a bare CUDA ordinal
        return "cpu"
    return dev


_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
              "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor", "torch.IntTensor": "torch.cuda.IntTensor",
              "torch.LongTensor": "torch.cuda.LongTensor", "torch.ByteTensor": "torch.cuda.ByteTensor"}


class _CudaToCpu(TorchFunctionMode):
    """``device='cuda'`` -> CPU, ``.cuda()`` -> no move, ``pin_memory`` -> no-op, ``Tensor.type()`` -> CUDA names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE.get(name, name)
        if func is torch.Tensor.to and len(args) > 1:  # to(device, ...) / to(device, dtype, ...)
            args = (args[0], _to_cpu(args[1]), *args[2:])
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


_lock = threading.Lock()
_active = False


def training_cpu_enabled() -> bool:
    return _active


@contextlib.contextmanager
def megatron_training_cpu() -> Iterator[None]:
    """``with megatron_training_cpu(): pretrain(...)`` runs Megatron-LM's loop on CPU/gloo; restores all on exit.

    Raises RuntimeError where CUDA is available (use Megatron's loop unchanged there) or when nested.
    """
    global _active
    if torch.cuda.is_available():
        raise RuntimeError("megatron_training_cpu() is a CPU-only opt-in; CUDA is available here, run "
                           "Megatron's training loop unchanged")
    with _lock:
        if _active:
            raise RuntimeError("megatron_training_cpu() is already active")
        _active = True
    try:
        with patches.Scope("cpu.training") as scope:
            for name, new in _TORCH_CUDA.items():
                scope.apply(torch.cuda, name, new)
            for (mod_name, attr), make in _MEGATRON.items():
                mod = importlib.import_module(mod_name)
                scope.apply(mod, attr, make(getattr(mod, attr)))
            with megatron_cpu(), _CudaToCpu():
                yield
    finally:
        with _lock:
            _active = False
