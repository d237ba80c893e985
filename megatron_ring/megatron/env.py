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

import os
from typing import Any

from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig, normalize_comm_type

__all__ = ["ENV_VARS", "ring_config_from_env", "kv_pieces_from_env"]

ENV_VARS = ("MEGATRON_RING_COMM_DTYPE", "MEGATRON_RING_CP_COMM_TYPE", "MEGATRON_RING_TIMEOUT_S",
            "MEGATRON_RING_KV_PIECES", "MEGATRON_RING_LAYOUT", "MEGATRON_RING_MTP_CP_INVARIANT")

def _get(name: str) -> str | None:
    raw = os.environ.get(name)
    return raw.strip() if raw is not None and raw.strip() else None


def ring_config_from_env(context_parallel_size: int = 1) -> RingConfig:
    """The :class:`RingConfig` the environment describes (errors name the variable to fix)."""
    kwargs: dict[str, Any] = {"context_parallel_size": max(1, int(context_parallel_size or 1))}
    if (v := _get("MEGATRON_RING_COMM_DTYPE")) is not None:
        kwargs["comm_dtype"] = v
    if (v := _get("MEGATRON_RING_LAYOUT")) is not None:
        kwargs["layout"] = v
    if (v := _get("MEGATRON_RING_CP_COMM_TYPE")) is not None:
        kwargs["cp_comm_type"] = normalize_comm_type(tuple(x for x in v.replace(",", " ").split() if x))
    if (v := _get("MEGATRON_RING_TIMEOUT_S")) is not None:
        try:
            kwargs["timeout_s"] = float(v)
        except ValueError:
            raise ContextParallelConfigError("MEGATRON_RING_TIMEOUT_S", f"must be a number of seconds, got {v!r}") \
                from None
    try:
        return RingConfig(**kwargs)
    except ContextParallelConfigError as e:
        env = {"--cp-comm-dtype": "MEGATRON_RING_COMM_DTYPE", "--cp-layout": "MEGATRON_RING_LAYOUT",
               "--cp-comm-type": "MEGATRON_RING_CP_COMM_TYPE",
               "--cp-timeout-seconds": "MEGATRON_RING_TIMEOUT_S"}.get(e.flag, e.flag)
        raise ContextParallelConfigError(env, str(e).split(": ", 1)[-1]) from None


def kv_pieces_from_env() -> int | None:
    """``MEGATRON_RING_KV_PIECES`` (a positive int) or None (the library chooses)."""
    v = _get("MEGATRON_RING_KV_PIECES")
    if v is None:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ContextParallelConfigError("MEGATRON_RING_KV_PIECES", f"must be a positive integer, got {v!r}")
    return int(v)
