"""Command-line arguments for context parallelism, safe to add to Megatron-LM's parser.

Megatron-LM already defines ``--context-parallel-size``, ``--cp-comm-type`` and
``--hierarchical-context-parallel-sizes``; :func:`add_context_parallel_args` adds only what the parser
lacks (same names, types and defaults as Megatron-LM), plus this plugin's ``--cp-comm-dtype`` and
``--cp-layout``. Use it directly or as (part of) Megatron-LM's ``extra_args_provider``.
"""
from __future__ import annotations

import argparse
from typing import Any

from megatron_ring import LAYOUTS

from megatron_ring.megatron.config import COMM_DTYPES, RingConfig

__all__ = ["add_context_parallel_args", "config_from_args"]


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions  # argparse keeps every registered option string here


def add_context_parallel_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the context-parallel flags the parser does not have yet; returns the parser.

    Flags: ``--context-parallel-size``, ``--cp-comm-type``, ``--cp-comm-dtype`` (a key of ``megatron_ring.COMM_DTYPE_ALIASES``),
    ``--cp-layout {zigzag,striped,contiguous}``, ``--hierarchical-context-parallel-sizes``,
    ``--cp-timeout-seconds``.
    """
    group = parser.add_argument_group("context parallelism (megatron_ring)")
    if not _has(parser, "--context-parallel-size"):
        group.add_argument("--context-parallel-size", type=int, default=1,
                           help="Ranks each sequence is split over (ring attention).")
    if not _has(parser, "--cp-comm-type"):
        group.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                           help="Communication type for context parallelism, one value or one per layer: "
                                "p2p (ring), all_gather (also spelled allgather), a2a (Ulysses), a2a+p2p (a2a inside "
                                "--hierarchical-context-parallel-sizes' inner group, ring across), auto.")
    if not _has(parser, "--cp-comm-dtype"):
        group.add_argument("--cp-comm-dtype", type=str, default="none", choices=list(COMM_DTYPES),
                           help="Wire format of K/V blocks on the ring: none (as computed), fp32, bf16, fp16, "
                                "fp8 (e4m3 with scales), fp8_e5m2, or another spelling of "
                                "megatron_ring.COMM_DTYPE_ALIASES.")
    if not _has(parser, "--cp-layout"):
        group.add_argument("--cp-layout", type=str, default="zigzag", choices=sorted(LAYOUTS),
                           help="How a sequence is split over the CP ranks: zigzag (2*CP chunks, balanced "
                                "causal work), striped (token i on rank i %% CP) or contiguous.")
    if not _has(parser, "--hierarchical-context-parallel-sizes"):
        group.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                           help="Sub-ring sizes, innermost first (e.g. '4 2': rings of 4 inside a node, "
                                "2 across nodes); product must equal --context-parallel-size.")
    if not _has(parser, "--cp-timeout-seconds"):
        group.add_argument("--cp-timeout-seconds", type=float, default=None,
                           help="Seconds a ring exchange waits for a peer before failing with a message "
                                "naming the lost rank (default: env MEGATRON_RING_TIMEOUT_S, else the CP "
                                "group's timeout).")
    return parser


def config_from_args(args: Any, *, validate: bool = True, world_size: int | None = None) -> RingConfig:
    """The validated :class:`RingConfig` for parsed ``args`` (see :meth:`RingConfig.from_args`)."""
    return RingConfig.from_args(args, validate=validate, world_size=world_size)
