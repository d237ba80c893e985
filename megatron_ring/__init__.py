"""megatron_ring: exact context-parallel (ring) attention for Megatron-style training stacks.

Public face (no Megatron import): :func:`ring_attention`, :func:`shard_sequence`, :func:`gather_sequence`,
:func:`to_device` (a host tensor on the device without making the host wait: the glue's copies),
the layouts, the errors a caller may catch, and the tables of accepted comm types and wire dtypes.
Megatron-Core glue lives in :mod:`megatron_ring.megatron`. The lab (CPU harness, CP doctor, benchmark, planner,
launcher) is a distribution of its own, ``megatron_ring_lab`` (``lab/`` in a checkout); nothing here imports it.
"""
from megatron_ring import settings
from megatron_ring.api import ring_attention
from megatron_ring.device import to_device
from megatron_ring.errors import HeadSplitError, RingInputError, RingOutOfStepError, RingPeerError, WireFiniteError
from megatron_ring.kernels.block import set_deterministic
from megatron_ring.schedules.layouts import LAYOUTS, get_layout
from megatron_ring.schedules.masks import DocumentZigzag
from megatron_ring.sequence import gather_sequence, shard_sequence
from megatron_ring.strategies import COMM_TYPES
from megatron_ring.planning.cost_model import Machine, Problem
from megatron_ring.planning import dynamic_cp as _dynamic_cp
from megatron_ring.planning.dynamic_cp import SubSample, schedule_dynamic_cp, schedule_megatron_balanced
from megatron_ring.wire.codecs import COMM_DTYPE_ALIASES

__version__ = "0.1.0"
__all__ = ["ring_attention", "settings", "shard_sequence", "gather_sequence", "get_layout", "LAYOUTS", "DocumentZigzag",
           "set_deterministic", "to_device",
           "COMM_TYPES", "COMM_DTYPE_ALIASES", "RingPeerError", "RingOutOfStepError", "RingInputError", "WireFiniteError",
           "HeadSplitError",
           "schedule_dynamic_cp", "schedule_megatron_balanced", "SubSample", "Machine", "Problem"]


def __getattr__(name: str):
    """``megatron_ring.Schedule``: the dynamic-CP schedule's old name on the face, kept for one release."""
    if name == "Schedule":
        import warnings
        warnings.warn("megatron_ring.Schedule is deprecated: the dynamic-CP schedule is "
                      "megatron_ring.planning.dynamic_cp.DynamicCPSchedule (CHANGELOG.md)", DeprecationWarning, stacklevel=2)
        return _dynamic_cp.DynamicCPSchedule
    raise AttributeError(f"module 'megatron_ring' has no attribute {name!r}")
