"""Single-process checks: arguments, config validation, CPU opt-in scoping, batch split, layout RoPE."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from megatron_ring.megatron import (ContextParallelConfigError, LayoutRotaryEmbedding, RingConfig, add_context_parallel_args, config_from_args, get_batch_on_this_cp_rank, initialize_context_parallel)
from megatron_ring_lab.cpu import cpu_support_enabled, megatron_cpu


class FakeGroup:
    """Just enough of a ProcessGroup for code that asks size() and rank()."""

    def __init__(self, size: int, rank: int):
        self._s, self._r = size, rank

    def size(self) -> int:
        return self._s

    def rank(self) -> int:
        return self._r


def _megatron_lm_like_parser() -> argparse.ArgumentParser:
    """The three CP flags exactly as Megatron-LM (core_v0.16.1) defines them."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    p.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    return p


def test_args_added_only_where_missing():
    p = add_context_parallel_args(_megatron_lm_like_parser())  # must not raise "conflicting option string"
    a = p.parse_args(["--context-parallel-size", "4", "--cp-layout", "striped", "--cp-comm-dtype", "fp8",
                      "--seq-length", "64"])
    cfg = config_from_args(a, world_size=8)
    assert (cfg.context_parallel_size, cfg.layout, cfg.comm_dtype) == (4, "striped", "fp8")
    assert cfg.torch_comm_dtype == torch.float8_e4m3fn and cfg.cp_comm_type == ("p2p",)
    fresh = add_context_parallel_args(argparse.ArgumentParser())
    d = fresh.parse_args([])
    assert (d.context_parallel_size, d.cp_comm_type, d.cp_comm_dtype, d.cp_layout,
            d.hierarchical_context_parallel_sizes) == (1, ["p2p"], "none", "zigzag", None)
    with pytest.raises(SystemExit):  # argparse rejects unknown choices itself
        fresh.parse_args(["--cp-layout", "diagonal"])


@pytest.mark.parametrize("kwargs,flag", [
    (dict(context_parallel_size=0), "--context-parallel-size"),
    (dict(layout="diagonal"), "--cp-layout"),
    (dict(comm_dtype="fp4"), "--cp-comm-dtype"),
    (dict(cp_comm_type=["p2p", "ulysses"]), "--cp-comm-type"),
    (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]), "--hierarchical-context-parallel-sizes"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ContextParallelConfigError) as e:
        RingConfig(**kwargs)
    assert e.value.flag == flag and str(e.value).startswith(flag)


@pytest.mark.parametrize("layout,seq,ok", [("zigzag", 64, True), ("zigzag", 60, False), ("striped", 60, True),
                                           ("contiguous", 60, True), ("striped", 62, False)])
def test_seq_length_divisibility_per_layout(layout, seq, ok):
    cfg = RingConfig(context_parallel_size=4, layout=layout)
    if ok:
        cfg.validate(seq_length=seq, world_size=4)
    else:
        with pytest.raises(ContextParallelConfigError, match="--seq-length"):
            cfg.validate(seq_length=seq, world_size=4)


def test_error_survives_single_argument_reraise():
    e = ContextParallelConfigError("--cp-layout", "bad")
    again = type(e)(f"{e} when instantiating TransformerLayer")  # what Megatron's build_module does
    assert again.flag == "--cp-layout"


def test_initialize_before_init_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        initialize_context_parallel(context_parallel_size=1)


def test_cpu_opt_in_is_scoped_and_nests():
    from megatron.core import utils as mutils
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    def snapshot():
        return (mutils.GlobalMemoryBuffer.get_tensor, rope_utils.get_pos_emb_on_this_cp_rank,
                rotary_pos_embedding.get_pos_emb_on_this_cp_rank, rotary_pos_embedding.RotaryEmbedding.get_emb,
                tutils.get_default_causal_mask, mrandom.CudaRNGStatesTracker, mrandom._CUDA_RNG_STATE_TRACKER)

    before = snapshot()
    with megatron_cpu():
        inside = snapshot()
        assert all(a is not b for a, b in zip(before[:6], inside[:6]))
        with megatron_cpu():
            assert snapshot() == inside
        assert cpu_support_enabled() and snapshot() == inside
        buf = mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
        assert buf.device.type == "cpu" and buf.shape == (2, 3)
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.add("t", 5)
        torch.manual_seed(0)
        with tracker.fork("t"):
            a = torch.rand(3)
        b = torch.rand(3)
        torch.manual_seed(5)
        assert torch.equal(a, torch.rand(3))  # the fork used the tracked seed...
        torch.manual_seed(0)
        assert torch.equal(b, torch.rand(3))  # ...and left the default stream untouched
    assert snapshot() == before and not cpu_support_enabled()


def _batch(b=2, s=16):
    tok = torch.arange(b * s).view(b, s)
    return dict(tokens=tok, labels=tok + 1000, loss_mask=torch.ones(b, s), position_ids=torch.arange(s).expand(b, s),
                attention_mask=torch.triu(torch.ones(b, 1, s, s, dtype=torch.bool), 1), other=None, n=3)


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_batch_split_covers_the_sequence_once(layout):
    full, cp = _batch(), 4
    parts = [get_batch_on_this_cp_rank(full, layout=layout, cp_size=cp, cp_rank=r) for r in range(cp)]
    pos = torch.cat([p["position_ids"][0] for p in parts])
    assert sorted(pos.tolist()) == list(range(16))
    for p in parts:
        assert torch.equal(p["tokens"], full["tokens"][:, p["position_ids"][0]])
        assert torch.equal(p["labels"], full["labels"][:, p["position_ids"][0]])
        assert p["attention_mask"].shape == (2, 1, 4, 16)
        assert torch.equal(p["attention_mask"], full["attention_mask"][:, :, p["position_ids"][0]])
        assert p["other"] is None and p["n"] == 3
    if layout == "striped":
        assert parts[1]["position_ids"][0].tolist() == [1, 5, 9, 13]


def test_zigzag_split_equals_megatrons_own_helper(tmp_path, monkeypatch):
    # Megatron's own helper, called through compat (its signature moved in 0.17+: is_hybrid_cp)
    from megatron_ring.megatron.compat import megatron_get_batch_on_this_cp_rank as megatron_split

    # Megatron's helper only splits when torch.distributed is initialised: a 1-process gloo group
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    # 0.17+ asks torch.distributed for the group's size/rank: answer for the stand-in group
    for name, attr in (("get_world_size", "size"), ("get_rank", "rank")):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda group=None, _real=real, _attr=attr:
                            getattr(group, _attr)() if isinstance(group, FakeGroup) else _real(group))
    try:
        _compare_with_megatron_split(megatron_split)
    finally:
        dist.destroy_process_group()


def _compare_with_megatron_split(megatron_split):
    for r in range(2):
        ours = get_batch_on_this_cp_rank(_batch(), layout="zigzag", cp_size=2, cp_rank=r)
        theirs = megatron_split({k: v for k, v in _batch().items() if isinstance(v, torch.Tensor)},
                                cp_group=FakeGroup(2, r))
        tensors = {k for k, v in _batch().items() if isinstance(v, torch.Tensor)}
        assert set(theirs) == tensors, (sorted(theirs), sorted(tensors))  # nothing compared would pass vacuously
        assert theirs["tokens"].shape[1] == _batch()["tokens"].shape[1] // 2  # Megatron really split the sequence
        for k, v in theirs.items():
            assert torch.equal(ours[k], v), k


def test_layout_rope_zigzag_equals_megatron_and_striped_takes_its_positions():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    with megatron_cpu():
        for r in range(2):
            ref = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True,
                                  cp_group=FakeGroup(2, r))
            full = ref.get_emb(32)
            ours = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True,
                                   cp_group=FakeGroup(2, r))
            ours.__class__ = LayoutRotaryEmbedding
            ours.ring_layout = "zigzag"
            assert torch.equal(ours(32), ref(32))
            ours.ring_layout = "striped"
            assert torch.equal(ours(32), full[r::2])


def test_reduce_loss_over_cp_takes_cp_group_and_warns_on_the_old_name(tmp_path):
    """A 1-process gloo group as the CP group; ``group=`` is the deprecated spelling of ``cp_group=``."""
    import warnings

    from megatron_ring.megatron import reduce_loss_over_cp

    losses, mask = torch.tensor([[1.0, 3.0, 5.0]]), torch.tensor([[1, 1, 0]])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = reduce_loss_over_cp(losses, mask, cp_group=dist.group.WORLD)
        with pytest.warns(DeprecationWarning, match="cp_group"):
            old = reduce_loss_over_cp(losses, mask, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert float(new.reported) == float(old.reported) == 2.0
    assert float(new.num_tokens) == 2.0
