"""Every error a user of megatron_ring may catch, in one place (also exported by ``megatron_ring``).

Bad input (fix the call): :class:`ValueError` subclasses -- :class:`RingInputError` (another rank's input
was refused; that rank raised the detailed error), :class:`WireFiniteError` (K/V with inf/NaN for a
checking wire codec), :class:`HeadSplitError` (the all-to-all comm types cannot split the query heads
over their group: fewer heads than ranks). A failed or silent peer (fix the job): :class:`RingPeerError`, a :class:`RuntimeError`;
:class:`RingOutOfStepError`, one of them, where this rank left a ring in its middle (an error raised between its
exchanges) and the ring's messages can no longer be matched to the calls that sent them.
Plain ``ValueError`` / ``TypeError`` name the argument to change for local checks.
"""
from __future__ import annotations

__all__ = ["RingInputError", "WireFiniteError", "RingPeerError", "RingOutOfStepError", "HeadSplitError"]


class RingInputError(ValueError):
    """Another rank of the ring rejected its input; it raised the detailed error."""


class WireFiniteError(ValueError):
    """K or V handed to a checking wire codec holds inf or NaN (see ``docs/numerics.md``)."""


class HeadSplitError(ValueError):
    """``a2a`` / ``a2a+p2p`` cannot split the query heads over the all-to-all group: fewer heads than ranks
    (docs/strategies.md, "Heads"); use another comm type or a smaller inner group."""


class RingPeerError(RuntimeError):
    """A ring neighbour failed, vanished or did not answer in time."""


class RingOutOfStepError(RingPeerError):
    """An earlier call on this ring raised in the middle of a ring (after its first exchange, before its last
    one completed): its neighbours may hold messages it never received, or wait for ones it never sent, which a
    later call would take as its own K/V. Every later call on the ring raises this instead; recreate the
    context-parallel process group (or restart the job)."""
