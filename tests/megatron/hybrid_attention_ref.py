"""The attention layers of a HybridModel run vs the float64 reference (issue 26: "the attention layers vs the
float64 reference").

``hybrid_workers.capture_core_attention`` records, on every CP rank, what each attention (``*``) layer's core
attention was given (q, k, v after Megatron's RoPE, this rank's tokens), what it returned, the upstream
gradient of its output and the gradients that flowed back into q, k, v during the model's own backward. Here
the ranks' shards are put back in global token order from Megatron's DOCUMENTED split, written out below
(not the ring's layouts, which are under test):

* BSHD (``get_batch_on_this_cp_rank``): the sequence in 2P equal chunks, rank r holds chunk r then chunk
  2P-1-r;
* packed THD (``thd_get_partitioned_indices`` of ``cu_seqlens_padded``): the same within every padded
  document, the documents in stream order.

Then float64 full attention (``tests/helpers/reference.feature_reference``: causal, one document per real
document of the packed stream, GQA by repeating K/V heads in Megatron's grouping, softmax scale
1/sqrt(kv_channels) as Megatron's core attention uses by default) gives the output, and its vjp for the captured
upstream gradient gives dq, dk, dv. Every one is compared with the ring's on the whole global tensor, under the
attention rule of ``tests/helpers/numerics.py`` (fp32, blocks = 2P, n = the stream length, sigma from the
captured q, k). THD compares the real tokens only: Megatron leaves the rows of a document's padding undefined
(TransformerEngine does not attend them), so only real rows have a meaning to hold the ring to.

Dropout 0 only: with attention dropout the reference would have to redraw the ring's keep mask, which would
test the mask against itself; the dropout runs are compared with the ring at CP = 1 instead
(test_hybrid_model.py).
"""
from __future__ import annotations

import torch

from tests.helpers.numerics import max_err, score_bound, tol
from tests.helpers.reference import documents_and_filler, feature_reference


def zigzag_rows(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of rank ``rank``'s local rows: chunk r then chunk 2P-1-r of 2P equal chunks."""
    c = length // (2 * cp)
    assert c * 2 * cp == length, (length, cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])


def contiguous_rows(length: int, cp: int, rank: int) -> torch.Tensor:
    """Negative control's order: rank r holds the r-th of P contiguous chunks."""
    c = length // cp
    return torch.arange(rank * c, (rank + 1) * c)


def per_document_rows(cu_padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """Packed THD: the zigzag split within every padded document, documents in stream order."""
    return torch.cat([a + zigzag_rows(b - a, cp, rank) for a, b in zip(cu_padded[:-1], cu_padded[1:])])


def _bshd(t: torch.Tensor, packed: bool, flat: bool) -> torch.Tensor:
    """A captured tensor batch-first: ``[s, b, h, d]`` / ``[s, b, h*d]`` (BSHD) or ``[t, (1,) h, d]`` /
    ``[t, (1,) h*d]`` (THD; ``flat``: the output and its gradient, heads folded into the last dim)."""
    if packed:
        t = t.reshape(t.shape[0], 1, -1) if flat else t.reshape(t.shape[0], 1, *t.shape[-2:])
    return t.transpose(0, 1)


def gather_global(per_rank: list[dict], rows: list[torch.Tensor], packed: bool, heads: int) -> dict:
    """One layer's captures from every rank -> global ``[b, S, h, d]`` float64 tensors (rank r's local row i at
    global position ``rows[r][i]``)."""
    out = {}
    for key in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        parts = [_bshd(rec[key], packed, key in ("out", "dout")).double() for rec in per_rank]
        b, S = parts[0].shape[0], sum(p.shape[1] for p in parts)
        full = torch.full((b, S) + tuple(parts[0].shape[2:]), float("nan"), dtype=torch.float64)
        for p, idx in zip(parts, rows):
            assert p.shape[1] == idx.numel(), (key, p.shape, idx.numel())
            full[:, idx] = p
        assert not torch.isnan(full).any(), f"{key}: some global position got no rank's row"
        out[key] = full
    for key in ("out", "dout"):  # [b, S, h*d] -> [b, S, h, d]
        out[key] = out[key].reshape(*out[key].shape[:2], heads, -1)
    return out


def layer_rows(records: list[list[dict]], *, cp: int, m: dict, packed: bool, order: str = "megatron",
               mask: str = "right", label: str = "") -> list[tuple[str, float, float]]:
    """``(label, max error, derived bound)`` of out, dq, dk, dv for every attention layer of one run.

    ``records``: the workers' ``attention`` lists, one per CP rank. ``order`` / ``mask`` (negative controls):
    ``contiguous`` puts the shards back as contiguous chunks (BSHD) or zigzag over the whole stream (THD)
    instead of Megatron's split; ``mask="no_documents"`` (THD) / ``"bidirectional"`` (BSHD) perturbs the
    reference's mask."""
    from tests.megatron import hybrid_workers as HW

    assert len(records) == cp and all(len(r) == len(records[0]) for r in records), [len(r) for r in records]
    heads, groups = m["num_attention_heads"], m["num_query_groups"]
    scale = (m["hidden_size"] // heads) ** -0.5  # Megatron's default: 1 / sqrt(kv_channels)
    if packed:
        cu, cup = HW.packed_layout(m)
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        S = cup[-1]
        rows = [per_document_rows(cup, cp, r) if order == "megatron" else zigzag_rows(S, cp, r) for r in range(cp)]
        docs = documents_and_filler(torch.tensor(cup), lens) if mask == "right" else None
        real = torch.cat([torch.arange(a, a + n) for a, n in zip(cup[:-1], lens)])
    else:
        S = m["seq"]
        split = zigzag_rows if order == "megatron" else contiguous_rows
        rows = [split(S, cp, r) for r in range(cp)]
        docs, real = None, torch.arange(S)
    causal = mask != "bidirectional"
    out = []
    for layer in range(len(records[0])):
        per_rank = [r[layer] for r in records]
        name = per_rank[0]["layer"]
        assert all(rec["layer"] == name for rec in per_rank), [rec["layer"] for rec in per_rank]
        missing = [k for k in ("dq", "dk", "dv", "dout") if any(k not in rec for rec in per_rank)]
        assert not missing, f"{name}: the backward never reached core attention's {missing}"
        g = gather_global(per_rank, rows, packed, heads)
        assert g["q"].shape[2] == heads and g["k"].shape[2] == groups, (g["q"].shape, g["k"].shape)
        leaves = [g[k].clone().requires_grad_() for k in ("q", "k", "v")]
        ref = feature_reference(*leaves, causal=causal, cu=docs, scale=scale)
        ref.backward(g["dout"])
        sigma = score_bound(g["q"], g["k"], scale)
        for what, got, want in zip(("out", "dq", "dk", "dv"), (g["out"], g["dq"], g["dk"], g["dv"]),
                                   (ref.detach(),) + tuple(t.grad for t in leaves)):
            got, want = got[:, real], want[:, real]
            bound = tol(want.abs().max().item(), dtype=torch.float32, n=max(S, g["q"].shape[-1]), sigma=sigma,
                        blocks=2 * cp if cp > 1 else 1)
            out.append((f"{label} {name} {what}".strip(), max_err(got, want), bound))
    return out
