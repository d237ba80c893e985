"""Context-parallel configuration: one validated object built from Megatron-style arguments.

Every check raises :class:`ContextParallelConfigError` whose message names the command-line flag to
change, so a bad launch fails (identically on every rank) before any group or model is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megatron_ring import COMM_DTYPE_ALIASES, COMM_TYPES, LAYOUTS, get_layout

__all__ = [
    "ContextParallelConfigError",
    "RingConfig",
    "refuse_mtp_without_zigzag",
    "normalize_comm_type",
    "COMM_DTYPES",
    "CP_COMM_TYPES",
]

#: ``--cp-comm-dtype`` choices: the package's one table of wire dtypes (every spelling ``ring_attention`` accepts).
COMM_DTYPES: tuple[str, ...] = tuple(COMM_DTYPE_ALIASES)
#: ``--cp-comm-type`` values (Megatron-LM's names, plus "auto"); see docs/strategies.md.
CP_COMM_TYPES: tuple[str, ...] = COMM_TYPES  # the library's one table (megatron_ring.strategies)


#: Megatron-LM's help text spells the all-gather comm type ``allgather``; the ring's name is ``all_gather``.
_SPELLINGS = {"allgather": "all_gather"}


def normalize_comm_type(value: Any) -> Any:
    """``allgather`` -> ``all_gather`` in a string or in each entry of a per-layer list (others as given)."""
    if isinstance(value, str):
        return _SPELLINGS.get(value, value)
    if isinstance(value, (list, tuple)):
        return tuple(_SPELLINGS.get(v, v) if isinstance(v, str) else v for v in value)
    return value


class ContextParallelConfigError(ValueError):
    """An invalid context-parallel setting; ``flag`` is the command-line flag to fix."""

    def __init__(self, flag: str, message: str | None = None):
        if message is None:  # re-raised with one formatted argument (e.g. by Megatron's build_module)
            text = flag
            flag = text.split(":", 1)[0] if text.startswith("--") else ""
        else:
            text = f"{flag}: {message}"
        super().__init__(text)
        self.flag = flag


@dataclass(frozen=True)
class RingConfig:
    """What the ring needs to know; build it with :meth:`from_args` or directly.

    Attributes:
        context_parallel_size: ranks one sequence is split over (``--context-parallel-size``).
        layout: "zigzag", "striped" or "contiguous" (``--cp-layout``).
        comm_dtype: K/V wire format, a key of ``COMM_DTYPE_ALIASES`` ("none", "bf16", "fp8", ...)
            (``--cp-comm-dtype``).
        cp_comm_type: communication type, one for all layers or one per layer: "p2p" (ring),
            "all_gather", "a2a" (Ulysses), "a2a+p2p" (needs two hierarchical sizes) or "auto"
            (``--cp-comm-type``).
        hierarchical_context_parallel_sizes: e.g. ``(intra, inter)`` with product equal to the CP size
            (``--hierarchical-context-parallel-sizes``); builds intra-/inter-node sub-rings.
        timeout_s: seconds a ring exchange may wait for a peer before ``RingPeerError``
            (``--cp-timeout-seconds``; None: ``MEGATRON_RING_TIMEOUT_S``, else the CP group's timeout,
            which Megatron sets from ``--distributed-timeout-minutes``, 30 min by default).
    """

    context_parallel_size: int = 1
    layout: str = "zigzag"
    comm_dtype: str = "none"
    cp_comm_type: tuple[str, ...] = ("p2p",)
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = None
    timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        cct = normalize_comm_type(self.cp_comm_type)  # Megatron's "allgather" spelling is "all_gather"
        object.__setattr__(self, "cp_comm_type", (cct,) if isinstance(cct, str) else tuple(cct or ("p2p",)))
        hcp = self.hierarchical_context_parallel_sizes
        object.__setattr__(self, "hierarchical_context_parallel_sizes", tuple(hcp) if hcp else None)
        self._check_self()

    # ------------------------------------------------------------------------------------------
    @property
    def torch_comm_dtype(self) -> torch.dtype | None:
        """The wire dtype handed to :func:`megatron_ring.ring_attention` (None: send as computed)."""
        return COMM_DTYPE_ALIASES[self.comm_dtype]

    @property
    def seq_multiple(self) -> int:
        """The global sequence length must be a multiple of this."""
        return get_layout(self.layout).local_multiple() * self.context_parallel_size

    def _check_self(self) -> None:
        cp = self.context_parallel_size
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise ContextParallelConfigError("--context-parallel-size", f"must be a positive integer, got {cp!r}")
        if self.layout not in LAYOUTS:
            raise ContextParallelConfigError("--cp-layout", f"unknown layout {self.layout!r}; choose one of "
                                                            f"{sorted(LAYOUTS)}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ContextParallelConfigError("--cp-timeout-seconds", f"must be a positive number of seconds, "
                                                                     f"got {self.timeout_s!r}")
        if self.comm_dtype not in COMM_DTYPES:
            raise ContextParallelConfigError("--cp-comm-dtype", f"unknown wire dtype {self.comm_dtype!r}; "
                                                                f"choose one of {list(COMM_DTYPES)}")
        bad = [t for t in self.cp_comm_type if t not in CP_COMM_TYPES]
        if bad:
            raise ContextParallelConfigError(
                "--cp-comm-type", f"{bad} not supported; use one of {list(CP_COMM_TYPES)} (one value, or one "
                                  "per layer)")
        hcp = self.hierarchical_context_parallel_sizes
        if "a2a+p2p" in self.cp_comm_type and (hcp is None or len(hcp) != 2):
            raise ContextParallelConfigError(
                "--hierarchical-context-parallel-sizes",
                f"--cp-comm-type a2a+p2p needs two sizes (inner a2a group, outer ring), e.g. "
                f"'--hierarchical-context-parallel-sizes 8 {max(1, cp // 8)}' (GPUs per node, nodes); got "
                f"{list(hcp) if hcp else None}")
        if hcp is not None:
            if any((not isinstance(x, int)) or x < 1 for x in hcp):
                raise ContextParallelConfigError("--hierarchical-context-parallel-sizes",
                                                 f"sizes must be positive integers, got {list(hcp)}")
            if math.prod(hcp) != cp:
                raise ContextParallelConfigError(
                    "--hierarchical-context-parallel-sizes",
                    f"product of {list(hcp)} is {math.prod(hcp)} but --context-parallel-size is {cp}")

    def comm_type_for_layer(self, layer_number: int) -> str:
        """The comm type of (1-based, global) ``layer_number``: the single value, or the per-layer entry."""
        types = self.cp_comm_type
        if len(types) == 1:
            return types[0]
        if not 1 <= layer_number <= len(types):
            raise ContextParallelConfigError(
                "--cp-comm-type", f"the ring config (MEGATRON_RING_CP_COMM_TYPE, or the RingConfig given to "
                                  f"initialize_context_parallel) has {len(types)} per-layer values but layer "
                                  f"number {layer_number}; give one value or one per layer (--num-layers)")
        return types[layer_number - 1]

    def validate(self, *, world_size: int | None = None, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, seq_length: int | None = None,
                 attention_dropout: float | None = None, num_layers: int | None = None,
                 mtp_num_layers: int | None = None) -> "RingConfig":
        """Check the settings against the job; returns ``self`` so calls chain.

        Raises:
            ContextParallelConfigError: naming the flag to change.
        """
        cp = self.context_parallel_size
        if world_size is not None:
            model = tensor_model_parallel_size * pipeline_model_parallel_size * cp
            if world_size % model:
                raise ContextParallelConfigError(
                    "--context-parallel-size",
                    f"world size {world_size} is not divisible by tensor ({tensor_model_parallel_size}) x "
                    f"pipeline ({pipeline_model_parallel_size}) x context ({cp}) parallel sizes = {model}; "
                    "change --context-parallel-size / --tensor-model-parallel-size / "
                    "--pipeline-model-parallel-size or the number of processes")
        if seq_length is not None:
            if seq_length <= 0 or seq_length % self.seq_multiple:
                raise ContextParallelConfigError(
                    "--seq-length",
                    f"{seq_length} is not divisible by {self.seq_multiple}, which --cp-layout {self.layout} "
                    f"needs with --context-parallel-size {cp}; pad it to a multiple of {self.seq_multiple}"
                    + ("" if self.layout != "zigzag" else " or use --cp-layout striped"))
        if attention_dropout is not None and not 0.0 <= attention_dropout < 1.0:
            raise ContextParallelConfigError(
                "--attention-dropout", f"must be a probability in [0, 1), got {attention_dropout}")
        if num_layers is not None and len(self.cp_comm_type) not in (1, num_layers):
            raise ContextParallelConfigError(
                "--cp-comm-type", f"give one value or one per layer ({num_layers}), got {len(self.cp_comm_type)}")
        refuse_mtp_without_zigzag(mtp_num_layers, self.layout, cp)
        return self

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, *, validate: bool = True, world_size: int | None = None) -> "RingConfig":
        """Build (and by default validate) from an ``argparse.Namespace`` that went through
        :func:`~megatron_ring.megatron.arguments.add_context_parallel_args` (or Megatron-LM's parser).

        ``world_size`` defaults to ``args.world_size``, else the initialised torch.distributed world.
        """
        cfg = cls(
            context_parallel_size=int(getattr(args, "context_parallel_size", 1) or 1),
            layout=getattr(args, "cp_layout", "zigzag") or "zigzag",
            comm_dtype=getattr(args, "cp_comm_dtype", "none") or "none",
            cp_comm_type=_as_tuple(getattr(args, "cp_comm_type", None)) or ("p2p",),
            hierarchical_context_parallel_sizes=_as_tuple(getattr(args, "hierarchical_context_parallel_sizes",
                                                                  None)),
            timeout_s=getattr(args, "cp_timeout_seconds", None),
        )
        if validate:
            if world_size is None:
                world_size = getattr(args, "world_size", None)
            if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
                world_size = torch.distributed.get_world_size()
            cfg.validate(
                world_size=world_size,
                tensor_model_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                pipeline_model_parallel_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                seq_length=getattr(args, "seq_length", None),
                attention_dropout=getattr(args, "attention_dropout", None),
                num_layers=getattr(args, "num_layers", None),
                mtp_num_layers=getattr(args, "mtp_num_layers", None),
            )
        return cfg


def refuse_mtp_without_zigzag(mtp_num_layers: int | None, layout: str, context_parallel_size: int) -> None:
    """Multi-token prediction rolls the labels/tokens of each CP shard assuming Megatron's zigzag split;
    any other layout would train on wrong targets without an error."""
    if mtp_num_layers and context_parallel_size > 1 and layout != "zigzag":
        raise ContextParallelConfigError(
            "--cp-layout", f"multi-token prediction (--mtp-num-layers {mtp_num_layers}) rolls each CP shard "
                           f"assuming Megatron's zigzag split; --cp-layout {layout} would be silently wrong. Use "
                           "--cp-layout zigzag (or drop --mtp-num-layers)")


def _as_tuple(x: Any) -> tuple | None:
    if x is None:
        return None
    if isinstance(x, (str, int)):
        return (x,)
    return tuple(x) if isinstance(x, Sequence) or hasattr(x, "__iter__") else (x,)
