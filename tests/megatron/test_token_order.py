"""One token order for every layer: the ring's splits vs Megatron's own Mamba / GDN context-parallel code.

Megatron's Mamba CP gathers the CP ranks' shards rank after rank and undoes attention's load balancing
(``_undo_attention_load_balancing``; ``_redo_`` on the way back); GDN builds its own permutation for
packed batches (``_build_thd_cp_a2a_perm``, where the installed Megatron has it). Those functions run here
on INDEX tensors (each rank's shard holds the global positions of its tokens, CPU, no process group: they
take only ``cp_size``), so "Megatron puts every token back where it belongs" is checked exactly:

* BSHD: the ring's ``zigzag`` split (``get_layout('zigzag')``, ``shard_sequence``, the glue's
  ``get_batch_on_this_cp_rank``) for every P = 1..8 and several lengths; ``contiguous`` / ``striped`` are
  other orders (and :func:`attention_layout` refuses them by name);
* THD: ``DocumentZigzag(cu_seqlens_padded)`` (what :func:`attention_layout` picks; the glue's split in it,
  which equals Megatron's own THD batch split) for P = 1..8 and 25 random document mixes each (odd real lengths padded to 2P, empty documents, one
  long document), through Megatron's THD branch, which calls ``thd_get_partitioned_indices``: here the
  pure-torch one, installed the way the CPU opt-in does it. The stream ``zigzag`` equals it only for one
  document (checked both ways), which is why THD converts at the split.

``thd_get_partitioned_indices`` itself: TransformerEngine's documented example (its own unit test's
numbers), a partition of the stream per call, and GDN's independent permutation; its checks raise.
"""
import random

import pytest
import torch

from megatron_ring import DocumentZigzag, get_layout, shard_sequence
from megatron_ring.megatron.data.token_order import (TokenOrderError, attention_layout, check_sequence_split,
                                                     data_layout, install_thd_partitioner, megatron_thd_layout,
                                                     same_order, thd_get_partitioned_indices)

mcp = pytest.importorskip("megatron.core.ssm.mamba_context_parallel")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

try:
    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm
except ImportError:  # older Megatron: GDN has no packed CP permutation of its own
    _build_thd_cp_a2a_perm = None

WORLDS = range(1, 9)


@pytest.fixture
def partitioner(monkeypatch):
    """Megatron with the pure-torch partitioner where TE is missing (set through monkeypatch: restored after the
    test; the function patches nothing without a ``patch`` callable)."""
    import megatron.core.utils as mutils

    with pytest.raises(TypeError, match="needs the callable"):
        install_thd_partitioner()
    which = install_thd_partitioner(monkeypatch.setattr)
    assert set(which.values()) <= {"torch", "transformer_engine"}, which
    assert install_thd_partitioner(monkeypatch.setattr) == which  # idempotent
    if which["megatron.core.utils"] == "torch":  # every other version question still goes to Megatron's own
        try:
            answer = mutils.is_te_min_version("2.0.0")
        except (ImportError, TypeError):  # Megatron's own answer without TE, on some versions
            answer = None
        assert answer is not True
    return which


def padded_mixes(world, count=25, seed=0):
    """(cu_seqlens, cu_seqlens_padded) pairs: odd real lengths, each padded to a multiple of 2P."""
    rnd = random.Random(1000 * world + seed)
    out = [([0, 4 * world], [0, 4 * world])]  # one document
    while len(out) < count:
        lens = [rnd.choice([0, 1, 3, 5, 7, 2 * world - 1, 2 * world + 1, 13]) for _ in range(rnd.randint(1, 6))]
        pads = [-(-n // (2 * world)) * 2 * world for n in lens]
        if not sum(pads):
            continue
        cu, cu_pad = [0], [0]
        for n, p in zip(lens, pads):
            cu.append(cu[-1] + n)
            cu_pad.append(cu_pad[-1] + p)
        out.append((cu, cu_pad))
    return out


def _megatron_thd_split(batch, cu, cu_pad, world, rank):
    """Megatron's own THD batch split of ``batch['tokens']`` (whichever function the installed version has)."""
    import megatron.core.utils as mutils

    b = {"tokens": batch["tokens"].clone(), "labels": batch["tokens"].clone()}
    if hasattr(mutils, "get_thd_batch_on_this_cp_rank"):
        out, _ = mutils.get_thd_batch_on_this_cp_rank(b, torch.tensor(cu, dtype=torch.int32),
                                                      torch.tensor(cu_pad, dtype=torch.int32),
                                                      torch.tensor([cu_pad[-1]]), cp_size=world, cp_rank=rank)
        return out["tokens"][0]
    group = object()
    real_size, real_rank = torch.distributed.get_world_size, torch.distributed.get_rank
    torch.distributed.get_world_size = lambda g=None: world if g is group else real_size(g)
    torch.distributed.get_rank = lambda g=None: rank if g is group else real_rank(g)
    try:
        b.update(cu_seqlens=torch.tensor([cu], dtype=torch.int32), cu_seqlens_padded=torch.tensor([cu_pad], dtype=torch.int32))
        return mutils._get_batch_on_this_cp_rank_per_document_balancing(b, group)["tokens"][0]
    finally:
        torch.distributed.get_world_size, torch.distributed.get_rank = real_size, real_rank


def _gathered(layout, seq_len, world):
    """What Megatron's CP all-to-all hands the undo: every rank's shard (global positions), rank after rank."""
    lay = get_layout(layout)
    return torch.cat([lay.positions(seq_len, world, r) for r in range(world)])


@pytest.mark.parametrize("world", WORLDS)
def test_bshd_zigzag_is_megatrons_order(world):
    from megatron_ring.megatron.data.batch import get_batch_on_this_cp_rank

    for seq_len in (2 * world, 6 * world, 10 * world):
        x = _gathered("zigzag", seq_len, world)[:, None, None]  # [s, b, h] as Megatron's a2a output
        undone = mcp._undo_attention_load_balancing(x, world)
        assert torch.equal(undone.flatten(), torch.arange(seq_len)), (world, seq_len)
        redone = mcp._redo_attention_load_balancing(torch.arange(seq_len)[:, None, None], world)
        assert torch.equal(redone.flatten(), x.flatten())
        # the public split functions give the same shards
        full = torch.arange(seq_len)[None, :]
        for r in range(world):
            want = get_layout("zigzag").positions(seq_len, world, r)
            group = _FakeGroup(world, r)
            assert torch.equal(shard_sequence(full, 1, group=group, layout="zigzag")[0], want)
            got = get_batch_on_this_cp_rank({"tokens": full}, layout="zigzag", cp_size=world, cp_rank=r)
            assert torch.equal(got["tokens"][0], want)
        if world > 1:
            for other in ("contiguous", "striped"):
                y = _gathered(other, seq_len, world)[:, None, None]
                assert not torch.equal(mcp._undo_attention_load_balancing(y, world).flatten(),
                                       torch.arange(seq_len))
                with pytest.raises(TokenOrderError, match="--cp-layout zigzag"):
                    attention_layout("bshd", world, other)
        assert attention_layout("bshd", world, "zigzag").name == "zigzag"


class _FakeGroup:
    """Enough of a process group for shard_sequence's (world, rank) lookup without torch.distributed."""

    def __init__(self, world, rank):
        self.world, self.rank_ = world, rank


@pytest.fixture(autouse=True)
def _fake_group_lookup(monkeypatch):
    import megatron_ring.sequence as seq

    real = seq._world_rank
    monkeypatch.setattr(seq, "_world_rank", lambda g: (g.world, g.rank_) if isinstance(g, _FakeGroup) else real(g))


@pytest.mark.parametrize("world", WORLDS)
def test_thd_document_zigzag_is_megatrons_order(world, partitioner):
    from megatron_ring.megatron.data.batch import get_batch_on_this_cp_rank

    for cu, cu_pad in padded_mixes(world):
        total = cu_pad[-1]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                                 cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32),
                                 cu_seqlens_q_padded=torch.tensor(cu_pad, dtype=torch.int32),
                                 cu_seqlens_kv_padded=torch.tensor(cu_pad, dtype=torch.int32),
                                 max_seqlen_q=total, max_seqlen_kv=total)
        lay = attention_layout("thd", world, "zigzag", params.cu_seqlens_q_padded)
        assert isinstance(lay, DocumentZigzag) or world == 1
        lay = DocumentZigzag(cu_pad)
        x = _gathered(lay, total, world)[:, None, None]
        undone = mcp._undo_attention_load_balancing(x, world, params)  # TE's branch: our partitioner
        assert torch.equal(undone.flatten(), torch.arange(total)), (world, cu_pad)
        redone = mcp._redo_attention_load_balancing(torch.arange(total)[:, None, None], world, params)
        assert torch.equal(redone.flatten(), x.flatten()), (world, cu_pad)
        if _build_thd_cp_a2a_perm is not None and world > 1:  # GDN's own permutation agrees
            idx, inv = _build_thd_cp_a2a_perm(torch.tensor(cu_pad), world, total)
            assert torch.equal(inv, x.flatten()), (world, cu_pad)
        # the glue's batch split in that layout hands rank r exactly Megatron's tokens
        batch = {"tokens": torch.arange(total)[None], "cu_seqlens": torch.tensor(cu)}
        for r in range(world):
            got = get_batch_on_this_cp_rank(batch, layout=lay, cp_size=world, cp_rank=r)["tokens"][0]
            assert torch.equal(got, thd_get_partitioned_indices(torch.tensor(cu_pad), total, world, r).long())
        # ... and exactly what Megatron's own THD batch split hands it
        for r in range(world):
            assert torch.equal(_megatron_thd_split(batch, cu, cu_pad, world, r), thd_get_partitioned_indices(
                torch.tensor(cu_pad), total, world, r).long())
        # the stream zigzag is the same order only at P=1 or for a single document
        nonempty = sum(b > a for a, b in zip(cu_pad, cu_pad[1:]))
        assert same_order("zigzag", lay, total, world) == (world == 1 or nonempty == 1), (world, cu_pad)
        if not same_order("zigzag", lay, total, world):  # and Megatron would put the stream split's tokens elsewhere
            stream = _gathered("zigzag", total, world)[:, None, None]
            assert not torch.equal(mcp._undo_attention_load_balancing(stream, world, params).flatten(),
                                   torch.arange(total))


@pytest.mark.parametrize("world", WORLDS)
def test_thd_get_partitioned_indices_semantics(world):
    for _, cu_pad in padded_mixes(world, count=10, seed=1):
        total = cu_pad[-1]
        parts = [thd_get_partitioned_indices(torch.tensor(cu_pad, dtype=torch.int32), total, world, r)
                 for r in range(world)]
        assert all(p.dtype == torch.int32 and p.numel() == total // world for p in parts)
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(total, dtype=torch.int32))
        for r, p in enumerate(parts):  # per document: chunk r, then chunk 2P-1-r
            want = []
            for a, b in zip(cu_pad, cu_pad[1:]):
                c = (b - a) // (2 * world)
                want += list(range(a + r * c, a + (r + 1) * c)) + list(range(b - (r + 1) * c, b - r * c))
            assert p.tolist() == want


def test_thd_get_partitioned_indices_matches_transformer_engines_example():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)  # TransformerEngine's own unit test
    assert thd_get_partitioned_indices(cu, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert thd_get_partitioned_indices(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_named_errors():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    for args, text in [((cu, 16, 2, 2), "rank"), ((cu, 10, 2, 0), "multiple of 2 x world_size"),
                       ((torch.tensor([0, 6, 16]), 16, 2, 0), "padded to a multiple"),
                       ((cu, 24, 2, 0), "must equal total_tokens"), ((cu[None], 16, 2, 0), "1-D")]:
        with pytest.raises(ValueError, match=text):
            thd_get_partitioned_indices(*args)
    with pytest.raises(TokenOrderError, match="multiple of 2 x CP = 4"):
        attention_layout("thd", 2, "zigzag", [0, 6, 16])
    with pytest.raises(TokenOrderError, match="cu_seqlens_q_padded"):
        attention_layout("thd", 2, "zigzag", None)
    with pytest.raises(TokenOrderError, match="--cp-layout zigzag"):
        attention_layout("thd", 4, "striped", [0, 8])
    assert isinstance(TokenOrderError("x"), ValueError)


def test_cp_partition_mode_maps_onto_ring_layouts():
    """Megatron's development-branch ``cp_partition_mode``: contiguous is the stream split r*T/P..(r+1)*T/P."""
    cu_pad = [0, 8, 24]
    assert isinstance(data_layout("zigzag", "thd", 2, "zigzag", cu_pad), DocumentZigzag)
    assert isinstance(data_layout(None, "thd", 2, "zigzag", cu_pad), DocumentZigzag)
    lay = data_layout("contiguous", "thd", 4, "zigzag", cu_pad)
    for r in range(4):
        assert lay.positions(24, 4, r).tolist() == list(range(r * 6, (r + 1) * 6))
    assert data_layout("zigzag", "bshd", 4).name == "zigzag"
    with pytest.raises(TokenOrderError, match="THD"):
        data_layout("contiguous", "bshd", 4)
    with pytest.raises(TokenOrderError, match="zigzag"):
        data_layout("striped", "thd", 4)


def test_without_the_partitioner_megatron_refuses_thd(monkeypatch):
    """The control: with TE absent and nothing installed, Megatron's THD branch asserts (so the
    partitioner is what makes it run)."""
    if mcp.tex is not None and type(mcp.tex).__name__ != "_TorchTex":
        pytest.skip("TransformerEngine is installed")
    monkeypatch.setattr(mcp, "tex", None)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32),
                             cu_seqlens_q_padded=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(AssertionError, match="Transformer Engine"):
        mcp._undo_attention_load_balancing(torch.arange(8)[:, None, None], 2, params)


@pytest.mark.slow
@pytest.mark.parametrize("world,comm_type", [(2, "p2p"), (4, "p2p"), (4, "a2a")])
def test_stock_split_packed_batches_run_in_megatrons_order(run, world, comm_type):
    """The stock ``--spec`` core attention fed a packed batch split the way Megatron splits it (per document)
    equals the float64 per-document reference on every real token (outputs and gradients), with and
    without a sliding window: Megatron's THD order is the ring's, not a refusal."""
    from tests.megatron import token_order_workers as TW

    for errs in run(TW.stock_packed_attention_worker, world, comm_type):  # error / derived bound, per window
        assert len(errs) == 2 and max(errs.values()) <= 1.0, errs


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_stock_stream_split_packed_batches_run_in_megatrons_order(run, world):
    """Megatron-LM's other THD split (``--dataloader-inter-document-masking``: ``use_per_sequence_balancing``, one
    zigzag over the stream, unpadded odd-length documents), split by Megatron's own function and announced by
    its arguments: the stock ``--spec`` core attention equals the float64 per-document reference (outputs and
    gradients)."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's arguments (0.19 wheel)")
    from tests.megatron import token_order_workers as TW

    errs = run(TW.stock_stream_split_attention_worker, world, "inter-document")
    assert max(errs) <= 1.0, errs


@pytest.mark.slow
def test_stream_split_announced_as_per_document_is_caught(run):
    """Negative control of the test above: the same stream-split batch while the arguments announce the
    per-document split (``--sft``): the ring runs the per-document order and the comparison fails."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's arguments (0.19 wheel)")
    from tests.megatron import token_order_workers as TW

    errs = run(TW.stock_stream_split_attention_worker, 2, "sft")
    assert max(errs) > 1.0, errs


def test_megatron_lms_stream_split_is_the_ring_zigzag(monkeypatch):
    """Megatron's ``_get_batch_on_this_cp_rank_per_sequence_balancing`` (index tensors, P = 1..8) holds on rank r
    exactly the ring's stream ``zigzag`` positions: what :func:`megatron_thd_layout` returns for that split."""
    import inspect

    import megatron.core.utils as mutils
    import torch.distributed as dist

    if "use_per_sequence_balancing" not in inspect.signature(mutils.get_batch_on_this_cp_rank).parameters:
        pytest.skip("this Megatron has no stream-wide THD split (use_per_sequence_balancing)")
    for world in WORLDS:
        for rank in range(world):
            monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
            monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
            T = 2 * world * 5
            cu = torch.tensor([[0, 3, 11, T]], dtype=torch.int32)
            batch = {"tokens": torch.arange(T)[None], "cu_seqlens": cu, "cu_seqlens_padded": None}
            got = mutils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=object(),
                                                   use_per_sequence_balancing=True)["tokens"][0]
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[0])
            lay = megatron_thd_layout(world, "zigzag", params, "sequence")
            assert torch.equal(got, lay.positions(T, world, rank)), (world, rank)


def test_stream_split_refusals_name_the_fix():
    """What cannot follow the stream split at CP > 1 is refused by name; the per-document split and CP = 1 pass."""
    from types import SimpleNamespace

    from megatron_ring.megatron.compat import megatron_lm_packed_split

    stream = SimpleNamespace(dataloader_inter_document_masking=True, sft=False, position_embedding_type="none")
    sft = SimpleNamespace(dataloader_inter_document_masking=True, sft=True, position_embedding_type="rope")
    assert megatron_lm_packed_split(stream) == "sequence" and megatron_lm_packed_split(sft) == "document"
    assert megatron_lm_packed_split(SimpleNamespace()) == "document"
    for types, pe, text in [(["M", "*", "M", "-"], "none", "hybrid layer\\(s\\) M"),
                            (["G", "*"], "none", "layer\\(s\\) G"), (["*", "-"], "rope", "--position-embedding-type rope")]:
        with pytest.raises(TokenOrderError, match=text) as e:
            check_sequence_split(2, types, SimpleNamespace(**{**vars(stream), "position_embedding_type": pe}))
        assert "--sft" in str(e.value)
    check_sequence_split(2, ["*", "-", "E"], stream)  # attention, MLP, MoE: fine
    check_sequence_split(1, ["M", "*"], stream)
    check_sequence_split(4, ["M", "*"], sft)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(TokenOrderError, match="--cp-layout zigzag"):
        megatron_thd_layout(2, "striped", PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu), "sequence")
    assert isinstance(megatron_thd_layout(2, "zigzag", PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(
        [0, 4, 8])), "document"), DocumentZigzag)


def test_cpu_opt_in_installs_and_restores_the_partitioner():
    """``megatron_cpu()`` puts the pure-torch partitioner where TE is missing and puts Megatron's own back."""
    import megatron.core.utils as mutils

    from megatron_ring_lab.cpu import megatron_cpu

    before = [(m.tex, m.is_te_min_version) for m in (mcp, mutils)]
    if any(t is not None for t, _ in before):
        pytest.skip("TransformerEngine is installed: nothing is replaced")
    with megatron_cpu():
        assert all(type(m.tex).__name__ == "_TorchTex" for m in (mcp, mutils))
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8, 12], dtype=torch.int32),
                                 cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32))
        x = _gathered(DocumentZigzag([0, 8, 16]), 16, 2)[:, None, None]
        assert torch.equal(mcp._undo_attention_load_balancing(x, 2, params).flatten(), torch.arange(16))
    assert [(m.tex, m.is_te_min_version) for m in (mcp, mutils)] == before
