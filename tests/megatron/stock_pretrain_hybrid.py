"""A stock-style ``pretrain_hybrid.py`` for the CI tests of
``--spec megatron_ring.megatron.spec ring_hybrid_stack_spec``.

Built the way Megatron-LM's ``pretrain_hybrid.py`` (core_r0.19 / main) builds a run: ``parse_and_validate_args``
-> ``hybrid_config_from_args`` (which imports ``--spec`` as the hybrid stack spec) ->
``pretrain_cfg_container_from_args`` -> ``pretrain`` (``HybridModelBuilder``); a ``pretrain_hybrid``-style loss
(masked sum and token count; Megatron's schedule does the CP scaling). Nothing from megatron_ring is called here
but through ``--spec`` (and the CPU opt-in on machines without CUDA). Data: the examples' deterministic
learnable token stream.

* BSHD (default): Megatron's own ``get_batch_on_this_cp_rank`` (zigzag), as tests/megatron/stock_pretrain_gpt.py.
* Packed THD (``--sft`` or ``--dataloader-inter-document-masking``): ``get_batch`` / ``forward_step`` make the calls
  of stock ``pretrain_hybrid.py`` (main and core_v0.19.0 alike): ``get_batch_on_this_tp_rank(has_cu_seqlens=True)``
  -> ``flatten_batch_for_packed_sequences`` -> ``get_batch_on_this_cp_rank(use_per_sequence_balancing=
  dataloader_inter_document_masking and not sft)`` -> ``PackedSeqParams(qkv_format="thd", ...)`` -> the model
  with ``packed_seq_params`` and ``loss_mask``. The samples carry documents in the formats of Megatron's own
  data sets: ``--sft`` as ``SFTDataset`` returns them (each document padded with filler to a multiple of
  ``DOC_ALIGN`` = 8 = 2 x CP for CP up to 4, the filler inside the document's boundaries, loss-masked, positions
  running on; padded for CP = 4 at every CP so that every CP size trains on the same tokens);
  ``--dataloader-inter-document-masking`` as ``GPTDataset`` returns them (unpadded documents of any length,
  position ids restarting per document). Per sample: ``cu_seqlens`` right-padded with ``seq_length`` to
  ``seq_length + 1`` entries, and ``max_seqlen``.

Env: ``MEGATRON_RING_LOSS_LOG``: one line per micro-batch on rank 0, loss sum and token count over DP x CP.
``MEGATRON_RING_TEST_MISSPLIT=1`` (the tests' negative control only): split the packed batch per document
although the arguments say the stream split, i.e. hand the model tokens in another order than the one the
arguments announce.
"""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stock_pretrain_gpt as stock  # noqa: E402  (the same run; only the model-config builder differs)

import torch  # noqa: E402

from megatron.core import mpu  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.parallel_state import get_context_parallel_group  # noqa: E402
from megatron.core.utils import (flatten_batch_for_packed_sequences, get_batch_on_this_cp_rank,  # noqa: E402
                                 get_batch_on_this_tp_rank)
from megatron.training import get_args  # noqa: E402
from megatron.training.argument_utils import hybrid_config_from_args  # noqa: E402

from pattern_data import PatternDataset  # noqa: E402  (on the path: stock_pretrain_gpt adds examples/)

DOC_ALIGN = 8  # --sft documents are padded to a multiple of 2 x CP; 8 serves CP = 1, 2 and 4 with one data set
BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]


def packed(args) -> bool:
    return bool(args.sft or args.dataloader_inter_document_masking)


class PackedDocuments(torch.utils.data.Dataset):
    """Samples of ``PatternDataset`` cut into documents, in ``SFTDataset``'s format (``sft``: each document
    padded to a multiple of ``DOC_ALIGN`` with loss-masked filler) or ``GPTDataset``'s with
    ``inter_document_masking`` (unpadded documents, odd lengths included)."""

    def __init__(self, n: int, seq_length: int, vocab: int, seed: int, sft: bool):
        self.base, self.s, self.seed, self.sft = PatternDataset(n, seq_length, vocab, seed), seq_length, seed, sft

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict:
        out = self.base[i]
        g = torch.Generator().manual_seed(self.seed * 7_919 + i)
        cu, pos = [0], []
        while cu[-1] < self.s:
            real = int(torch.randint(3, 22, (1,), generator=g))
            slot = -(-real // DOC_ALIGN) * DOC_ALIGN if self.sft else real
            slot = min(slot, self.s - cu[-1])
            real = min(real, slot)
            if self.sft:  # SFTDataset: filler after the document, inside its boundaries, positions run on
                lo = cu[-1] + real
                out["tokens"][lo:cu[-1] + slot] = 0
                out["labels"][lo - 1:cu[-1] + slot] = 0
                out["loss_mask"][lo - 1:cu[-1] + slot] = 0.0  # the last real token's label is filler
            pos.append(torch.arange(slot))
            cu.append(cu[-1] + slot)
        out["position_ids"] = torch.cat(pos)
        out["cu_seqlens"] = torch.full((self.s + 1,), self.s, dtype=torch.int32)
        out["cu_seqlens"][:len(cu)] = torch.tensor(cu, dtype=torch.int32)
        lens = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        out["max_seqlen"] = lens.max().to(torch.int32)
        return out


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    if not packed(args):
        return stock.datasets_provider(num_samples, vp_stage)
    vocab = args.vocab_size or args.padded_vocab_size
    return tuple(PackedDocuments(max(int(n), 1), args.seq_length, vocab, args.seed + k, bool(args.sft))
                 for k, n in enumerate(num_samples))


datasets_provider.is_distributed = True


def get_batch(data_iterator):
    """Stock ``pretrain_hybrid.get_batch`` (no pipeline / MTP / hybrid CP: those branches are not taken)."""
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            batch[key] = batch[key].cuda(non_blocking=True) if key in batch and batch[key] is not None else None
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=True, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = flatten_batch_for_packed_sequences(batch)
    per_sequence = args.dataloader_inter_document_masking and not args.sft
    if os.environ.get("MEGATRON_RING_TEST_MISSPLIT") == "1":
        per_sequence = not per_sequence
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group(),
                                      use_per_sequence_balancing=per_sequence)
    return [batch[key] for key in BATCH_KEYS]


def forward_step(data_iterator, model):
    """Stock ``pretrain_hybrid.forward_step``'s packed path (``PackedSeqParams`` as it builds them)."""
    args = get_args()
    if not packed(args):
        return stock.forward_step(data_iterator, model)
    (attention_mask, cu_seqlens, cu_seqlens_padded, hybrid_cp_group, labels, local_cp_size, loss_mask,
     max_seqlen, position_ids, tokens) = get_batch(data_iterator)
    cu_seqlens = cu_seqlens.squeeze(0)
    if cu_seqlens_padded is not None:
        cu_seqlens_padded = cu_seqlens_padded.squeeze(0)
    cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_seqlens_padded,
                             cu_seqlens_kv_padded=cu_seqlens_padded, max_seqlen_q=int(max_seqlen.item()),
                             max_seqlen_kv=int(max_seqlen.item()), local_cp_size=None, cp_group=hybrid_cp_group,
                             total_tokens=int(cu[-1].item()), tokens_per_sample=args.seq_length)
    output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=params, loss_mask=loss_mask)
    return output, partial(stock.loss_func, loss_mask)


if __name__ == "__main__":
    stock.main(hybrid_config_from_args, forward_step, datasets_provider)
