"""Megatron-LM's own training loop with ring attention at EVERY context-parallel size, CP = 1 included.

examples/pretrain_ring_gpt.py uses Megatron's own attention at CP = 1 (the reference for parity tests).
This script always uses ring attention, so a run can be saved at one CP size with Megatron's distributed
checkpointing (``--save DIR --ckpt-format torch_dist``) and resumed at another (``--load DIR``), CP = 1
included, with attention dropout ON: the ring's dropout mask depends only on (seed, layer, head, global
positions), so it is the same at every CP size, and Megatron checkpoints the RNG tracker it is drawn from
per (PP, TP) rank, shared over DP x CP. See docs/megatron-runs.md, "Resume at another CP size"::

    # CP = 4, save at iteration 4 (and at the end):
    torchrun --nproc-per-node 4 examples/pretrain_ring_gpt_any_cp.py --context-parallel-size 4 \\
        --save ckpt --save-interval 4 --ckpt-format torch_dist <model, training and CPU flags>
    # resume at CP = 2 from iteration 4:
    torchrun --nproc-per-node 2 examples/pretrain_ring_gpt_any_cp.py --context-parallel-size 2 \\
        --load ckpt --ckpt-step 4 --ckpt-format torch_dist <the same flags>

The model provider, data, forward step and CP-aware loss are examples/pretrain_ring_gpt.py's (imported,
not copied), with its switch ``RING_AT_EVERY_CP_SIZE`` on.
"""
from __future__ import annotations

import contextlib
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pretrain_ring_gpt as base  # noqa: E402  (sets the environment and warning filters first)
import torch  # noqa: E402

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import pretrain  # noqa: E402

from megatron_ring.megatron import add_context_parallel_args  # noqa: E402
from megatron_ring.megatron import compat  # noqa: E402
from megatron_ring_lab.cpu.training import megatron_training_cpu  # noqa: E402


def main() -> None:
    base.RING_AT_EVERY_CP_SIZE = True
    cpu = contextlib.nullcontext() if torch.cuda.is_available() else megatron_training_cpu()
    with cpu:
        compat.run_pretrain(pretrain, base.train_valid_test_datasets_provider, base.model_provider,
                            ModelType.encoder_or_decoder, base.forward_step, extra_args_provider=add_context_parallel_args,
                            args_defaults={"tokenizer_type": "NullTokenizer"})


if __name__ == "__main__":
    main()
