"""The learnable synthetic data of the pretrain() examples and tests (no files, no download).

Sample i is an arithmetic token sequence mod V with a per-sample start and stride and 10% random tokens.
With ``documents=True`` every sample also carries ``cu_seqlens``: three documents whose lengths are
multiples of ``DOC_ALIGN`` (so zigzag splits each evenly over groups of up to 4 ranks), as Megatron's
hybrid-CP data path needs.
"""
from __future__ import annotations

import torch

DOC_ALIGN = 8


class PatternDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_length: int, vocab: int, seed: int, documents: bool = False):
        self.n, self.s, self.v, self.seed, self.documents = n, seq_length, vocab, seed, documents

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start, stride = torch.randint(0, self.v, (2,), generator=g).tolist()
        seq = (start + (stride % 7 + 1) * torch.arange(self.s + 1)) % self.v
        noise = torch.rand(self.s + 1, generator=g) < 0.1  # 10% random tokens keep it from being trivial
        seq = torch.where(noise, torch.randint(0, self.v, (self.s + 1,), generator=g), seq)
        out = {"tokens": seq[:-1].clone(), "labels": seq[1:].clone(),
               "loss_mask": torch.ones(self.s), "position_ids": torch.arange(self.s)}
        if self.documents:
            slots = self.s // DOC_ALIGN  # three documents (two cuts), each a multiple of DOC_ALIGN tokens long
            cut = sorted(torch.randperm(slots - 1, generator=g)[:2].add(1).mul(DOC_ALIGN).tolist())
            out["cu_seqlens"] = torch.tensor([0, *cut, self.s], dtype=torch.int32)
        return out
