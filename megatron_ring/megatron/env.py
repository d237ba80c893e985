"""The ``MEGATRON_RING_*`` environment variables: ring options a stock Megatron-LM script cannot pass as flags.

Read when no ring was registered with :func:`~megatron_ring.megatron.groups.provider.initialize_context_parallel`
(stock ``pretrain_gpt.py`` with ``--spec megatron_ring.megatron.spec ring_layer_spec``, Megatron-Bridge with
:func:`~megatron_ring.megatron.spec.ring_spec`). A registered ring's settings win over the environment.

The variables, their meaning and defaults are listed once, in :mod:`megatron_ring.settings` (which reads and
validates them); here a bad value becomes a :class:`ContextParallelConfigError` naming the variable.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import megatron_ring
from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig, normalize_comm_type

__all__ = ["ring_config_from_env", "kv_pieces_from_env", "mtp_cp_invariant_from_env"]



@contextlib.contextmanager
def _named() -> Iterator[None]:
    """A bad variable (``megatron_ring.settings``) as the glue's configuration error, naming the variable."""
    try:
        yield
    except megatron_ring.settings.SettingError as e:
        raise ContextParallelConfigError(e.variable, e.detail) from None


def ring_config_from_env(context_parallel_size: int = 1) -> RingConfig:
    """The :class:`RingConfig` the environment describes (errors name the variable to fix)."""
    settings = megatron_ring.settings
    kwargs: dict[str, Any] = {"context_parallel_size": max(1, int(context_parallel_size or 1))}
    with _named():
        read = {"comm_dtype": settings.comm_dtype(), "layout": settings.layout(),
                "cp_comm_type": settings.cp_comm_type(), "timeout_s": settings.timeout_s()}
    kwargs.update({name: value for name, value in read.items() if value is not None})
    if "cp_comm_type" in kwargs:
        kwargs["cp_comm_type"] = normalize_comm_type(kwargs["cp_comm_type"])
    try:
        return RingConfig(**kwargs)
    except ContextParallelConfigError as e:
        env = {"--cp-comm-dtype": "MEGATRON_RING_COMM_DTYPE", "--cp-layout": "MEGATRON_RING_LAYOUT",
               "--cp-comm-type": "MEGATRON_RING_CP_COMM_TYPE",
               "--cp-timeout-seconds": "MEGATRON_RING_TIMEOUT_S"}.get(e.flag, e.flag)
        raise ContextParallelConfigError(env, str(e).split(": ", 1)[-1]) from None


def kv_pieces_from_env() -> int | None:
    """``MEGATRON_RING_KV_PIECES`` (a positive int) or None (the library chooses)."""
    with _named():
        return megatron_ring.settings.kv_pieces()


def mtp_cp_invariant_from_env() -> bool:
    """``MEGATRON_RING_MTP_CP_INVARIANT`` (1/0): whether the MTP loss is weighted at CP > 1 as at CP=1."""
    with _named():
        return megatron_ring.settings.mtp_cp_invariant()
