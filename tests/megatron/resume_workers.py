"""Worker for tests/megatron/test_resume_cp.py's Megatron-Core loop (any megatron-core, 0.16.1 included).

Run under torchrun (megatron-core's checkpoint writer forks writer processes, which daemonic
multiprocessing workers may not): ``torchrun --nproc-per-node CP resume_workers.py CP CKPT START STOP
SAVE_AT|-1 LOAD_RNG(0|1) OUT.json``; rank 0 writes the per-step losses to OUT.json.

A ring-attention ``GPTModel`` (attention dropout ON) trained with AdamW for steps [start, stop); the
checkpoint is Megatron's ``dist_checkpointing`` (``torch_dist``): the model as sharded tensors (replicated
over CP), and as common state the AdamW state and the RNG states, identical on every CP rank (the tracker
is seeded the same at every CP size; gradients are all-reduced over DP x CP), as Megatron-LM's
``get_rng_state`` stores them per (PP, TP) rank.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_workers import make_batch

MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab=128, seq=64,
             micro_batch=2, seed=1234, data_seed=7, lr=5e-3, data_cycle=2, attention_dropout=0.1)


def _build(m: dict, cp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ring.megatron import get_gpt_layer_ring_spec, use_layout_rope

    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=2 * m["hidden_size"], context_parallel_size=cp,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=m["attention_dropout"],
        params_dtype=torch.float32, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True)
    torch.manual_seed(m["seed"])
    model = GPTModel(config, get_gpt_layer_ring_spec(normalization="RMSNorm"), vocab_size=m["vocab"],
                     max_sequence_length=m["seq"], position_embedding_type="rope")
    use_layout_rope(model)
    return model


@contextlib.contextmanager
def _cpu_checkpointing() -> Iterator[None]:
    """Scoped CPU stand-ins for megatron-core's checkpoint writer: it calls ``torch.cuda.synchronize()``
    before copying tensors (a no-op on CPU) and puts its failure flag on ``torch.cuda.current_device()``
    (the CPU here)."""
    saved = [(torch.cuda, "synchronize", torch.cuda.synchronize),
             (torch.cuda, "current_device", torch.cuda.current_device)]
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def resume_worker(rank: int, cp: int, ckpt: str, start: int, stop: int, save_at: int | None,
                  load_rng: bool = True) -> list[float]:
    """Train steps [start, stop) at CP = ``cp`` (loading ``ckpt`` when start > 0, saving it after step
    ``save_at``); returns the per-step loss (mean over the full sequence, reduced over CP)."""
    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import (RingConfig, allreduce_gradients, destroy_context_parallel, get_batch_on_this_cp_rank, initialize_context_parallel, reduce_loss_over_cp)
    from megatron_ring_lab.cpu import megatron_cpu

    m = MODEL
    with megatron_cpu(), _cpu_checkpointing():
        try:
            initialize_context_parallel(RingConfig(context_parallel_size=cp), seq_length=m["seq"])
            tensor_parallel.model_parallel_cuda_manual_seed(m["seed"], force_reset_rng=True)
            model = _build(m, cp)
            opt = torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0)
            if start > 0:
                loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
                opt.load_state_dict(loaded.pop("optimizer"))
                tracker, cpu_rng = loaded.pop("rng_tracker_states"), loaded.pop("torch_rng_state")
                if load_rng:
                    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
                    torch.set_rng_state(cpu_rng)
                model.load_state_dict(loaded)
            model.train()
            losses = []
            for step in range(start, stop):
                opt.zero_grad(set_to_none=True)
                mine = get_batch_on_this_cp_rank(make_batch(m, step, m["micro_batch"]))
                tok = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
                red = reduce_loss_over_cp(tok, mine["loss_mask"])
                red.loss.backward()
                allreduce_gradients(model)
                opt.step()
                losses.append(float(red.reported))
                if save_at is not None and step + 1 == save_at:
                    if rank == 0:
                        os.makedirs(ckpt, exist_ok=True)
                    dist.barrier()
                    state: dict[str, Any] = model.sharded_state_dict()
                    state["optimizer"] = opt.state_dict()
                    state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
                    state["torch_rng_state"] = torch.get_rng_state()
                    dist_checkpointing.save(state, ckpt)
            return losses
        finally:
            destroy_context_parallel()
            ps.destroy_model_parallel()


def main(argv: list[str]) -> None:
    import datetime
    import json

    cp, ckpt, start, stop, save_at, load_rng, out = argv
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        save = int(save_at)
        losses = resume_worker(dist.get_rank(), int(cp), ckpt, int(start), int(stop), save if save >= 0 else None,
                               load_rng == "1")
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(losses, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
