"""One token order for every layer of a hybrid model: the ring's split vs what Megatron's Mamba / GDN CP undoes.

Megatron's context parallelism for the non-attention mixers (``ssm/mamba_context_parallel.py``, the GDN
layers) is a head-parallel all-to-all that gathers the CP ranks' shards rank after rank and then undoes
attention's load balancing (``_undo_attention_load_balancing``):

* BSHD: it hard-codes zigzag: 2P equal chunks, rank r holding chunk r then chunk 2P-1-r. That is the
  ring's ``layout="zigzag"`` exactly (``tests/megatron/test_token_order.py`` runs Megatron's own
  function on index tensors for P = 1..8). ``contiguous`` and ``striped`` are other orders: refused.
* THD (packed): it asks TransformerEngine's ``thd_get_partitioned_indices(cu_seqlens_padded, T, P, r)``,
  a zigzag WITHIN each (padded) document. The ring's stream layouts cut the stream as one sequence
  instead; the two agree only at P = 1 or for one document. The conversion happens once per batch, at
  the split: :func:`attention_layout` returns :class:`megatron_ring.DocumentZigzag` (that order as a ring
  layout), ``get_batch_on_this_cp_rank(batch, layout=...)`` splits the batch in it and the ring runs in
  it; nothing is permuted per layer. A layout that cannot be made consistent raises
  :class:`TokenOrderError`.

Megatron-LM's stock ``get_batch`` has a second THD split: ``--dataloader-inter-document-masking`` without
``--sft`` (``use_per_sequence_balancing``) cuts the flattened packed stream as ONE sequence, zigzag over 2 x CP
equal chunks, documents unpadded (``compat.megatron_lm_packed_split``). The ring serves that order exactly (the
stream layout ``zigzag`` with the documents as a mask): :func:`megatron_thd_layout` picks it. Megatron's own
THD RoPE and Mamba / GDN context parallelism assume the per-document order instead, so with that split at
CP > 1 :func:`check_sequence_split` refuses those layers by name (at build time) instead of a silent mix.

Without TransformerEngine, Megatron's THD branches assert (Mamba's undo/redo, its own THD batch split);
:func:`install_thd_partitioner` puts :func:`thd_get_partitioned_indices` (pure torch, TransformerEngine's
semantics) where those modules look it up, without editing Megatron's files, through a ``patch`` callable the
caller passes and undoes (the lab's CPU opt-in passes its patch ledger's).

Megatron's development branch adds ``cp_partition_mode`` (``zigzag`` | ``contiguous``, THD only): the
order of the batch split; its attention module converts to zigzag before core attention, and GDN
converts to what it needs. :func:`data_layout` maps it onto the ring's layouts where they already match:
``zigzag`` -> the per-document zigzag above, ``contiguous`` -> ``layout="contiguous"`` over the stream
(rank r holds tokens ``[r T/P, (r+1) T/P)``, Megatron's definition).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_ring import DocumentZigzag, get_layout
from megatron_ring.megatron import compat
from megatron_ring.megatron.data.documents import LastAnswer, params_on_host

__all__ = ["TokenOrderError", "refuse_mla_packed_ring_split", "thd_get_partitioned_indices", "attention_layout", "data_layout",
           "megatron_thd_layout", "check_sequence_split", "ROPE_TYPES",
           "same_order", "install_thd_partitioner", "PARTITION_MODES"]

PARTITION_MODES = ("zigzag", "contiguous")


class TokenOrderError(ValueError):
    """The ring's token order cannot be made the one Megatron's Mamba / GDN context parallelism assumes."""


def refuse_mla_packed_ring_split(cp: int) -> None:
    """Multi-latent attention applies its RoPE itself, to packed (THD) batches with Megatron's per-document split
    of each document over the CP ranks (TransformerEngine's), which is not the order the ring's own batch split
    (``batch_split="ring"``) gives the packed stream: the embeddings would land on the wrong tokens. Raised by the
    MLA's RoPE (``rope.LayoutRotaryEmbedding``, after :func:`~megatron_ring.megatron.use_layout_rope`) and by the
    ring core attention."""
    raise TokenOrderError(
        f"multi-latent attention on a packed (THD) batch at CP = {cp}: MLA applies its RoPE itself, in Megatron's "
        "per-document order (each document padded to a multiple of 2 x CP, cu_seqlens_q_padded), not in the "
        "order the ring's own batch split gives the stream. Split the batch in Megatron's order (stock "
        "Megatron-LM's get_batch, or get_batch_on_this_cp_rank(batch, layout=attention_layout('thd', cp, "
        "'zigzag', cu_seqlens_padded))) and build the core attention with batch_split='megatron' (the stock "
        "--spec's, megatron_ring.megatron.spec.stock.ring_core()), or feed BSHD batches.")


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int,
                                rank: int) -> torch.Tensor:
    """The global token indices (int32, ``[total_tokens / world_size]``, on ``cu_seqlens``' device) that CP
    rank ``rank`` of ``world_size`` holds of a packed stream, in its local order: for every sequence of
    ``cu_seqlens`` (each length a multiple of ``2 * world_size``), in order, the sequence's chunk ``rank``
    then its chunk ``2 * world_size - 1 - rank`` of ``2 * world_size`` equal chunks.

    TransformerEngine's ``transformer_engine_torch.thd_get_partitioned_indices`` in pure torch, same
    arguments and result. Its checks raise ValueError here: ``cu_seqlens`` 1-D with at least 2 entries,
    ``0 <= rank < world_size``, ``total_tokens`` a positive multiple of ``2 * world_size``, every
    boundary a multiple of ``2 * world_size``; and ``cu_seqlens[-1] == total_tokens`` (beyond the last
    boundary TransformerEngine's kernel reads past its table: undefined). Any integer dtype is accepted
    (TransformerEngine takes int32 only)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point():
        raise ValueError("thd_get_partitioned_indices: cu_seqlens must be a 1-D integer tensor with at least 2 "
                         f"entries, got {getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    p, t = int(world_size), int(total_tokens)
    if p <= 0 or not 0 <= rank < p:
        raise ValueError(f"thd_get_partitioned_indices: need 0 <= rank < world_size, got rank {rank} of {p}")
    if t <= 0 or t % (2 * p):
        raise ValueError(f"thd_get_partitioned_indices: total_tokens={t} must be a positive multiple of "
                         f"2 x world_size = {2 * p}")
    cu = cu_seqlens.detach().long()
    if bool((cu % (2 * p) != 0).any()):
        raise ValueError(f"thd_get_partitioned_indices: every sequence must be padded to a multiple of 2 x "
                         f"world_size = {2 * p} (cu_seqlens_padded), got boundaries {cu.tolist()}")
    if int(cu[-1]) != t:
        raise ValueError(f"thd_get_partitioned_indices: cu_seqlens[-1]={int(cu[-1])} must equal total_tokens={t} "
                         "(pad the last sequence, or pass cu_seqlens_padded)")
    cu_local = cu // p  # every sequence's share on one rank
    tok = torch.arange(t // p, device=cu.device)
    seq = torch.searchsorted(cu_local, tok, right=True) - 1  # the last sequence starting at or before tok
    start = cu_local[seq]
    half = (cu_local[seq + 1] - start) // 2  # one chunk
    index = tok - start
    chunk = torch.where(index < half, torch.full_like(index, rank), torch.full_like(index, 2 * p - 2 - rank))
    return (index + start * p + half * chunk).to(torch.int32)


def _cu(cu_seqlens_padded: Any) -> list[int]:
    if isinstance(cu_seqlens_padded, torch.Tensor):
        return [int(x) for x in cu_seqlens_padded.reshape(-1).tolist()]
    return [int(x) for x in cu_seqlens_padded]


def attention_layout(qkv_format: str, cp_size: int, layout: str = "zigzag", cu_seqlens_padded: Any = None):
    """The ring layout whose token order is the one Megatron's Mamba / GDN layers undo (and Megatron's
    attention expects): ``"zigzag"`` for BSHD/SBHD, :class:`~megatron_ring.DocumentZigzag` of the padded
    boundaries for THD. ``layout`` is the ring's configured layout (``--cp-layout``): ``zigzag`` is
    converted (for THD: per document), anything else raises :class:`TokenOrderError` naming the fix."""
    if cp_size == 1:
        return get_layout(layout)
    if layout != "zigzag" and not isinstance(layout, DocumentZigzag):
        raise TokenOrderError(
            f"--cp-layout {getattr(layout, 'name', layout)} at CP={cp_size} with Mamba/GDN layers: Megatron's context "
            "parallelism for those layers undoes the zigzag order (per document for packed THD), so every layer "
            "must use it; use --cp-layout zigzag")
    if qkv_format != "thd":
        return get_layout("zigzag")
    if cu_seqlens_padded is None:
        raise TokenOrderError("packed (THD) batches with Mamba/GDN layers at CP>1 need the padded document "
                              "boundaries (cu_seqlens_q_padded): Megatron splits every document zigzag")
    cu = _cu(cu_seqlens_padded)
    bad = [b - a for a, b in zip(cu, cu[1:]) if (b - a) % (2 * cp_size)]
    if bad or cu[0] != 0:
        raise TokenOrderError(
            f"packed (THD) batches with Mamba/GDN layers at CP={cp_size}: Megatron splits every document zigzag, "
            f"so each padded document length must be a multiple of 2 x CP = {2 * cp_size} (got {bad or cu}); pad "
            f"each document to a multiple of {2 * cp_size} and pass cu_seqlens_q_padded (Megatron-LM: --sft "
            "packs that way; --dataloader-inter-document-masking splits the stream as one sequence instead)")
    return DocumentZigzag(cu)


def data_layout(cp_partition_mode: str | None, qkv_format: str, cp_size: int, layout: str = "zigzag",
                cu_seqlens_padded: Any = None):
    """The layout of the batch split for Megatron's ``cp_partition_mode`` (None: the lines without it, which
    split zigzag): ``zigzag`` -> :func:`attention_layout`; ``contiguous`` (THD only, as Megatron defines
    it) -> ``"contiguous"`` over the stream. Other values raise :class:`TokenOrderError`."""
    mode = cp_partition_mode or "zigzag"
    if mode not in PARTITION_MODES:
        raise TokenOrderError(f"cp_partition_mode={mode!r}: Megatron defines {list(PARTITION_MODES)}")
    if mode == "zigzag" or cp_size == 1:
        return attention_layout(qkv_format, cp_size, layout, cu_seqlens_padded)
    if qkv_format != "thd":
        raise TokenOrderError("cp_partition_mode='contiguous' is defined for packed (THD) batches only; BSHD "
                              "context parallelism is zigzag")
    return get_layout("contiguous")


ROPE_TYPES = ("rope", "yarn", "mrope")  # Megatron position embeddings applied to Q/K per THD document


def megatron_thd_layout(cp_size: int, layout: Any, packed_seq_params: Any, split: str):
    """The ring layout of a packed (THD) batch that stock Megatron(-LM) split over ``cp_size`` ranks: ``split``
    ``"sequence"`` (:func:`~megatron_ring.megatron.compat.megatron_lm_packed_split`: one zigzag over the whole
    stream) -> the stream layout ``zigzag`` (the documents stay a mask: exact for any document lengths);
    ``"document"`` -> :func:`attention_layout` of the padded boundaries (``cu_seqlens_q_padded``, else
    ``cu_seqlens_q``). Another ``--cp-layout`` than zigzag raises :class:`TokenOrderError`."""
    if split == "sequence":
        name = getattr(layout, "name", layout)
        if cp_size > 1 and name != "zigzag":
            raise TokenOrderError(
                f"--cp-layout {name} at CP={cp_size}: Megatron-LM's get_batch split this packed batch "
                "(--dataloader-inter-document-masking) zigzag over the whole stream; use --cp-layout zigzag")
        return get_layout("zigzag")
    if split != "document":
        raise ValueError(f"split must be 'sequence' or 'document', got {split!r}")
    # every layer of a micro-batch asks with the same params: read on the host once, the same layout object after
    return _LAST_LAYOUT.get(packed_seq_params, (cp_size, getattr(layout, "name", layout)),
                            lambda: _document_layout(cp_size, layout, packed_seq_params))


def _document_layout(cp_size: int, layout: Any, packed_seq_params: Any):
    host = params_on_host(packed_seq_params)
    padded = host["cu_seqlens_q_padded"]
    return attention_layout("thd", cp_size, layout, padded if padded is not None else host["cu_seqlens_q"])


_LAST_LAYOUT = LastAnswer()


def check_sequence_split(cp_size: int, layer_types: Any = (), args: Any = None) -> None:
    """Refuse (:class:`TokenOrderError`) what cannot follow Megatron-LM's stream-wide THD split
    (``--dataloader-inter-document-masking`` without ``--sft``) at ``cp_size`` > 1: Megatron's Mamba (``M``) /
    GDN (``G``) context parallelism and its THD RoPE both place each rank's tokens per document zigzag
    (``thd_get_partitioned_indices``, ``_apply_rotary_pos_emb_thd``), not in the stream's zigzag, and would mix
    tokens silently. ``layer_types``: the hybrid layer symbols; ``args``: Megatron-LM's arguments (default: the
    running script's). Nothing to check for the per-document split or at CP = 1."""
    args = compat.megatron_lm_args() if args is None else args
    if cp_size <= 1 or compat.megatron_lm_packed_split(args) != "sequence":
        return
    fix = ("or pack with --sft (every document padded to a multiple of 2 x CP and split zigzag on its own, the "
           "order Megatron's layers use), or drop --dataloader-inter-document-masking (BSHD), or CP=1")
    mixers = sorted({str(t) for t in (layer_types or ()) if str(t) in ("M", "G")})
    if mixers:
        raise TokenOrderError(
            f"--dataloader-inter-document-masking at CP={cp_size} with hybrid layer(s) {', '.join(mixers)}: "
            "Megatron-LM's get_batch splits the packed stream as one sequence (use_per_sequence_balancing), but "
            "Megatron's context parallelism for Mamba/GDN layers undoes a per-document zigzag "
            f"(thd_get_partitioned_indices): the token orders differ; {fix}")
    pe = getattr(args, "position_embedding_type", None)
    if pe in ROPE_TYPES:
        raise TokenOrderError(
            f"--dataloader-inter-document-masking at CP={cp_size} with --position-embedding-type {pe}: "
            "Megatron-LM's get_batch splits the packed stream as one sequence (use_per_sequence_balancing), but "
            "Megatron's THD RoPE (_apply_rotary_pos_emb_thd) rotates each rank's tokens as if every document were "
            f"split zigzag on its own: wrong positions; use --position-embedding-type none or learned_absolute, {fix}")


def same_order(layout_a: Any, layout_b: Any, seq_len: int, cp_size: int) -> bool:
    """Whether two layouts give every rank the same tokens in the same local order."""
    a, b = get_layout(layout_a), get_layout(layout_b)
    return all(torch.equal(a.positions(seq_len, cp_size, r), b.positions(seq_len, cp_size, r))
               for r in range(cp_size))


class _TorchTex:
    """What ``megatron.core.ssm.mamba_context_parallel`` asks of ``transformer_engine_torch``, in pure torch."""

    thd_get_partitioned_indices = staticmethod(thd_get_partitioned_indices)

    def __repr__(self) -> str:
        return "megatron_ring's pure-torch thd_get_partitioned_indices"


_SHIM = _TorchTex()


def install_thd_partitioner(patch: Callable[[Any, str, Any], None] | None = None) -> dict[str, str]:
    """Give Megatron :func:`thd_get_partitioned_indices` where TransformerEngine is missing (its THD
    branches assert or fail otherwise), without editing its files: in each module of
    ``compat.THD_PARTITIONER_USERS`` (Mamba's CP undo/redo, Megatron's own THD batch split) whose ``tex``
    is None, ``tex`` becomes a pure-torch stand-in holding only that function, and the module's
    ``is_te_min_version`` answers True to the THD branch's question (``"1.10.0"``) while the stand-in is
    there (every other question goes to Megatron's own). Where TransformerEngine is installed nothing
    changes. Idempotent. ``patch(module, name, value)`` sets each name and is required: the caller owns the
    change and its undoing (the lab's CPU opt-in passes its patch ledger's, undone on exit; a test may pass
    ``monkeypatch.setattr``; ``setattr`` patches for good, knowingly). Returns ``{module: "transformer_engine" |
    "torch" | "absent"}``."""
    if patch is None:
        raise TypeError("install_thd_partitioner(patch) needs the callable that sets each name, e.g. "
                        "monkeypatch.setattr, or setattr to patch Megatron for the rest of the process; "
                        "the lab's CPU opt-in installs it for its scope only")
    return compat.install_tex_stand_in(_SHIM, patch)
