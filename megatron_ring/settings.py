"""Every ``MEGATRON_RING_*`` environment variable, read and validated here and nowhere else.

A variable is read when its function is called, not at import (a job, or a test, may set one between
calls); a callee that needs the value per call resolves it once and keeps it (the Megatron glue per layer).
A bad value raises :class:`SettingError` (a ``ValueError``) naming the variable and what it accepts.

==================================== ===================================================== ================
variable                             meaning (default)                                     read by
==================================== ===================================================== ================
``MEGATRON_RING_TIMEOUT_S``          seconds a ring exchange waits for a peer (the         ring_attention
                                     group's timeout)
``MEGATRON_RING_KV_PIECES``          K/V pieces per ring step, a positive integer          ring_attention
                                     (automatic)
``MEGATRON_RING_COMM_DTYPE``         K/V wire format: a key of ``COMM_DTYPE_ALIASES``      Megatron glue
                                     (``none``)
``MEGATRON_RING_CP_COMM_TYPE``       comm type, one or one per layer, comma or space       Megatron glue
                                     separated; ``allgather`` reads as ``all_gather``; for
                                     model configs without one (stock Megatron-LM: pass
                                     ``--cp-comm-type``) (``p2p``)
``MEGATRON_RING_LAYOUT``             ``zigzag`` only with a stock script, whose batch      Megatron glue
                                     split is Megatron's (``zigzag``)
``MEGATRON_RING_MTP_CP_INVARIANT``   ``1``: MTP loss weighted at CP > 1 as at CP=1 (``0``) Megatron glue
``MEGATRON_RING_FLOPS`` ...          the machine numbers of ``comm_type="auto"``           auto
                                     (``MACHINE_VARIABLES``; probed)
``MEGATRON_RING_AUTO_*``             ``auto``'s measured tie-break (``AUTO_MEASURE=0``:    auto
                                     off; ``BAND``, ``MEASURE_MIN_S``, ...)
``MEGATRON_RING_GPUS_PER_NODE``      ranks per node in ``auto``'s machine model, a         auto
                                     positive int (unset)
``MEGATRON_RING_OVERLAP``            the fraction of a transfer ``auto`` counts as hidden  auto
                                     behind compute, 0 to 1 (unset: none on CPU, full on
                                     GPUs)
``MEGATRON_RING_START_METHOD``       the lab's launcher: ``forkserver`` or ``spawn``       the lab
``MEGATRON_RING_PRELOAD``            modules the launcher's fork server imports once       the lab
``MEGATRON_RING_DOCTOR_OUT``         the folder a doctor run writes its record to (set by  the lab
                                     ``python -m megatron_ring_lab.doctor``)
``MEGATRON_RING_DYNAMIC_DOCS`` ...   the ``--dynamic-cp`` benchmark's mix: documents,      the lab
                                     length scale, seed (``_SCALE``, ``_SEED``; 64, 16, 0)
==================================== ===================================================== ================

The Megatron glue's variables are read only when no ring was registered with ``initialize_context_parallel``
(stock ``pretrain_gpt.py`` with ``--spec``, Megatron-Bridge with ``ring_spec``): a registered ring's settings win.
"""
from __future__ import annotations

import os

__all__ = ["SettingError", "timeout_s", "kv_pieces", "comm_dtype", "cp_comm_type", "layout", "mtp_cp_invariant",
           "machine_numbers", "gpus_per_node", "overlap", "auto_measure", "auto_number", "start_method", "preload",
           "doctor_out", "dynamic_mix", "DOCTOR_OUT", "MACHINE_VARIABLES", "AUTO_VARIABLES"]


class SettingError(ValueError):
    """A ``MEGATRON_RING_*`` variable holds a value its reader does not accept (``.variable`` names it)."""

    def __init__(self, variable: str, accepts: str, value: str):
        self.variable, self.detail = variable, f"must be {accepts}, got {value!r}"
        super().__init__(f"{variable} {self.detail}")


def _raw(variable: str) -> str | None:
    value = os.environ.get(variable)
    return value.strip() if value is not None and value.strip() else None


def _float(variable: str, accepts: str = "a number") -> float | None:
    value = _raw(variable)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise SettingError(variable, accepts, value) from None


def _positive_int(variable: str) -> int | None:
    value = _raw(variable)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SettingError(variable, "a positive integer", value)
    return int(value)


def timeout_s() -> float | None:
    """``MEGATRON_RING_TIMEOUT_S``: seconds, or None (the group's timeout)."""
    return _float("MEGATRON_RING_TIMEOUT_S", "a number of seconds")


def kv_pieces() -> int | None:
    """``MEGATRON_RING_KV_PIECES``: a positive int, or None (the library chooses)."""
    return _positive_int("MEGATRON_RING_KV_PIECES")


def comm_dtype() -> str | None:
    """``MEGATRON_RING_COMM_DTYPE`` as written (the glue's ``RingConfig`` validates it)."""
    return _raw("MEGATRON_RING_COMM_DTYPE")


def cp_comm_type() -> tuple[str, ...] | None:
    """``MEGATRON_RING_CP_COMM_TYPE``: the comm types it lists (comma or space separated), or None."""
    value = _raw("MEGATRON_RING_CP_COMM_TYPE")
    return None if value is None else tuple(x for x in value.replace(",", " ").split() if x)


def layout() -> str | None:
    """``MEGATRON_RING_LAYOUT`` as written (the glue's ``RingConfig`` validates it)."""
    return _raw("MEGATRON_RING_LAYOUT")


def mtp_cp_invariant() -> bool:
    """``MEGATRON_RING_MTP_CP_INVARIANT``: 1/0, true/false, yes/no, on/off (unset: False)."""
    value = (_raw("MEGATRON_RING_MTP_CP_INVARIANT") or "").lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise SettingError("MEGATRON_RING_MTP_CP_INVARIANT", "1 or 0 (true/false)", value)


#: ``auto``'s machine numbers: Machine field -> variable
MACHINE_VARIABLES = {"flops": "MEGATRON_RING_FLOPS", "bwd_flops": "MEGATRON_RING_BWD_FLOPS",
                     "bw_intra": "MEGATRON_RING_BANDWIDTH", "bw_inter": "MEGATRON_RING_INTER_BANDWIDTH",
                     "latency": "MEGATRON_RING_LATENCY_S", "call_overhead": "MEGATRON_RING_CALL_OVERHEAD_S"}
#: ``auto``'s measured tie-break: setting -> variable
AUTO_VARIABLES = {"BAND": "MEGATRON_RING_AUTO_BAND", "MEASURE_MIN_S": "MEGATRON_RING_AUTO_MEASURE_MIN_S",
                  "MEASURE_BUDGET_S": "MEGATRON_RING_AUTO_MEASURE_BUDGET_S",
                  "MEASURE_ROUNDS": "MEGATRON_RING_AUTO_MEASURE_ROUNDS"}


def auto_inputs() -> tuple[tuple[str, str], ...]:
    """What ``comm_type="auto"`` reads from the environment and the ranks of a group must agree on (the call's
    cross-rank check compares it), or they would probe and choose differently: WHICH machine numbers are set
    (a rank with all six skips the probe; their values may differ, they are agreed by MIN/MAX), and the values of
    the settings that are not agreed (nodes, overlap, the measured tie-break). Unset ones are left out."""
    machine = tuple((name, "set") for name in MACHINE_VARIABLES.values() if _raw(name) is not None)
    names = (*AUTO_VARIABLES.values(), "MEGATRON_RING_GPUS_PER_NODE", "MEGATRON_RING_OVERLAP",
             "MEGATRON_RING_AUTO_MEASURE")
    return machine + tuple((name, _raw(name)) for name in names if _raw(name) is not None)


def machine_numbers() -> dict[str, float]:
    """The machine numbers the environment gives (``MACHINE_VARIABLES``; the unset ones left out)."""
    numbers = {name: _float(variable) for name, variable in MACHINE_VARIABLES.items()}
    return {name: x for name, x in numbers.items() if x is not None}


def gpus_per_node() -> int | None:
    """``MEGATRON_RING_GPUS_PER_NODE``: a positive int, or None."""
    return _positive_int("MEGATRON_RING_GPUS_PER_NODE")


def overlap() -> float | None:
    """``MEGATRON_RING_OVERLAP``: the fraction of a transfer hidden behind compute, or None (by device)."""
    return _float("MEGATRON_RING_OVERLAP", "a number between 0 and 1")


def auto_measure() -> bool:
    """``MEGATRON_RING_AUTO_MEASURE``: ``0`` turns ``auto``'s measured tie-break off."""
    return _raw("MEGATRON_RING_AUTO_MEASURE") != "0"


def auto_number(name: str, default: float) -> float:
    """One of ``auto``'s tie-break numbers (``AUTO_VARIABLES``), or ``default`` where unset."""
    value = _float(AUTO_VARIABLES[name])
    return default if value is None else value


def start_method() -> str | None:
    """``MEGATRON_RING_START_METHOD`` (the lab's launcher): ``forkserver``, ``spawn``, or None (its default)."""
    value = _raw("MEGATRON_RING_START_METHOD")
    if value not in (None, "forkserver", "spawn"):
        raise SettingError("MEGATRON_RING_START_METHOD", "forkserver or spawn", value)
    return value


def preload() -> list[str]:
    """``MEGATRON_RING_PRELOAD`` (the lab's launcher): the modules its fork server imports once."""
    return [m for m in (_raw("MEGATRON_RING_PRELOAD") or "").split(",") if m.strip()]


#: the doctor's record folder: set by ``python -m megatron_ring_lab.doctor`` for the script it runs
DOCTOR_OUT = "MEGATRON_RING_DOCTOR_OUT"


def doctor_out() -> str | None:
    """``MEGATRON_RING_DOCTOR_OUT`` (the lab's doctor): the folder a run writes its record to, or None."""
    return _raw(DOCTOR_OUT)


def dynamic_mix() -> tuple[int, int, int]:
    """``MEGATRON_RING_DYNAMIC_DOCS`` / ``_SCALE`` / ``_SEED`` (the lab's ``--dynamic-cp`` benchmark): its
    documents, length scale and seed (default 64, 16, 0)."""
    docs = _positive_int("MEGATRON_RING_DYNAMIC_DOCS")
    scale = _positive_int("MEGATRON_RING_DYNAMIC_SCALE")
    seed = _raw("MEGATRON_RING_DYNAMIC_SEED")
    if seed is not None and not seed.isdigit():
        raise SettingError("MEGATRON_RING_DYNAMIC_SEED", "a non-negative integer", seed)
    return (64 if docs is None else docs, 16 if scale is None else scale, 0 if seed is None else int(seed))
