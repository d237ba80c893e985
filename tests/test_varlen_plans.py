"""Masked tasks as segment plans of a variable-length flash kernel (kernels/varlen_plan.py, kernels/varlen.py),
run on CPU by the stand-in with that kernel's documented semantics (``varlen_cpu``), against the float64
reference (tests/helpers/reference.py).

What runs on a GPU is the same plan on ``aten._flash_attention_forward/_backward``; here every masked task of
the ring runs through the plan on the stand-in (the engine asked with ``varlen.cpu_stand_in()``), P = 1, 2, 4
ranks as threads (ThreadRing): packed documents (causal and not; contiguous, zigzag, striped and the
per-document zigzag), windows with and without documents, end padding, MHA/GQA/MQA, fp32 and bf16; outputs
AND dq/dk/dv within the derived bound of tests/helpers/numerics.py. No task falls back to the math kernel.

Negative control: a plan with one alignment off by one (one call's window shifted by a key) fails the bound.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from megatron_ring.kernels import varlen, varlen_plan
from megatron_ring.schedules.layouts import TaskKind, get_layout
from megatron_ring.schedules.masks import AttentionMask, DocumentZigzag, schedule
from tests.helpers.numerics import max_err, score_bound, tol
from tests.helpers.reference import doc_attention_reference, outputs_and_grads
from tests.helpers.launch import run_distributed
from tests.helpers.ring_fakes import thd_ring_in_global_order


def _docs(T: int, seed: int) -> list[int]:
    """Random document lengths (1 included), then 1-3 padding tokens at the end."""
    rnd = random.Random(seed)
    cu = [0]
    while cu[-1] < T - 3:
        cu.append(min(T - 1, cu[-1] + rnd.choice([1, 2, 3, 5, 7, 13, 17])))
    return cu


def _layout(name: str, T: int, world: int):
    if name == "doc-zigzag":  # documents padded to multiples of 2P: the per-document zigzag of Megatron/TE
        c = 2 * world
        return DocumentZigzag([0, 2 * c, 3 * c, T]), [0, 2 * c, 3 * c, T]
    return get_layout(name), None


def _ring(world, layout, causal, cu, window, heads, dtype, seed, d_v=16, T=None):
    """Outputs and gradients of the whole ring (P threads) and of the float64 reference, global order
    (``d_v`` != 16: MLA head dims, the kernel's operands zero-padded)."""
    T = T or (12 * world if not isinstance(layout, DocumentZigzag) else layout.cu[-1])
    h, hk = heads
    d = 16
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(T, h, d, generator=g).to(dtype) for _ in range(2))
    k, v = torch.randn(T, hk, d, generator=g).to(dtype), torch.randn(T, hk, d_v, generator=g).to(dtype)
    dout = dout[..., :d_v].contiguous()
    ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, cu or [0, T], causal, window),
                            q.double(), k.double(), v.double(), dout.double())
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    got = thd_ring_in_global_order(world, layout, q, k, v, dout, cu_seqlens=cu_t, causal=causal, window=window)
    sigma = score_bound(q, k)
    return [(what, max_err(a, b), tol(b.abs().max().item(), dtype=dtype, n=max(T, d), sigma=sigma,
                                      blocks=2 * world))
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref)]


def _cases(world):
    T = 12 * world
    docs = _docs(T, world)
    rules = [(True, docs, None), (False, docs, None), (True, None, (5, 0)), (False, None, (7, 3)),
             (True, docs, (4, 0)), (False, docs, (2, 1))]
    layouts = ("contiguous", "zigzag", "striped", "doc-zigzag")
    for i, (lay, (causal, cu, window)) in enumerate(itertools.product(layouts, rules)):
        heads = [(4, 4), (4, 2), (4, 1)][i % 3]
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        yield lay, causal, cu, window, heads, dtype, i


@dataclasses.dataclass
class _Run:
    rows: list
    counts: dict


def _run_all(world) -> _Run:
    rows = []
    varlen.COUNTS.clear()
    with varlen.cpu_stand_in():
        for lay, causal, cu, window, heads, dtype, seed in _cases(world):
            layout, doc_cu = _layout(lay, 12 * world, world)
            if doc_cu is not None:  # the per-document zigzag: its own documents (and a window or not)
                cu = doc_cu if cu is not None else None
            for what, err, bound in _ring(world, layout, causal, cu, window, heads, dtype, seed):
                rows.append(((lay, causal, cu, window, heads, str(dtype), what), err, bound))
    return _Run(rows, dict(varlen.COUNTS))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_segment_plans_on_the_stand_in_match_float64(world):
    run = _run_all(world)
    bad = [(label, err, bound) for label, err, bound in run.rows if not err <= bound]
    assert not bad, bad[:5]
    assert run.counts.get("varlen_cpu", 0) > 0 and run.counts.get("math", 0) == 0, run.counts


def test_mla_head_dims_on_the_stand_in():
    """MLA (V's head dim 8, Q/K's 16): the masked tasks' operands are zero-padded as for the dense kernels."""
    varlen.COUNTS.clear()
    with varlen.cpu_stand_in():
        rows = _ring(2, get_layout("zigzag"), True, _docs(24, 5), None, (4, 2), torch.float32, 0, d_v=8)
    assert all(err <= bound for _, err, bound in rows), rows
    assert varlen.COUNTS["varlen_cpu"] > 0 and varlen.COUNTS["math"] == 0, varlen.COUNTS


def test_an_off_by_one_alignment_fails(monkeypatch):
    """Not vacuous: one call of each plan with its window (or causal diagonal) one key off fails the bound."""
    real = varlen_plan.build_plan

    def off_by_one(mask):
        plan = real(mask)
        if plan is None:
            return None
        c = plan.calls[0]
        left, right = c.window
        shifted = dataclasses.replace(c, causal=False, window=(left, right + 1) if right >= 0 else (left + 1, right))
        return varlen_plan.SegmentPlan((shifted,) + plan.calls[1:], plan.shared_keys)

    monkeypatch.setattr(varlen_plan, "build_plan", off_by_one)
    varlen_plan._PLANS.clear()
    try:
        run = _run_all(2)
    finally:
        varlen_plan._PLANS.clear()
    assert any(not err <= bound for _, err, bound in run.rows)


def test_every_masked_task_has_a_plan():
    """Every masked task of these schedules (documents, windows, padding; every layout; P = 1, 2, 4; local
    lengths 12 and 64) is expressed by a verified segment plan: none falls back to the math kernel."""
    missing, tasks = [], 0
    for world, s in itertools.product((1, 2, 4), (12, 64)):
        T = s * world
        docs = tuple(_docs(T, s + world))
        for lay, causal, (cu, window) in itertools.product(
                ("contiguous", "zigzag", "striped"), (True, False),
                ((docs, None), (None, (40, 0)), (None, (17, 3)), (docs, (2, 1)), (None, (64, 64)),
                 ((0, 37, T // 2 + 5, T - 9), None))):
            rule = AttentionMask(causal, cu, window)
            for r, src in itertools.product(range(world), range(world)):
                for t in schedule(get_layout(lay), rule, world, r, src, s):
                    if t.kind is TaskKind.MASKED:
                        tasks += 1
                        plan = varlen_plan.build_plan(t.mask)
                        if plan is None:
                            missing.append((world, s, lay, causal, cu, window, r, src))
                        else:
                            assert torch.equal(plan.visible(len(t.mask.qpos), len(t.mask.kpos)), t.mask.allowed())
    assert tasks > 500 and missing == [], missing[:5]


def test_segment_semantics_are_bottom_right_aligned():
    """The rule the plans are built on, spelled out: 2 queries, 4 keys, causal: query 0 sees keys 0-2."""
    ok = varlen_plan.visible_in_segment(2, 4, True, -1, -1)
    assert ok.tolist() == [[True, True, True, False], [True, True, True, True]]
    ok = varlen_plan.visible_in_segment(3, 3, False, 1, 0)  # window (1, 0): the key before and the diagonal
    assert ok.tolist() == [[True, False, False], [True, True, False], [False, True, True]]


def test_one_query_segments_keep_a_bounded_right_window():
    """Segments of at most one query and no window: torch's varlen flash forward then folds the query heads
    into rows assuming one query per segment (GQA), which key-only filler segments break; the plan spells the
    unbounded right window as the longest key segment instead (the same pairs)."""
    from megatron_ring.schedules.masks import BlockMask

    rule = AttentionMask(False, (0, 3, 6, 9))
    qpos, kpos = torch.tensor([1, 4, 7]), torch.arange(9)
    plan = varlen_plan.build_plan(BlockMask(rule, qpos, rule.doc_ids(qpos), kpos, rule.doc_ids(kpos)))
    assert plan is not None
    for call in plan.calls:
        assert not (call.max_q == 1 and call.window == (-1, -1)), call


def _length_mix(T: int, seed: int) -> list[int]:
    """cu_seqlens of a web-like document mix over ``T`` tokens: mostly short documents, some long ones (at most
    a quarter of the stream), as the GPU benchmark packs them."""
    rnd = random.Random(seed)
    cu = [0]
    while cu[-1] < T:
        n = rnd.randint(1, T // 64) if rnd.random() < 0.8 else rnd.randint(T // 16, T // 4)
        cu.append(min(T, cu[-1] + n))
    return cu


@pytest.mark.parametrize("world", [2, 4])
def test_whole_blocks_of_a_document_mix_on_the_stand_in(world):
    """On a variable-length kernel a masked block runs whole (varlen.whole_blocks): one task per run of rows
    and K/V block instead of dozens of tiles (on an H200, 1-2% of one-GPU variable-length flash on tiles). Blocks
    of 256 rows (16 tiles of the math kernel's schedule) with a real length mix, causal documents and documents
    with a window, striped and zigzag: within the bound of float64, every masked task on the stand-in, and at
    most 4 masked tasks per ring step (zigzag: 2 x 2 runs of rows)."""
    T = 256 * world
    rows = []
    for i, (lay, (causal, window)) in enumerate(itertools.product(("striped", "zigzag"),
                                                                  ((True, None), (True, (100, 0))))):
        varlen.COUNTS.clear()
        with varlen.cpu_stand_in():
            rows += _ring(world, get_layout(lay), causal, _length_mix(T, i), window, (4, 2), torch.float32, i,
                          T=T)
        assert varlen.COUNTS.get("math", 0) == 0, varlen.COUNTS
        # per rank: forward + backward, one task per (query run, key run) and step
        assert varlen.COUNTS["varlen_cpu"] <= 2 * world * world * (4 if lay == "zigzag" else 1), varlen.COUNTS
    assert all(err <= bound for _, err, bound in rows), [r for r in rows if not r[1] <= r[2]]


def _collective_worker(rank, world, tiled_views=False):
    """Every collective comm type on a web-like document mix (causal, striped and Megatron's per-document
    zigzag) with masked tasks on the stand-in: per (comm type, layout) the errors of the outputs and dq/dk/dv
    against the float64 reference, and the stand-in's kernel calls (forward+backward). ``tiled_views``: the
    strategies' views cut their blocks into tiles whatever the engine asks, and a2a takes the shards as if they were in
    the sequence's order (the negative controls)."""
    import torch.distributed as dist
    from megatron_ring import ring_attention
    from megatron_ring.schedules import views
    from megatron_ring.strategies import make_hierarchical_groups

    if tiled_views:
        for cls in (views.GatheredView, views.GroupedView):
            cls.masked_tasks = (lambda orig: lambda self, rule, w, r, src, s, tile=None, one_task=None:
                                orig(self, rule, w, r, src, s))(cls.masked_tasks)
        views.GroupedView.sequence_order = lambda self, n: None
    hier = make_hierarchical_groups(2)
    T, h, hk, d = 256 * world, 4, 2, 16  # hk: the test's kv_heads
    lengths = [37, 300, 5, 120, 64, 211, 90, 17]  # padded to multiples of 2P for the per-document zigzag
    slots = [0]
    for n in lengths:
        slots.append(slots[-1] + -(-n // (2 * world)) * 2 * world)
    slots.append(T)
    docs = [0]
    for a, b, n in zip(slots, slots[1:], lengths + [None]):
        docs += [a + n, b] if n is not None and a + n < b else [b]
    g = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(T, h, d, generator=g) for _ in range(2))
    k, v = (torch.randn(T, hk, d, generator=g) for _ in range(2))
    ref = outputs_and_grads(lambda *t: doc_attention_reference(*t, docs, True, None), q.double(), k.double(),
                            v.double(), dout.double())
    rows, calls = [], {}
    for lay in (get_layout("striped"), DocumentZigzag(slots)):
        pos = lay.positions(T, world, rank)
        for ct in ("all_gather", "a2a", "a2a+p2p"):
            leaves = [t[pos].detach().clone().requires_grad_() for t in (q, k, v)]
            varlen.COUNTS.clear()
            with varlen.cpu_stand_in():
                out = ring_attention(*leaves, qkv_format="thd", layout=lay, cu_seqlens=torch.tensor(docs),
                                     causal=True, comm_type=ct, hierarchical_groups=hier)
                out.backward(dout[pos])
            calls[(ct, lay.family)] = dict(varlen.COUNTS)
            for what, a, b in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], ref):
                rows.append(((ct, lay.family, what), max_err(a, b[pos]),
                             tol(b.abs().max().item(), dtype=torch.float32, n=T, sigma=score_bound(q, k),
                                 blocks=2 * world)))
    dist.barrier()
    return rows, calls


def _tiled_views_worker(rank, world):
    return _collective_worker(rank, world, tiled_views=True)


@pytest.mark.slow
def test_collective_comm_types_run_whole_blocks_on_the_variable_length_kernel():
    """all_gather, a2a and a2a+p2p hold several shards in one tensor. On a variable-length kernel their masked
    blocks run whole, as the ring's do, within the float64 bound and none on the math kernel, for the striped layout
    and Megatron's per-document zigzag: all_gather and a2a+p2p (the schedule views, schedules/views.py) at most one
    task per pair of shards and pass (forward, backward); a2a ONE task per pass, the whole sequence in its order
    (strategies/a2a.py: sequence_order). Before, the views ignored whole blocks and cut every pair into tiles (P = 8,
    8K tokens per rank, a web-like mix: a2a 1,728 tasks per forward; then 64, one per pair of shards; now 1).
    Negative controls: views that tile take several times the calls, with the same results; a2a taking the shards
    as if they were in order is wrong far beyond the bound."""
    from megatron_ring.strategies import all_gather

    world, kv_heads = 4, 2
    per_rank = run_distributed(_collective_worker, world, timeout=600)
    # tasks per pass: all_gather, each source shard once per gathered group of K/V heads; a2a, every pair of shards;
    # a2a+p2p 2 x 2, 2 ring steps of 2 x 2 pairs
    pairs = {"all_gather": world * min(all_gather.GROUPS, kv_heads), "a2a": 1, "a2a+p2p": 2 * 2 * 2}
    for rows, calls in per_rank:
        assert all(err <= bound for _, err, bound in rows), [r for r in rows if not r[1] <= r[2]]
        for (ct, family), counts in calls.items():
            assert counts.get("math", 0) == 0 and counts["varlen_cpu"] <= 2 * pairs[ct], (ct, family, counts)
    tiled = run_distributed(_tiled_views_worker, world, timeout=600)
    for (_, calls), (tiled_rows, tiled_calls) in zip(per_rank, tiled):
        assert all(err <= bound for (ct, _, _), err, bound in tiled_rows if ct != "a2a")
        assert all(err > 10 * bound for (ct, _, what), err, bound in tiled_rows if ct == "a2a" and what == "out")
        assert all(tiled_calls[key]["varlen_cpu"] >= 2 * calls[key]["varlen_cpu"] for key in calls
                   if key[0] != "a2a"), tiled_calls


def test_plans_from_row_ranges_equal_the_plans_from_the_matrix(monkeypatch):
    """Where a task's keys are one run of positions (every whole block), its plan is built from each row's
    range of visible keys, without the ``[rows, keys]`` matrix (seconds at 8K rows). Those plans equal the ones
    the matrix gives, call for call, over every layout, P = 2 and 4, documents with padding (causal and not),
    windows with and without documents, tiles and whole blocks; a task where no row sees a key gets no call."""
    fast_path = 0
    for world, lay, (causal, window), whole in itertools.product(
            (2, 4), ("contiguous", "zigzag", "striped"), ((True, None), (False, None), (True, (5, 0)),
                                                           (False, (4, 2))), (False, True)):
        s = 40
        T = s * world
        rule = AttentionMask(causal, tuple(_length_mix(T - 3, world)) if window != (5, 0) else None, window)
        layout = get_layout(lay)
        for r in range(world):
            for src in range(world):
                for task in schedule(layout, rule, world, r, src, s, s if whole else None):
                    if task.kind is not TaskKind.MASKED:
                        continue
                    fast = varlen_plan.build_plan(task.mask)
                    with monkeypatch.context() as m:
                        m.setattr(varlen_plan, "_row_spans", lambda mask: None)
                        slow = varlen_plan.build_plan(task.mask)
                    if varlen_plan._row_spans(task.mask) is None:
                        continue
                    fast_path += 1
                    assert fast is not None, (lay, world, rule, r, src)
                    if fast.calls == ():
                        assert not bool(task.mask.allowed().any())
                        continue
                    assert (fast.calls, fast.shared_keys) == (slow.calls, slow.shared_keys), (lay, world, rule, r)
    assert fast_path > 100, fast_path


def test_the_kernel_lse_option_only_moves_the_fix_ups():
    """``kernel_lse=True`` (the engine's call, core/engine.py): the forward's lse is +inf where ``kernel_lse=False``
    gives -inf, all else equal; the backward given that lse equals the backward given ours, bit for bit
    (the stand-in, a padded document mix: rows that see no key)."""
    T, world = 48, 2
    cu = _docs(T, 3)
    layout = get_layout("striped")
    rule = AttentionMask(True, tuple(cu))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, T // world, 16, generator=g) for _ in range(4))
    kern = varlen._VARLEN_CPU
    seen = 0
    for src in range(world):
        for task in schedule(layout, rule, world, 0, src, T // world, T // world):
            mask = task.explicit_mask()
            if mask is None:
                continue
            args = (q[:, :, task.q], k[:, :, task.kv], v[:, :, task.kv])
            out, lse = kern.forward(*args, False, 0.25, mask=mask)
            out_k, lse_k = kern.forward(*args, False, 0.25, mask=mask, kernel_lse=True)
            assert torch.equal(out, out_k)
            assert torch.equal(torch.isposinf(lse_k), torch.isneginf(lse)) and not torch.isneginf(lse_k).any()
            fin = torch.isfinite(lse)
            assert torch.equal(lse[fin], lse_k[fin])
            grads = kern.backward(dout[:, :, task.q], *args, out, lse, False, 0.25, mask=mask)
            grads_k = kern.backward(dout[:, :, task.q], *args, out, lse_k, False, 0.25, mask=mask, kernel_lse=True)
            assert all(torch.equal(a, b) for a, b in zip(grads, grads_k))
            seen += bool(torch.isneginf(lse).any())
    assert seen, "no task had a row that sees no key: the case checks nothing"


def test_plans_of_a_real_length_mix_at_whole_blocks_equal_the_plans_from_the_matrix():
    """The row-range path works on whole documents at once (tensor ops over the rows): at whole blocks of 256 rows
    with many short documents and a web-like mix (P = 4, every layout, causal and not, a window with documents),
    each plan equals the one the matrix gives, call for call, and covers exactly the mask's pairs."""
    from megatron_ring_lab.bench.plan_time import packed_lengths, short_lengths

    s, world, planned = 256, 4, 0
    for lay, mix, (causal, window) in itertools.product(
            ("contiguous", "zigzag", "striped"), (packed_lengths, short_lengths),
            ((True, None), (False, None), (True, (90, 0)))):
        cu = [0]
        for n in mix(s * world, seed=3):
            cu.append(cu[-1] + n)
        if mix is short_lengths:
            cu = [c for c in cu if c <= s * world - 7] + [s * world - 7]  # padding at the end
        rule = AttentionMask(causal, tuple(cu), window)
        for r, src in itertools.product(range(world), repeat=2):
            for task in schedule(get_layout(lay), rule, world, r, src, s, s):
                if task.kind is not TaskKind.MASKED or varlen_plan._row_spans(task.mask) is None:
                    continue
                fast = varlen_plan.build_plan(task.mask)
                ok = task.mask.allowed()
                slow = varlen_plan._build(ok, task.mask.qdoc, task.mask.kdoc)
                assert fast is not None and slow is not None, (lay, rule, r, src)
                assert fast.calls == tuple(slow), (lay, rule, r, src)
                assert torch.equal(fast.visible(*ok.shape), ok)
                planned += 1
    assert planned > 100, planned


def test_the_row_range_check_refuses_a_plan_that_misses():
    """The row-range path's check (``_spans_match``, each row's band against the mask's range, without the
    matrix) accepts the plan it built and refuses it with one call's window or one segment moved by a key."""
    rule = AttentionMask(True, (0, 50, 90, 160, 250), (30, 0))
    layout = get_layout("striped")
    checked = 0
    for src in range(2):
        for task in schedule(layout, rule, 2, 1, src, 128, 128):
            spans = varlen_plan._row_spans(task.mask)
            plan = varlen_plan.build_plan(task.mask) if task.kind is TaskKind.MASKED else None
            if plan is None or spans is None or not plan.calls:
                continue
            calls = list(plan.calls)
            assert varlen_plan._spans_match(calls, spans)
            c = calls[0]
            left, right = c.window
            wider = dataclasses.replace(c, window=(left + 1 if left >= 0 else 3, right))
            assert not varlen_plan._spans_match([wider] + calls[1:], spans)
            i = next(i for i in range(1, len(c.cum_k)) if c.cum_k[i] - c.cum_k[i - 1] > 1 and
                     c.cum_q[i] > c.cum_q[i - 1])
            moved = dataclasses.replace(c, cum_k=c.cum_k[:i] + (c.cum_k[i] - 1,) + c.cum_k[i + 1:])
            assert not varlen_plan._spans_match([moved] + calls[1:], spans)
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_per_document_zigzag_runs_one_task_per_ring_step(world, monkeypatch):
    """Megatron's per-document zigzag (``DocumentZigzag``, ``--sft`` packing: two chunks of every document per rank)
    cuts a block into two runs of rows per document; on a variable-length kernel the whole block is ONE masked task
    where the kernel takes its mask in one plan (``schedules.masks.schedule(..., one_task=)``), instead of a task per
    pair of runs. A web-like mix padded to multiples of 2P (fillers their own documents), causal: within the bound of
    float64, at most one task per rank and ring step, forward and backward, none on the math kernel. Negative
    control: with the kernel's test refusing, the block's runs make many more tasks (the same results)."""
    from megatron_ring.core import plan as plan_module
    from megatron_ring_lab.bench.plan_time import megatron_padded, packed_lengths

    T = 128 * world
    slots, cu = megatron_padded(packed_lengths(T, seed=world), world, T)
    layout = DocumentZigzag(slots)
    calls = {}
    for one in (True, False):
        if not one:
            monkeypatch.setattr(plan_module, "one_task", lambda mask: False)
        varlen.COUNTS.clear()
        with varlen.cpu_stand_in():
            rows = _ring(world, layout, True, list(cu), None, (4, 2), torch.float32, 7, T=T)
        assert all(err <= bound for _, err, bound in rows), rows
        assert varlen.COUNTS.get("math", 0) == 0, varlen.COUNTS
        calls[one] = varlen.COUNTS["varlen_cpu"]
    # per rank forward and backward, one task per step at most (P threads)
    assert calls[True] <= 2 * world * world < calls[False], calls
