"""Cost model, planner CLI and ``comm_type="auto"`` (agreement across ranks, logging, caching)."""
import json
import logging
import os

import pytest
import torch

from tests.helpers.launch import run_distributed
from tests.helpers.numerics import F64_REL
from megatron_ring_lab import planner as plan
from megatron_ring.planning.cost_model import (Machine, Problem, activation_bytes, predict, predict_all, smallest_cp,
                                                 workspace_bytes)

ISSUE_EXAMPLE = ["--seq-length", "1048576", "--hidden-size", "8192", "--num-attention-heads", "64",
                 "--num-query-groups", "8", "--context-parallel-size", "32", "--gpus-per-node", "8",
                 "--intra-node-bandwidth", "450e9", "--inter-node-bandwidth", "50e9", "--flops", "700e12"]


def test_activation_memory_is_the_seed_rule_for_mha_bf16():
    pb = Problem(batch=1, seq=8192, heads=8, kv_heads=8, head_dim=128, elem_bytes=2)
    c, d = 8192 // 4, 8 * 128
    assert activation_bytes(pb, 4) == 12 * c * d
    gqa = Problem(batch=1, seq=8192, heads=8, kv_heads=2, head_dim=128, elem_bytes=2, wire_bytes=1.0)
    assert activation_bytes(gqa, 4) < activation_bytes(pb, 4)


def test_causal_skipping_and_seed_rule():
    m = Machine(flops=1e12, bw_intra=1e15, latency=0.0)  # transfers free: compute only
    kw = dict(batch=1, seq=16384, heads=8, kv_heads=8, head_dim=64, layout="zigzag")
    full = predict("p2p", Problem(causal=False, **kw), 4, m)["time_s"]
    causal = predict("p2p", Problem(causal=True, **kw), 4, m)["time_s"]
    assert 0.45 < causal / full < 0.6  # zigzag: every step about half a block
    contiguous = predict("p2p", Problem(causal=True, **{**kw, "layout": "contiguous"}), 4, m)["time_s"]
    assert contiguous > 1.5 * causal  # the unbalanced layout waits for its busiest rank
    # seed rule: a ring step hides its transfer when compute per step >= transfer per step
    slow = Machine(flops=1e12, bw_intra=1e6, latency=0.0)
    assert predict("p2p", Problem(causal=False, **kw), 4, slow)["time_s"] > 10 * full


def test_planner_cli_on_the_issue_example(tmp_path, capsys):
    out = tmp_path / "plan.json"
    plan.main(ISSUE_EXAMPLE + ["--gpu-memory", "80e9", "--num-layers", "80", "--json", str(out)])
    text = capsys.readouterr().out
    assert "recommendation:" in text and "memory:" in text
    data = json.loads(out.read_text())
    kinds = {(r["layout"], r["comm_type"]) for r in data["rows"]}
    assert {(lay, ct) for lay in ("zigzag", "striped", "contiguous")
            for ct in ("p2p", "all_gather", "a2a", "a2a+p2p")} <= kinds
    assert all(r["time_s"] > 0 and r["bytes_per_rank"] > 0 and r["memory_bytes"] > 0 for r in data["rows"])
    assert data["recommendation"]["comm_type"] in ("p2p", "all_gather", "a2a", "a2a+p2p")
    # more memory never needs more ranks
    pb = Problem(batch=1, seq=1 << 20, heads=64, kv_heads=8, head_dim=128)
    assert smallest_cp(pb, 80, 160e9) <= smallest_cp(pb, 80, 80e9) <= smallest_cp(pb, 80, 40e9)


def test_slow_inter_node_links_favour_a2a_inside_nodes():
    pb = Problem(batch=1, seq=1 << 17, heads=32, kv_heads=32, head_dim=128)
    m = Machine(flops=400e12, bw_intra=400e9, bw_inter=5e9, latency=10e-6, gpus_per_node=8)
    best = predict_all(pb, 32, m, inner=8)[0]["comm_type"]
    assert best in ("a2a+p2p", "a2a"), predict_all(pb, 32, m, inner=8)


def _log_records() -> list:
    """Messages logged on logger ``megatron_ring`` (INFO and up) from now on, in this process."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    log = logging.getLogger("megatron_ring")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return records


def _auto_worker(rank, world):
    records = _log_records()
    # ranks see different machine numbers: the agreed (MIN/MAX) values must give one choice
    os.environ.update({"MEGATRON_RING_FLOPS": str(1e9 * (rank + 1)), "MEGATRON_RING_BWD_FLOPS": "1e9",
                       "MEGATRON_RING_BANDWIDTH": str(1e8 / (rank + 1)), "MEGATRON_RING_INTER_BANDWIDTH": "1e8",
                       "MEGATRON_RING_LATENCY_S": str(1e-4 * (rank + 1)), "MEGATRON_RING_CALL_OVERHEAD_S": "1e-4"})
    from megatron_ring import ring_attention
    from megatron_ring.transport.groups import contexts

    q = torch.randn(1, 16, 4, 8)
    for _ in range(3):  # the choice is made (and logged) once
        ring_attention(q, q, q, comm_type="auto", causal=True)
    machine = next(m for _, ctx in contexts() for m in ctx.machines.values())
    return [c for _, ctx in contexts() for c in ctx.choices.values()], records, (machine.flops, machine.bw_intra,
                                                                                 machine.latency)


@pytest.mark.slow
def test_auto_agrees_across_ranks_and_logs_once():
    per_rank = run_distributed(_auto_worker, 2, timeout=120)
    choices = {tuple(c) for c, _, _ in per_rank}
    assert len(choices) == 1 and len(next(iter(choices))) == 1
    machines = {m for _, _, m in per_rank}
    assert machines == {(1e9, 5e7, 2e-4)}, machines
    for _, records, _ in per_rank:
        chose = [r for r in records if "auto comm_type: chose" in r]
        assert len(chose) == 1 and "predicted" in chose[0] and "p2p" in chose[0]


def _documents_worker(rank, world, by_name=False):
    """Two packed micro-batches of one shape in Megatron's per-document zigzag: new documents, so a new
    ``DocumentZigzag`` each. ``by_name``: the choice keyed on the layout's name (the negative control)."""
    records = _log_records()
    os.environ.update({"MEGATRON_RING_FLOPS": "1e9", "MEGATRON_RING_BWD_FLOPS": "1e9", "MEGATRON_RING_BANDWIDTH": "1e8",
                       "MEGATRON_RING_INTER_BANDWIDTH": "1e8", "MEGATRON_RING_LATENCY_S": "1e-4",
                       "MEGATRON_RING_CALL_OVERHEAD_S": "1e-4"})
    from megatron_ring import DocumentZigzag, ring_attention
    from megatron_ring.transport.groups import contexts

    if by_name:
        DocumentZigzag.family = property(lambda self: self.name)
    for cu in ([0, 8, 32], [0, 16, 24, 32]):  # documents padded to multiples of 2P
        q = torch.randn(32 // world, 4, 8)
        ring_attention(q, q, q, qkv_format="thd", cu_seqlens=torch.tensor(cu), layout=DocumentZigzag(cu),
                       comm_type="auto", causal=True)
    return len([c for _, ctx in contexts() for c in ctx.choices.values()]), len(
        [r for r in records if "auto comm_type: chose" in r])


def _documents_by_name_worker(rank, world):
    return _documents_worker(rank, world, by_name=True)


@pytest.mark.slow
def test_auto_chooses_once_for_the_per_document_zigzag_of_every_micro_batch():
    """The choice keys on the layout's family: a new micro-batch's documents (a new ``DocumentZigzag``) do not make
    ``auto`` predict, and perhaps time its candidates, again. Negative control: keyed on the layout's name, it
    chooses (and logs) once per micro-batch."""
    assert run_distributed(_documents_worker, 2, timeout=120) == [(1, 1), (1, 1)]
    assert run_distributed(_documents_by_name_worker, 2, timeout=120) == [(2, 2), (2, 2)]


def test_a_layout_made_from_documents_is_predicted_as_the_layout_it_is_for_one_document(monkeypatch):
    """The cost model does not model documents: ``auto`` predicts Megatron's per-document zigzag as the zigzag (its
    positions for one document), never scheduling the tiles of a batch's boundaries for every pair of ranks (8 s on
    one CPU thread at P = 8, 8K tokens per rank and 42 documents). Negative control: the layout itself is scheduled."""
    from megatron_ring import DocumentZigzag
    from megatron_ring.schedules.layouts import get_layout
    from megatron_ring.strategies.auto import _modelled

    for world in (1, 2, 4):
        one = DocumentZigzag([0, 8 * world])
        for r in range(world):
            assert torch.equal(one.positions(8 * world, world, r), get_layout("zigzag").positions(8 * world, world, r))
    cu = [0, 48, 64, 112, 128]  # padded to multiples of 2P, P = 4
    scheduled = []
    monkeypatch.setattr(DocumentZigzag, "causal_tasks", lambda self, *a: scheduled.append(a) or ())
    machine = Machine(flops=1e12, bw_intra=1e10, bw_inter=1e10, latency=1e-5, call_overhead=1e-5)

    def rows(layout):
        pb = Problem(batch=1, seq=128, heads=8, kv_heads=2, head_dim=16, causal=True, layout=layout)
        return [(r["comm_type"], r["time_s"]) for r in predict_all(pb, 4, machine)]

    assert _modelled(DocumentZigzag(cu)) == "zigzag" and _modelled(get_layout("striped")) == "striped"
    assert rows(_modelled(DocumentZigzag(cu))) == rows("zigzag") and not scheduled
    rows(DocumentZigzag(cu))
    assert scheduled  # the negative control: the layout itself has its pairs scheduled


def test_near_ties_are_measured_and_clear_wins_are_not(monkeypatch):
    from megatron_ring.strategies.auto import _fastest, noise, to_measure, typical

    rows = [{"comm_type": "p2p", "time_s": 1.0}, {"comm_type": "a2a", "time_s": 1.1},
            {"comm_type": "all_gather", "time_s": 2.0}]
    assert to_measure(rows) == (["p2p", "a2a"], 5)  # within 30%: the model cannot rank them
    assert to_measure([rows[0], rows[2]]) == ([], 0)  # a clear win: the model decides
    assert to_measure([{**r, "time_s": r["time_s"] * 1e-3} for r in rows]) == ([], 0)  # too short to matter
    assert to_measure([{**r, "time_s": r["time_s"] * 60} for r in rows]) == (["p2p", "a2a"], 3)  # budget: 3 rounds
    assert to_measure([{**r, "time_s": r["time_s"] * 100} for r in rows]) == ([], 0)  # < 3 rounds fit: the model
    monkeypatch.setenv("MEGATRON_RING_AUTO_MEASURE_ROUNDS", "1")  # asked for fewer: allowed
    assert to_measure(rows) == (["p2p", "a2a"], 1)
    monkeypatch.delenv("MEGATRON_RING_AUTO_MEASURE_ROUNDS")
    monkeypatch.setenv("MEGATRON_RING_AUTO_MEASURE", "0")
    assert to_measure(rows) == ([], 0)
    assert typical([1.0, 5.0, 1.1, 1.2, 0.9]) == 1.1 and abs(typical([1.3, 0.9]) - 1.1) <= F64_REL * 1.1  # median; mean of two
    # noise: the rounds' relative spread over sqrt(rounds) (interquartile from 4 rounds), median over candidates
    quiet, noisy = [2.0] * 5, [1.0, 1.2, 0.8, 1.0, 1.1]  # noisy: interquartile 1.0..1.1, median 1.0
    assert noise({"p2p": quiet, "a2a": quiet, "all_gather": noisy}) == 0.0
    assert abs(noise({"p2p": noisy, "a2a": quiet, "all_gather": noisy}) - 0.1 / 5 ** 0.5) <= F64_REL * 1.1
    assert abs(noise({"p2p": [1.0, 1.1]}) - 0.1 / 1.05 / 2 ** 0.5) <= F64_REL * 1.1 and noise({"p2p": [1.0]}) == 0.0
    assert _fastest({"p2p": 1.0, "a2a": 0.95}, tie=0.06) == "p2p"  # a gap within the noise: the simpler type
    assert _fastest({"p2p": 1.0, "a2a": 0.8}) == "a2a" and _fastest({"p2p": 1.0, "a2a": 0.99}) == "p2p"


def _measured_worker(rank, world):
    records = _log_records()
    # equal machine numbers on every rank, every type compute-bound: a near-tie, measured (tiny sizes allowed)
    os.environ.update({"MEGATRON_RING_FLOPS": "1e6", "MEGATRON_RING_BWD_FLOPS": "1e6", "MEGATRON_RING_BANDWIDTH": "1e12",
                       "MEGATRON_RING_INTER_BANDWIDTH": "1e12", "MEGATRON_RING_LATENCY_S": "0",
                       "MEGATRON_RING_CALL_OVERHEAD_S": "0", "MEGATRON_RING_AUTO_MEASURE_MIN_S": "0"})
    from megatron_ring import ring_attention
    from megatron_ring.strategies import auto

    q = torch.randn(1, 16, 4, 8, requires_grad=True)
    for _ in range(2):
        ring_attention(q, q, q, comm_type="auto", causal=True).sum().backward()
    with torch.no_grad():  # a new signature, chosen inside no_grad: the measurement still runs backward
        ring_attention(q[:, :8], q[:, :8], q[:, :8], comm_type="auto")
    from megatron_ring.transport.groups import contexts
    return [c for _, ctx in contexts() for c in ctx.choices.values()], auto.last_choice["measured"], records


@pytest.mark.slow
def test_auto_measures_near_ties_and_agrees():
    per_rank = run_distributed(_measured_worker, 2, timeout=120)
    choices = [c for c, _, _ in per_rank]
    assert choices[0] == choices[1] and len(choices[0]) == 2
    measured = [m for _, m, _ in per_rank]
    assert measured[0] == measured[1] and {"p2p", "all_gather", "a2a"} <= set(measured[0]), measured
    assert all(t > 0 for t in measured[0].values())
    for _, _, records in per_rank:
        chose = [r for r in records if "auto comm_type: chose" in r]
        assert len(chose) == 2 and all("near-tie, measured" in r for r in chose), chose


def test_streaming_terms_follow_the_piece_count():
    """kv_pieces=n (docs/design.md "Sub-block streaming", "Memory"): the ring's workspace holds 1/n of a
    K/V block beyond the one in flight and (n+1)/n fp32 dK/dV blocks; of the dK/dV hops only the last
    piece's (1/n of an fp32 block) is in the open when compute hides the rest."""
    kw = dict(batch=1, seq=8192, heads=8, kv_heads=8, head_dim=64, elem_bytes=4)
    c = 8192 // 4
    kv32 = dkv32 = 2 * c * 8 * 64 * 4
    acc32 = c * 8 * 64 * 4
    kernel = 3 * c * 8 * 64 * 4  # the block kernel's dQ, dK, dV (fp32 here)
    for n in (1, 2, 8):
        assert workspace_bytes("p2p", Problem(kv_pieces=n, **kw), 4) == \
            kv32 / n + (n + 1) / n * dkv32 + acc32 + kernel / n
    assert workspace_bytes("p2p", Problem(kv_pieces=1, **kw), 4) == kv32 + 2 * dkv32 + acc32 + kernel  # 2 buffers
    for ct, inner in (("all_gather", None), ("a2a", None), ("a2a+p2p", 2)):  # per-rank workspace shrinks with P
        assert workspace_bytes(ct, Problem(**kw), 4, inner) > workspace_bytes(ct, Problem(**kw), 8, inner)
    m = Machine(flops=1e9, bw_intra=1e12, latency=0.0)  # transfers far below compute: all hidden but the last
    bwd = {n: predict("p2p", Problem(kv_pieces=n, **kw), 4, m)["bwd_s"] for n in (1, 8)}
    assert abs((bwd[1] - bwd[8]) - dkv32 * (1 - 1 / 8) / 1e12) <= F64_REL * bwd[1]  # rounding of the sums
    fwd = {n: predict("p2p", Problem(kv_pieces=n, **kw), 4, m)["fwd_s"] for n in (1, 8)}
    assert fwd[1] == fwd[8]  # forward hides every piece's exchange under that piece's compute


def test_machine_presets_fill_the_planner(capsys):
    """``--machine NAME``: link numbers and the default kernel rate from the preset; explicit flags win;
    an unknown name or a missing number without a preset names the fix."""
    import pytest

    from megatron_ring_lab.machines import KERNEL_FRACTION, MACHINES, machine

    assert set(MACHINES) == {"h100-sxm", "h800", "a100", "b200", "gb200-nvl72"}
    assert machine("H100 SXM") is machine("h100") is MACHINES["h100-sxm"]
    assert machine("GB200_NVL72").gpus_per_node == 72
    h800 = MACHINES["h800"]
    assert h800.intra_node == 200e9 and h800.kernel_flops == KERNEL_FRACTION * 989e12
    shape = ["--seq-length", "65536", "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups",
             "8", "--context-parallel-size", "8", "16"]
    res = plan.main(["--machine", "h800"] + shape)
    inp = res["inputs"]
    assert (inp["intra_node_bandwidth"], inp["inter_node_bandwidth"], inp["gpus_per_node"], inp["flops"]) == (
        200e9, 50e9, 8, h800.kernel_flops)
    # CP 16 spans two 8-GPU nodes: the ring runs at the inter-node rate, so it is slower per token than on NVL72
    nvl = plan.main(["--machine", "gb200-nvl72", "--flops", str(h800.kernel_flops)] + shape)
    assert nvl["inputs"]["flops"] == h800.kernel_flops  # an explicit flag overrides the preset's default
    ring = lambda r, cp: next(x for x in r["rows"] if x["cp"] == cp and x["comm_type"] == "p2p"  # noqa: E731
                              and x["layout"] == "zigzag")
    assert ring(nvl, 16)["time_s"] < ring(res, 16)["time_s"]
    with pytest.raises(SystemExit, match="presets: h100-sxm"):
        plan.main(["--machine", "tpu"] + shape)
    with pytest.raises(SystemExit, match="--intra-node-bandwidth is required without --machine"):
        plan.main(["--flops", "1e12"] + shape)
    capsys.readouterr()
