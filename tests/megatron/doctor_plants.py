"""Test-only training script for the doctor's planted-bug suite (tests/megatron/test_doctor_plants.py).

``stock_pretrain_gpt.py`` (Megatron's own pretrain(), zigzag split, ``--spec`` ring) with documents and
padding in every sample: an attention mask with document boundaries at positions 20 and 40
(``--reset-attention-mask`` style: causal within documents) and the loss masked on the last 8 tokens, run
with ``--calculate-per-token-loss``. ``DOCTOR_TEST_PLANT`` plants one CP bug, active only at CP > 1 (so the
CP=1 run is the clean one), as each appears in real code:

* ``document``: CP rank ``cp - 1`` builds its attention-mask rows without the boundary at 20 (a document
  boundary dropped on one rank);
* ``loss_norm``: each CP rank divides its loss sum by its own token count (times the mean count, so the
  scale stays): a loss normalised per CP rank; the reported loss is left correct;
* ``rope``: each rank takes the rotary table slice of the next CP rank (RoPE positions of the wrong rank);
* ``unreduced``: ``decoder.final_layernorm.weight`` keeps its rank-local gradient (a gradient not reduced
  over CP);
* ``report``: the reported loss dict gives each rank's token count divided by the CP size (the logged
  ``lm loss`` becomes CP x the true one; training untouched: a reporting-only bug);
* unset / ``none``: the clean control.
"""
from __future__ import annotations

import contextlib
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stock_pretrain_gpt as stock  # noqa: E402  (its data set and warnings filter)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training import pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

PLANT = os.environ.get("DOCTOR_TEST_PLANT", "none")
BOUNDARIES, PADDING = (20, 40), 8
_planted = False


def _mask(S: int, starts: tuple[int, ...]) -> torch.Tensor:
    """[1, 1, S, S] bool, True = hidden: causal within the documents starting at 0 and ``starts``."""
    doc = torch.zeros(S, dtype=torch.long)
    for s in starts:
        doc[s:] += 1
    i = torch.arange(S)
    visible = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    return (~visible)[None, None]


class _NextRank:
    """A CP group that answers with the next rank (the RoPE plant)."""

    def __init__(self, group):
        self.group = group

    def size(self) -> int:
        return self.group.size()

    def rank(self) -> int:
        return (self.group.rank() + 1) % self.group.size()


def _plant_once(model) -> None:
    global _planted
    if _planted or ps.get_context_parallel_world_size() == 1:
        return
    _planted = True
    if PLANT == "rope":
        from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe

        real = rpe.get_pos_emb_on_this_cp_rank
        rpe.get_pos_emb_on_this_cp_rank = lambda emb, dim, group: real(emb, dim, _NextRank(group))
    if PLANT == "unreduced":
        chunk = model
        inner = chunk
        while hasattr(inner, "module"):
            inner = inner.module
        param = dict(inner.named_parameters())["decoder.final_layernorm.weight"]
        sync = chunk.finish_grad_sync

        def finish_grad_sync(*args, **kwargs):
            local = param.main_grad.clone()
            out = sync(*args, **kwargs)
            param.main_grad.copy_(local)  # the reduction over DP x CP undone for this parameter
            return out
        chunk.finish_grad_sync = finish_grad_sync


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    if PLANT == "report" and ps.get_context_parallel_world_size() > 1:
        report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1) / ps.get_context_parallel_world_size()])
    if PLANT == "loss_norm" and ps.get_context_parallel_world_size() > 1:
        total = num_tokens.clone().float()
        dist.all_reduce(total, group=ps.get_context_parallel_group())
        loss = loss / num_tokens.clamp(min=1) * (total / ps.get_context_parallel_world_size())
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    _plant_once(model)
    batch = next(data_iterator)
    b, S = batch["tokens"].shape
    batch["loss_mask"][:, S - PADDING:] = 0
    batch["attention_mask"] = _mask(S, BOUNDARIES).expand(b, 1, S, S).contiguous()
    wrong = _mask(S, BOUNDARIES[1:]).expand(b, 1, S, S).contiguous() if PLANT == "document" else None
    cp_group = ps.get_context_parallel_group()
    local = get_batch_on_this_cp_rank(batch, False, cp_group=cp_group)
    if wrong is not None and ps.get_context_parallel_world_size() > 1 \
            and ps.get_context_parallel_rank() == ps.get_context_parallel_world_size() - 1:
        local["attention_mask"] = get_batch_on_this_cp_rank({"attention_mask": wrong}, False,
                                                            cp_group=cp_group)["attention_mask"]
    output = model(local["tokens"], local["position_ids"], local["attention_mask"], labels=local["labels"])
    return output, partial(loss_func, local["loss_mask"])


def main() -> None:
    from megatron_ring_lab.cpu.training import megatron_training_cpu, training_cpu_enabled

    cpu = contextlib.nullcontext() if torch.cuda.is_available() or training_cpu_enabled() else megatron_training_cpu()
    with cpu:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), stock.datasets_provider,
                 ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
