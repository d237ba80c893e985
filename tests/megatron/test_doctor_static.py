"""The doctor's parts that need no training run: the toy-model shrink, the static preflight, the CLI's refusals."""
from __future__ import annotations

import json
import subprocess

import pytest

from megatron_ring_lab.doctor import shrink, static
from megatron_ring_lab.doctor.shrink import Args
from tests.helpers.launch import python_cmd

BIG = ("--num-layers 48 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
       "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
       "--num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-layer-freq ([0]*3+[1]*45) "
       "--mtp-num-layers 1 --multi-latent-attention --kv-lora-rank 512 --qk-head-dim 128 "
       "--micro-batch-size 4 --global-batch-size 1024 --bf16 --tensor-model-parallel-size 8 "
       "--pipeline-model-parallel-size 2 --context-parallel-size 4 --normalization RMSNorm --swiglu "
       "--attention-dropout 0.1 --recompute-granularity full --recompute-method uniform --train-iters 100000 "
       "--save /ckpt --window-size (1024,0)").split()


def test_shrink_keeps_the_structure_and_makes_it_small():
    argv, notes = shrink.shrink(BIG, iters=3, max_cp=4)
    a = Args(argv)
    assert a.get("--hidden-size") == "64" and a.get("--num-attention-heads") == "4"
    assert a.get("--num-query-groups") == "2"                       # GQA stays GQA
    assert a.get("--num-experts") == "4" and a.get("--moe-router-topk") == "2"
    assert a.get("--moe-layer-freq") == "[0,1]" and a.get("--num-layers") == "2"   # dense and MoE layers
    assert a.get("--pipeline-model-parallel-size") == "2" and a.get("--tensor-model-parallel-size") == "1"
    assert a.has("--mtp-num-layers") and a.has("--multi-latent-attention") and a.get("--qk-head-dim") == "16"
    for kept in ("--normalization", "--swiglu", "--attention-dropout", "--recompute-granularity"):
        assert a.values(kept) == Args(BIG).values(kept), kept
    assert not a.has("--bf16") and not a.has("--save") and not a.has("--context-parallel-size")
    assert int(a.get("--seq-length")) % 8 == 0 and a.get("--window-size") == "(32,0)"
    assert a.get("--train-iters") == "3" and a.get("--global-batch-size") == "4"
    assert a.get("--transformer-impl") == "local" and a.get("--distributed-backend") == "gloo"
    assert any("--hidden-size 4096 -> 64" in n for n in notes)


def test_shrink_shortens_a_hybrid_pattern_keeping_kinds_and_order():
    assert shrink._shorten_pattern("MMMM*MMMM-MMM*E|MMM*-/MM") == "M*M-M*E|M*-/MM"


def test_static_finds_what_cannot_run_or_differs():
    bad = "--seq-length 100 --num-attention-heads 3 --cp-comm-type a2a --hidden-dropout 0.1 --mtp-num-layers 1".split()
    findings, info = static.check(bad, [4])
    text = static.format_static(findings, info)
    levels = {(f.level, f.topic) for f in findings}
    assert ("error", "sequence") in levels and ("error", "heads") in levels and ("warn", "dropout") in levels
    # the known-issue table is checked against the installed megatron-core: MLM#3959 (MTP) was seen from 0.19
    from megatron_ring.megatron.compat import mcore_version

    mtp = next(i for i in info["known_issues"] if i["ref"].endswith("#3959"))
    assert mtp["config"] and mtp["version"] == (mcore_version() >= (0, 19, 0))
    assert ("Megatron-LM#3959" in text) == (mcore_version() >= (0, 19, 0))


@pytest.mark.slow  # four `python -m megatron_ring_lab.doctor` processes
def test_cli_refuses_bad_input_with_exit_2(tmp_path):
    def run(*argv):
        return subprocess.run(python_cmd("-m", "megatron_ring_lab.doctor", *argv), capture_output=True, text=True,
                              timeout=120)
    assert run("--cp", "1", "--", __file__).returncode == 2
    assert run("--cp", "x", "--", __file__).returncode == 2
    p = run("--", str(tmp_path / "missing.py"))
    assert p.returncode == 2 and "no such script" in p.stderr
    out = tmp_path / "s.json"
    p = run("--static", "--json", str(out), "--cp", "2", "--", __file__, "--seq-length", "64", "--hidden-dropout", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(out.read_text())["static"] == []


def test_every_known_issue_has_its_releases_in_compat():
    """The doctor's known issues name no release: compat.py holds each one's affected range."""
    from megatron_ring.megatron import compat

    refs = [issue[0] for issue in static.KNOWN_ISSUES]
    assert sorted(refs) == sorted(compat.KNOWN_ISSUE_RELEASES)
    assert compat.known_issue_affects("NVIDIA/Megatron-LM#3959", (0, 16, 1)) is False
    assert compat.known_issue_affects("NVIDIA/Megatron-LM#3959", (0, 19, 2)) is True
    assert compat.known_issue_affects("NVIDIA/Megatron-LM#3959", None) is None


@pytest.mark.parametrize("argv,cp,refused", [
    ("--num-attention-heads 6 --cp-comm-type a2a", 4, False),  # uneven split: the library runs it
    ("--num-attention-heads 8 --group-query-attention --num-query-groups 2 --cp-comm-type a2a", 4, False),
    ("--num-attention-heads 3 --cp-comm-type a2a", 4, True),  # a rank without a head
    ("--num-attention-heads 2 --tensor-model-parallel-size 2 --cp-comm-type a2a", 2, True),  # 1 head per TP rank
    ("--num-attention-heads 2 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2", 4, False),
    ("--num-attention-heads 1 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2", 4, True),
])
def test_the_static_heads_rule_is_the_librarys(argv, cp, refused):
    """The doctor refuses an a2a comm type exactly where the library does (comm_types.check_heads: every rank of
    the split needs a TP rank's head); it refused head counts CP does not divide, which the library runs."""
    findings, _ = static.check(argv.split(), [cp])
    assert (("error", "heads") in {(f.level, f.topic) for f in findings}) == refused, findings


def test_the_cp1_reference_leaves_out_the_hierarchical_sizes():
    """The doctor's CP = 1 reference run of an a2a+p2p command: Megatron asserts that the hierarchical CP sizes
    multiply to the CP size, so the reference drops them and runs p2p (the doctor could run no a2a+p2p command);
    the CP > 1 runs keep the command as given."""
    from megatron_ring_lab.doctor.run import for_cp

    args = "--num-layers 2 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 --seq-length 64".split()
    assert for_cp(args, 1) == "--num-layers 2 --cp-comm-type p2p --seq-length 64".split()
    assert for_cp(args, 4) == args
    assert for_cp(["--cp-comm-type", "a2a"], 1) == ["--cp-comm-type", "a2a"]
