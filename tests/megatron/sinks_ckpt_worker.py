"""Worker for tests/megatron/test_sinks_checkpoint.py: learnable attention sinks through Megatron's distributed
checkpointing at TP = 2 x CP = 2, loaded back at TP = 2 and at TP = 1.

``torchrun --nproc-per-node 4 sinks_ckpt_worker.py CKPT MODE OUT.json`` (torchrun: megatron-core's checkpoint
writer forks writer processes). ``MODE``: ``ring`` (``RingDotProductAttention.sharded_state_dict``) or
``replicated`` (the negative control: the module saved by ``MegatronModule``'s default, i.e. as a tensor
replicated over TP, which it is not).

Every layer's ``softmax_offset`` holds ``[heads / tp]`` heads on each TP rank; before saving, global head
``g`` of layer ``l`` is set to ``10 * l + g + 0.5`` (every value distinct). Rank 0 writes, for the TP = 2
load, every rank's local offsets (gathered) and, for the TP = 1 load, its full offsets, or the error text.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

HEADS, LAYERS = 4, 2


def expected(layer: int, heads: slice) -> list[float]:
    return [10.0 * layer + g + 0.5 for g in range(HEADS)[heads]]


def _build(tp: int, cp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ring.megatron import get_gpt_layer_ring_spec

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, num_attention_heads=HEADS, num_query_groups=2, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, context_parallel_size=cp, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, add_bias_linear=False, softmax_type="learnable")
    torch.manual_seed(1)
    return GPTModel(config, get_gpt_layer_ring_spec(), vocab_size=128, max_sequence_length=64)


def _offsets(model) -> list[torch.Tensor]:
    """Every layer's ``softmax_offset`` parameter (this rank's heads), layer order."""
    from megatron_ring.megatron import RingDotProductAttention

    found = [m.softmax_offset for m in model.modules() if isinstance(m, RingDotProductAttention)]
    assert len(found) == LAYERS and all(p is not None for p in found), found
    return found


def _in_parallel_state(tp: int, cp: int, fn):
    from megatron.core import parallel_state as ps

    from megatron_ring.megatron import RingConfig, destroy_context_parallel, initialize_context_parallel

    initialize_context_parallel(RingConfig(context_parallel_size=cp), seq_length=64, tensor_model_parallel_size=tp)
    try:
        return fn(ps.get_tensor_model_parallel_rank())
    finally:
        destroy_context_parallel()
        ps.destroy_model_parallel()


def run(ckpt: str, mode: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.module import MegatronModule

    from megatron_ring.megatron import RingDotProductAttention
    from megatron_ring_lab.cpu import megatron_cpu
    from resume_workers import _cpu_checkpointing

    if mode == "replicated":
        RingDotProductAttention.sharded_state_dict = MegatronModule.sharded_state_dict
    out: dict = {}
    with megatron_cpu(), _cpu_checkpointing():
        def save(tp_rank: int) -> None:
            model = _build(2, 2)
            per = HEADS // 2
            with torch.no_grad():
                for layer, p in enumerate(_offsets(model)):
                    p.copy_(torch.tensor(expected(layer, slice(tp_rank * per, (tp_rank + 1) * per))))
            if dist.get_rank() == 0:
                os.makedirs(ckpt, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), ckpt)

        def load(tp: int):
            def body(tp_rank: int):
                model = _build(tp, 2)
                with torch.no_grad():
                    for p in _offsets(model):
                        p.fill_(-1.0)
                model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
                return [p.tolist() for p in _offsets(model)], tp_rank
            return body

        _in_parallel_state(2, 2, save)
        for tp in (2, 1):
            try:
                local = _in_parallel_state(tp, 2, load(tp))
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, local)
                out[f"tp{tp}"] = gathered
            except BaseException:  # noqa: BLE001 - reported (the negative control may fail; CheckpointException is a BaseException)
                out[f"tp{tp}"] = traceback.format_exc()[-3000:]
    return out


def main(argv: list[str]) -> None:
    import datetime

    ckpt, mode, path = argv
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        torch.set_num_threads(1)
        result = run(ckpt, mode)
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
