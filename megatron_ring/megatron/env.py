"""The ``MEGATRON_RING_*`` environment variables: ring options a stock Megatron-LM script cannot pass as flags.

Read when no ring was registered with :func:`~megatron_ring.megatron.groups.provider.initialize_context_parallel`
(stock ``pretrain_gpt.py`` with ``--spec megatron_ring.megatron.spec ring_layer_spec``, Megatron-Bridge with
:func:`~megatron_ring.megatron.spec.ring_spec`). A registered ring's settings win over the environment.

================================== ======================================================== ==================
variable                           meaning                                                  default
================================== ======================================================== ==================
``MEGATRON_RING_COMM_DTYPE``       K/V wire format: any key of ``COMM_DTYPE_ALIASES``       ``none``
``MEGATRON_RING_CP_COMM_TYPE``     comm type (one, or one per layer, comma separated);      Megatron's
                                   ``allgather`` is read as ``all_gather``                  ``--cp-comm-type``
``MEGATRON_RING_TIMEOUT_S``        seconds a ring exchange waits for a peer                 group timeout
``MEGATRON_RING_KV_PIECES``        K/V pieces per ring step (overlap granularity)           automatic
``MEGATRON_RING_LAYOUT``           ``zigzag`` only with a stock script (Megatron's split)   ``zigzag``
``MEGATRON_RING_MTP_CP_INVARIANT`` ``1``: Megatron's MTP loss weighted at CP > 1 as at      ``0``
                                   CP=1 (:mod:`.mtp`)
================================== ======================================================== ==================
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import megatron_ring
from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig, normalize_comm_type

__all__ = ["ENV_VARS", "ring_config_from_env", "kv_pieces_from_env", "mtp_cp_invariant_from_env"]

ENV_VARS = ("MEGATRON_RING_COMM_DTYPE", "MEGATRON_RING_CP_COMM_TYPE", "MEGATRON_RING_TIMEOUT_S",
            "MEGATRON_RING_KV_PIECES", "MEGATRON_RING_LAYOUT", "MEGATRON_RING_MTP_CP_INVARIANT")

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
