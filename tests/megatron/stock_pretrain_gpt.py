"""A stock-style ``pretrain_gpt.py`` for the CI test of ``--spec megatron_ring.megatron.spec ring_layer_spec``.

Built the way Megatron-LM's ``pretrain_gpt.py`` (core_r0.19 / main) builds a run: ``parse_and_validate_args``
-> ``gpt_config_from_args`` (which imports ``--spec``) -> ``pretrain_cfg_container_from_args`` -> ``pretrain``;
Megatron's own ``get_batch_on_this_cp_rank`` (zigzag) and a ``pretrain_gpt``-style loss (masked sum and
token count; Megatron's schedule does the CP scaling). Nothing from megatron_ring is called here: the ring
comes in only through ``--spec``. The data set is the examples' deterministic learnable token stream (examples/pattern_data.py, no files).
CPU runs enter megatron_ring's scoped CPU opt-in (Megatron's loop assumes CUDA).

Env: ``MEGATRON_RING_LOSS_LOG``: one line per micro-batch on rank 0, loss sum and token count over DP x CP.
``MEGATRON_RING_MAX_LOGIT_LOG``: one line per iteration on rank 0, the max attention logit Megatron's QK-clip
logs (``clip_qk``'s return value, after its MAX all-reduce over DP x CP; ``--qk-clip`` / ``--log-max-attention-logit``).
``MEGATRON_RING_GRAD_LOG``: rank 0 saves (``torch.save``) the first step's final gradients, ``{name: main_grad}``
after Megatron's ``finalize_model_grads`` (reduced over DP x CP, scaled as the optimizer sees them).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from functools import partial

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
from pattern_data import PatternDataset  # noqa: E402  (the examples' synthetic data: no megatron_ring)


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    vocab = args.vocab_size or args.padded_vocab_size
    return tuple(PatternDataset(max(int(n), 1), args.seq_length, vocab, args.seed + k)
                 for k, n in enumerate(num_samples))


datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    log = os.environ.get("MEGATRON_RING_LOSS_LOG")
    if log:
        stats = torch.stack([loss.detach().double(), mask.sum().double()])
        dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
        if dist.get_rank() == 0:
            with open(log, "a") as f:
                f.write(f"{stats[0].item():.17g} {stats[1].item():.17g}\n")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    batch = get_batch_on_this_cp_rank(batch, False, cp_group=ps.get_context_parallel_group())  # zigzag
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def log_first_step_grads(path: str) -> None:
    """Wrap Megatron-LM's ``finalize_model_grads`` (installed as ``config.finalize_model_grads_func`` by
    ``pretrain``'s setup) so that its first call also saves the final gradients on rank 0."""
    import megatron.training.training as training

    original, done = training.finalize_model_grads, []

    def finalize_model_grads(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        if not done:
            done.append(True)
            if dist.get_rank() == 0:
                torch.save({name: p.main_grad.detach().double().cpu().clone() for chunk in model
                            for name, p in chunk.named_parameters() if getattr(p, "main_grad", None) is not None},
                           path)
        return out

    training.finalize_model_grads = finalize_model_grads


def log_max_attention_logit(path: str) -> None:
    """Wrap the ``clip_qk`` Megatron-LM's ``train_step`` calls so that rank 0 also writes the value it returns
    (the max attention logit over the model, reduced over DP x CP) to ``path``, one line per iteration."""
    import megatron.training.training as training

    original = training.clip_qk

    def clip_qk(model, *args, **kwargs):
        value = original(model, *args, **kwargs)
        if dist.get_rank() == 0:
            with open(path, "a") as f:
                f.write(f"{float(value):.17g}\n")
        return value

    training.clip_qk = clip_qk


def main(config_from_args=gpt_config_from_args, forward=None, datasets=None) -> None:
    """``config_from_args``: Megatron-LM's model-config builder (``gpt_config_from_args`` for pretrain_gpt.py,
    ``hybrid_config_from_args`` for pretrain_hybrid.py: tests/megatron/stock_pretrain_hybrid.py); ``forward`` /
    ``datasets``: the forward step and data sets provider (default: this file's BSHD ones)."""
    forward = forward or forward_step
    datasets = datasets or datasets_provider
    if os.environ.get("MEGATRON_RING_MAX_LOGIT_LOG"):
        log_max_attention_logit(os.environ["MEGATRON_RING_MAX_LOGIT_LOG"])
    if os.environ.get("MEGATRON_RING_GRAD_LOG"):
        log_first_step_grads(os.environ["MEGATRON_RING_GRAD_LOG"])
    cpu = contextlib.nullcontext()
    if not torch.cuda.is_available():
        from megatron_ring_lab.cpu.training import megatron_training_cpu, training_cpu_enabled

        if not training_cpu_enabled():  # already entered when run as `-m megatron_ring_lab.cpu`
            cpu = megatron_training_cpu()
    with cpu:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        model_cfg = config_from_args(args)  # imports --spec, as pretrain_gpt.py / pretrain_hybrid.py do
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), datasets,
                 ModelType.encoder_or_decoder, forward)


if __name__ == "__main__":
    main()
