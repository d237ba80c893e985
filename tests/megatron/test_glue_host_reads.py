"""The Megatron glue reads a packed batch's ``PackedSeqParams`` on the host once per micro-batch, not per layer.

On a GPU every host read of a device tensor waits for the device: a read in each layer's call keeps the host from
running ahead of the kernels. Megatron passes the same params object to every layer of a micro-batch, so the glue
keeps what it derives from them (``documents.LastAnswer``: the ring's ``cu_seqlens``, the filler rows of QK-clip,
packed RoPE's positions on the device) while the params hold the same tensors, unchanged. Counted here on the CPU
tier (``HostReadCounter``: reads of values derived from the tainted params and inputs), through
``RingDotProductAttention`` at CP = 1 (the one-rank loopback ring), three layers per micro-batch: the first layer
makes ONE read (the params' ``cu_seqlens*`` concatenated on their device and copied to the host together,
``documents.params_on_host``) and computes packed RoPE's angles, the other two read nothing and reuse the angles; a new batch's tensors, or a tensor changed in place, are
read again. Measured with this file's counter: at 4a4987b every layer made 2 reads (plain), 5 (padded documents), 4
(packed RoPE), 7 (both); at cd876f9 the first layer of a micro-batch did, the others none. Negative control: with the
answers not kept, every layer reads. The same for stock Megatron's per-document split of packed batches (its layout),
and for ``--reset-attention-mask`` batches (the mask of documents: 4 reads and, at CP > 1, an all-reduce in every
layer at 4a4987b; now one read and one all-reduce, by the first layer)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ring import device
from megatron_ring.megatron import RingDotProductAttention
from megatron_ring.megatron.data import documents
from tests.helpers.fake_device import FakeCuda, HostReadCounter
from tests.helpers.ring_fakes import one_rank_group  # noqa: F401  (fixture)

LAYERS = 3


def _layers(rope: bool):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_ring.megatron.data.rope import LayoutRotaryEmbedding

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, context_parallel_size=1, transformer_impl="local",
                            attention_dropout=0.0)
    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    rotary.__class__ = LayoutRotaryEmbedding  # as use_layout_rope links a model's RoPE to its ring attentions
    layers = []
    for i in range(LAYERS):
        layer = RingDotProductAttention(cfg, i + 1, AttnMaskType.causal, "self",
                                        pg_collection=SimpleNamespace(cp=dist.group.WORLD,
                                                                      tp=SimpleNamespace(size=lambda: 1)))
        layer.packed_rope = (rotary,) if rope else None
        layers.append(layer)
    return layers


def _params(padded: bool, shift: int = 0) -> PackedSeqParams:
    cu = torch.tensor([0, 20 - shift, 40, 56] if padded else [0, 20 - shift, 48, 64], dtype=torch.int32)
    slots = torch.tensor([0, 24, 48, 64], dtype=torch.int32) if padded else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), cu_seqlens_q_padded=slots,
                           cu_seqlens_kv_padded=None if slots is None else slots.clone(), max_seqlen_q=28,
                           max_seqlen_kv=28)


def _reads(layers, batches) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Host reads of each layer call, per micro-batch (a list of layer calls each), and the outputs."""
    from megatron_ring_lab.cpu import megatron_cpu  # Megatron's RoPE asks for a CUDA device

    dev, reads, outs = FakeCuda(), [], []
    g = torch.Generator().manual_seed(0)
    with megatron_cpu(), device.use("cpu", dev):
        for params in batches:
            if callable(params):
                params = params()
            per_layer = []
            for layer in layers:
                q = torch.randn(64, 1, 4, 8, generator=g).requires_grad_()
                k, v = (torch.randn(64, 1, 2, 8, generator=g).requires_grad_() for _ in range(2))
                counter = HostReadCounter(dev)
                counter.taint(q, k, v, *(getattr(params, n) for n in documents._PARAMS_TENSORS
                                         if getattr(params, n) is not None))
                with counter:
                    out = layer(q, k, v, None, packed_seq_params=params)
                    out.sum().backward()
                per_layer.append(counter.total())
                outs += [out.detach(), q.grad, k.grad, v.grad]
            reads.append(per_layer)
    return reads, outs


def _batches(padded: bool):
    """Two micro-batches (new tensors each), then the second's ``cu_seqlens_q`` changed in place."""
    first, second = _params(padded), _params(padded, shift=2)

    def changed():
        second.cu_seqlens_q[1] -= 1
        second.cu_seqlens_kv[1] -= 1
        return second
    return [first, second, changed]


@pytest.mark.parametrize("rope,padded", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["plain", "padded", "rope", "rope-padded"])
def test_the_glue_reads_packed_params_once_per_micro_batch(one_rank_group, rope, padded):  # noqa: F811
    from megatron_ring.megatron.data import packed_rope

    angles = []  # packed RoPE's angles (rotary.get_emb, index_select) are computed once per micro-batch too
    with pytest.MonkeyPatch.context() as mp:
        real = packed_rope._freqs
        mp.setattr(packed_rope, "_freqs", lambda *a: (angles.append(1), real(*a))[1])
        reads, outs = _reads(_layers(rope), _batches(padded))
        kept_angles = len(angles)
        # the negative control: the answers not kept, every layer reads; the same outputs and gradients, bit for bit
        mp.setattr(documents.LastAnswer, "get", lambda self, owner, key, compute, **kw: compute())
        fresh, fresh_outs = _reads(_layers(rope), _batches(padded))
    for per_layer in reads:
        assert per_layer == [1] + [0] * (LAYERS - 1), reads
    assert (kept_angles, len(angles) - kept_angles) == ((3, 3 * LAYERS) if rope else (0, 0))
    assert all(n > 0 for per_layer in fresh for n in per_layer), fresh
    assert len(outs) == len(fresh_outs) and all(torch.equal(a, b) for a, b in zip(outs, fresh_outs))
    print(f"reads per layer call, kept: {reads}; not kept: {fresh}")


def test_the_stock_split_layout_is_read_once_per_micro_batch():
    """Packed batches stock Megatron split per document (``batch_split="megatron"``, CP > 1): the layout of the
    padded boundaries is read once per params and given again, the same object (the engine's plan cache keys on
    it); new tensors are read again. Negative control: not kept, every call reads and makes a new layout."""
    from megatron_ring.megatron.data import token_order

    def calls(params_list):
        dev, reads, got = FakeCuda(), [], []
        with device.use("cpu", dev):
            for params in params_list:
                counter = HostReadCounter(dev)
                counter.taint(params.cu_seqlens_q, params.cu_seqlens_q_padded)
                with counter:
                    got.append(token_order.megatron_thd_layout(2, "zigzag", params, "document"))
                reads.append(counter.total())
        return reads, got

    first, second = _params(True), _params(True, shift=2)
    reads, got = calls([first] * LAYERS + [second] * LAYERS)
    assert reads == [1, 0, 0] * 2 and got[0] is got[1] is got[2] and got[3] is got[5] and got[3] is not got[0], reads
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(documents.LastAnswer, "get", lambda self, owner, key, compute, **kw: compute())
        fresh, made = calls([first] * LAYERS)
    assert fresh == [1] * LAYERS and made[0] is not made[1]
    assert made[0].positions(64, 2, 1).tolist() == got[0].positions(64, 2, 1).tolist()


def test_a_documents_mask_is_read_once_per_micro_batch(one_rank_group):  # noqa: F811
    """``--reset-attention-mask`` batches (a boolean mask of documents, ``[s, b]`` layout): the layers share one
    reader of the mask (``documents.documents_from_mask``), so the first layer of a micro-batch reads it on the host
    (and at CP > 1 all-reduces its document starts) and the others reuse the answer; a new mask, or one changed in
    place, is read again. Negative control: a reader per layer (before) reads it in every layer."""
    from megatron_ring.megatron.data.documents import DocumentsFromMask, document_mask

    def reads(layers, masks):
        dev, out = FakeCuda(), []
        with device.use("cpu", dev):
            for mask in masks:
                if callable(mask):
                    mask = mask()
                per_layer = []
                for layer in layers:
                    q = torch.randn(32, 1, 4, 8, requires_grad=True)
                    k, v = (torch.randn(32, 1, 2, 8, requires_grad=True) for _ in range(2))
                    counter = HostReadCounter(dev)
                    counter.taint(q, k, v, mask)
                    with counter:
                        layer(q, k, v, mask).sum().backward()
                    per_layer.append(counter.total())
                out.append(per_layer)
        return out

    def mask(at):
        tokens = torch.ones(1, 32, dtype=torch.long)
        tokens[0, at] = 0
        return document_mask(tokens, 0)[0]

    first, second = mask(10), mask(20)

    def changed():
        second[..., 21:, :21] = False  # in place: the two documents made one (plain causal), read again
        return second
    got = reads(_layers(False), [first, first, second, changed])
    assert got == [[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], got
    layers = _layers(False)
    for layer in layers:
        layer._documents = DocumentsFromMask()
    assert reads(layers, [first, second]) == [[1] * LAYERS] * 2


def test_inference_mode_tensors_are_derived_at_every_call(monkeypatch):
    """Tensors made under ``torch.inference_mode()`` (Megatron's generation) have no version counter (asking for it
    raises): their answers are derived at every call, not kept, as the engine's ``host_values`` reads them; the same
    answers as for ordinary tensors."""
    from megatron_ring.megatron.data.documents import DocumentsFromMask, document_mask

    made = []
    for name in ("_packed_cu_seqlens", "_documents"):
        real = getattr(documents, name)
        monkeypatch.setattr(documents, name, lambda *a, real=real, name=name: (made.append(name), real(*a))[1])
    tokens = torch.ones(1, 32, dtype=torch.long)
    tokens[0, 10] = 0
    params, mask = _params(True), document_mask(tokens, 0)[0]
    want_cu, want_rows = documents.packed_cu_seqlens(params).tolist(), DocumentsFromMask()(mask, None, "zigzag")
    with torch.inference_mode():
        params, mask = _params(True), document_mask(tokens, 0)[0]
    made.clear()
    reader = DocumentsFromMask()
    for _ in range(2):
        assert documents.packed_cu_seqlens(params).tolist() == want_cu
        assert reader(mask, None, "zigzag") == want_rows
    assert made == ["_packed_cu_seqlens", "_documents"] * 2


def test_an_answer_made_in_inference_mode_is_not_kept(one_rank_group, monkeypatch):  # noqa: F811
    """A layer called under ``torch.inference_mode()`` (generation) makes its answers there: they are not kept, so a
    later training call with the same params computes its own (tensors made in inference mode may not be used in
    autograd: Megatron's fused RoPE saves the angles for the backward), and gets the same outputs and gradients as a
    call that never saw inference mode. Negative control: kept, the training call would reuse the inference-mode
    angles (the count of computed angles tells)."""
    from megatron_ring.megatron.data import packed_rope
    from megatron_ring_lab.cpu import megatron_cpu

    made = []
    real = packed_rope._freqs
    monkeypatch.setattr(packed_rope, "_freqs", lambda *a: made.append(torch.is_inference_mode_enabled()) or real(*a))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 1, 4, 8, generator=g)
    k, v = (torch.randn(64, 1, 2, 8, generator=g) for _ in range(2))
    got = []
    for first_in_inference in (True, False):
        layer, params = _layers(True)[0], _params(True)
        with megatron_cpu():
            if first_in_inference:
                with torch.inference_mode():
                    layer(q, k, v, None, packed_seq_params=params)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = layer(*leaves, None, packed_seq_params=params)
            out.square().sum().backward()
        got.append([out.detach(), *(t.grad for t in leaves)])
    assert made == [True, False, False], made  # the training call made its own angles
    assert all(torch.equal(a, b) for a, b in zip(*got))
