"""Schedules for documents and windows (masks.py): exact coverage, grouping, shortened rings, bad input."""
import itertools
import random

import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.schedules.layouts import LAYOUTS, get_layout
from megatron_ring.schedules import masks
from megatron_ring.schedules.views import GroupedView
from megatron_ring.schedules.masks import AttentionMask, needed_steps, schedule


def _rules(T, rnd):
    cu = [0]
    while cu[-1] < T - 2:
        cu.append(min(T - 2, cu[-1] + rnd.choice([1, 2, 5, 9, 30])))
    return [AttentionMask(True, tuple(cu)), AttentionMask(False, tuple(cu)), AttentionMask(True, None, (7, -1)),
            AttentionMask(False, tuple(cu), (3, 4)), AttentionMask(True, (0, T // 2 + 3), (40, -1)),
            AttentionMask(True, None, (16, -1)), AttentionMask(False, None, (8, 16))]  # tile-aligned edges


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tasks_cover_every_visible_pair_exactly_once(world):
    rnd = random.Random(world)
    s = 32
    T = s * world
    for name, rule in itertools.product(LAYOUTS, _rules(T, rnd)):
        lay = get_layout(name)
        for rank, src in itertools.product(range(world), range(world)):
            qp, kp = lay.positions(T, world, rank), lay.positions(T, world, src)
            want = rule.allowed(qp, rule.doc_ids(qp), kp, rule.doc_ids(kp))
            got = torch.zeros_like(want, dtype=torch.int32)
            for t in schedule(lay, rule, world, rank, src, s, tile=8):
                block = torch.ones(t.q.stop - t.q.start, t.kv.stop - t.kv.start, dtype=torch.bool)
                if t.causal:
                    block = block.tril()
                    assert block.shape[0] == block.shape[1]
                m = getattr(t, "mask", None)
                if m is not None:
                    block = m.allowed()
                else:  # full and causal tasks must not contain a hidden pair
                    assert not (block & ~want[t.q, t.kv]).any(), (name, rule, rank, src, t)
                got[t.q, t.kv] += block.int()
            assert torch.equal(got, want.int()), (name, rule, rank, src)


def _kind(t):
    return "reversed" if getattr(t, "reversed", False) else "masked" if getattr(t, "mask", None) is not None \
        else "causal" if t.causal else "full"


def test_aligned_window_edges_need_no_mask():
    """A window whose edges fall on tile boundaries: every task is full, causal or reversed (an upper
    triangle, run unmasked on reversed rows): no explicit mask; a reversed task's mask is exactly triu."""
    s, world = 64, 4
    for name, rule in itertools.product(LAYOUTS, (AttentionMask(True, None, (64, -1)),
                                                  AttentionMask(True, None, (128, -1)),
                                                  AttentionMask(False, None, (32, 64)))):
        lay = get_layout(name)
        kinds = set()
        for rank, src in itertools.product(range(world), range(world)):
            for t in schedule(lay, rule, world, rank, src, s, tile=8):
                kinds.add(_kind(t))
                if _kind(t) == "reversed":
                    n = t.q.stop - t.q.start
                    assert t.kv.stop - t.kv.start == n
                    assert torch.equal(t.mask.allowed(), torch.ones(n, n, dtype=torch.bool).triu())
        assert "masked" not in kinds and "reversed" in kinds, (name, rule, kinds)


def test_plain_rule_is_the_layout_schedule():
    for name, world, causal in itertools.product(LAYOUTS, (1, 2, 3, 8), (True, False)):
        lay = get_layout(name)
        for rank, src in itertools.product(range(world), range(world)):
            assert schedule(lay, AttentionMask(causal), world, rank, src, 16) == lay.block_tasks(
                causal, world, rank, src, 16)


def test_many_short_documents_are_grouped():
    """256 documents of 4 tokens on one 1024-token block: a few dozen calls, not 256."""
    lay = get_layout("contiguous")
    rule = AttentionMask(True, tuple(range(0, 1025, 4)))
    tasks = schedule(lay, rule, 1, 0, 0, 1024)
    assert len(tasks) <= 16, len(tasks)
    computed = sum((t.q.stop - t.q.start) * (t.kv.stop - t.kv.start) for t in tasks)
    assert computed <= 1024 * 64 * 1.01  # the diagonal tiles only (1/16 of the block)


def test_window_shortens_the_contiguous_ring():
    s, world = 64, 4
    assert needed_steps(get_layout("contiguous"), AttentionMask(True, None, (40, -1)), world, s) == 2
    assert needed_steps(get_layout("contiguous"), AttentionMask(True, None, (100, -1)), world, s) == 3
    assert needed_steps(get_layout("zigzag"), AttentionMask(True, None, (40, -1)), world, s) == world
    assert needed_steps(get_layout("contiguous"), AttentionMask(False, None, (40, 3)), world, s) == world


def _last_step_with_a_task(layout, rule, world, s):
    """The reference: the steps up to the last one where some rank's schedule (the rule without documents) has a
    task, each schedule built and checked tile by tile."""
    base = AttentionMask(rule.causal, None, rule.window)
    return 1 + max(t for t in range(world)
                   if any(schedule(layout, base, world, r, (r - t) % world, s) for r in range(world)))


def test_needed_steps_are_the_steps_up_to_the_last_with_a_task():
    """The steps a window leaves, from the positions alone, equal those from every rank's schedule: every layout,
    Megatron's per-document zigzag, causal or not, windows on either side and both. Shortened rings are among them."""
    cases, shortened = 0, 0
    for world, s in ((2, 16), (3, 8), (4, 16), (8, 8)):
        layouts = [get_layout(name) for name in LAYOUTS] + [
            masks.DocumentZigzag([0, 2 * world, s * world]),
            masks.DocumentZigzag([0, s * world])]
        if world in (2, 4):  # a2a+p2p's outer ring: super-blocks of 2 shards of the base layout over 2P shards
            layouts += [GroupedView(get_layout("contiguous"), 2), GroupedView(get_layout("zigzag"), 2)]
        for layout, causal, window in itertools.product(
                layouts, (True, False), ((3, 0), (s - 1, 0), (s, -1), (2 * s + 1, 0), (0, 5), (4, 4), (-1, 2 * s),
                                         (3 * s, 3 * s), (-1, -1))):
            rule = AttentionMask(causal, None, window)
            masks._STEPS.clear()
            got = needed_steps(layout, rule, world, s)
            assert got == _last_step_with_a_task(layout, rule, world, s), (layout.name, world, s, causal, window)
            cases += 1
            shortened += got < world
    assert shortened >= 20, (shortened, cases)


def test_padding_rows_are_zero_with_zero_grads():
    q, k, v = (torch.randn(16, 2, 8, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, qkv_format="thd", cu_seqlens=torch.tensor([0, 5, 11]), causal=True)
    out.backward(torch.randn_like(out))
    assert not out.isnan().any() and (out[11:] == 0).all()
    for t in (q, k, v):
        assert not t.grad.isnan().any() and (t.grad[11:] == 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "integer"),
    (dict(cu_seqlens=torch.tensor([[0, 4]])), "1-D"),
    (dict(cu_seqlens=torch.tensor([0, 6, 4])), "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([1, 4])), "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 17])), "past"),
    (dict(window=(-2, 3)), "-1 for unbounded"),
    (dict(window=(3,)), "pair"),
])
def test_bad_document_input_names_the_fix(kwargs, match):
    q = torch.randn(16, 2, 8)
    with pytest.raises(ValueError, match=match):
        ring_attention(q, q, q, qkv_format="thd", causal=True, **kwargs)


def test_thd_with_4d_tensors_and_cu_without_thd():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="sbhd"):
        ring_attention(q, q, q, qkv_format="thd", cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="qkv_format='thd'"):
        ring_attention(q, q, q, qkv_format="bshd", cu_seqlens=torch.tensor([0, 16]))


def _runs_row_by_row(pos: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """The rule of ``masks._runs`` spelled out row by row (the library finds the stride changes with tensor ops):
    a run keeps its first stride; the row after a jump opens the next run; runs are cut into tiles."""
    n, d = len(pos), (pos[1:] - pos[:-1]).tolist()
    cuts, a = [0], 0
    while a < n - 1:
        m = a + 1
        while m < n - 1 and d[m] == d[a]:
            m += 1
        if m >= n - 1:
            break
        cuts.append(m + 1)
        a = m + 1
    cuts.append(n)
    return [(x, min(x + tile, b)) for a, b in zip(cuts, cuts[1:]) for x in range(a, b, tile)]


def test_row_runs_follow_the_row_by_row_rule():
    """``_runs`` (rows of one position stride, cut into tiles) equals the rule spelled out row by row: every
    layout's positions at P = 1..8, and random rows with jumps; a wrong rule (no cut at a jump) does not."""
    rnd = random.Random(0)
    cases = [(get_layout(name).positions(s * world, world, r), tile) for name in LAYOUTS for world in (1, 2, 4, 8)
             for s in (2, 6, 64) for r in range(world) for tile in (1, 5, s)]
    for _ in range(500):
        n = rnd.randint(0, 30)
        pos = torch.tensor(sorted(rnd.sample(range(100), n)))
        if n > 3 and rnd.random() < 0.5:
            pos = torch.cat([pos[: n // 2], pos[n // 2:] + rnd.randint(1, 9)])
        cases.append((pos, rnd.randint(1, 8)))
    for pos, tile in cases:
        assert masks._runs(pos, tile) == _runs_row_by_row(pos, tile), (pos.tolist(), tile)
    zigzag = get_layout("zigzag").positions(16, 2, 0)  # two chunks: a jump between them
    assert masks._runs(zigzag, 8) != [(0, min(8, len(zigzag)))]


def test_tile_pairs_kinds_and_shapes_match_their_masks():
    """The classification of every pair of runs at once (``_kinds``: none / full only where the ``[rows, keys]``
    matrix is so) and a pair's shape from its rows' key ranges (``_shape_of``) equal what the matrix itself gives
    (``_shape``): every layout and Megatron's per-document zigzag, documents with padding, windows, causal or not.
    Every shape occurs; negative control: the shapes of the rule without its documents differ somewhere."""
    rnd = random.Random(3)
    seen, differ = set(), 0
    for world, s in ((2, 48), (4, 32)):
        T = world * s
        cu = (0, 8 * world, 12 * world, 20 * world, T - 2 * world)  # multiples of 2P, padding at the end
        lays = [get_layout(n) for n in LAYOUTS] + [masks.DocumentZigzag(cu[:-1] + (T,))]
        rules = [AttentionMask(c, d, w) for c in (True, False) for d in (cu, None)
                 for w in (None, (5, -1), (6, -1), (9, 3), (-1, 6))]
        for lay, rule, tile in itertools.product(lays, rules, (6, 16)):
            if rule.plain:
                continue
            bare = AttentionMask(rule.causal, None, rule.window)
            for rank, src in rnd.sample(list(itertools.product(range(world), range(world))), 3):
                qp, kp = lay.positions(T, world, rank), lay.positions(T, world, src)
                qdoc, kdoc, qd, kd, pad = masks._documents(rule, qp, kp)
                qr, kr = masks._runs(qp, tile), masks._runs(kp, tile)
                kinds = masks._kinds(rule, masks._run_ends(qp, qd, qr), masks._run_ends(kp, kd, kr), pad)
                for (i, (qa, qb)), (j, (ka, kb)) in itertools.product(enumerate(qr), enumerate(kr)):
                    ok = rule.allowed(qp[qa:qb], qdoc[qa:qb], kp[ka:kb], kdoc[ka:kb])
                    assert kinds[i, j] != masks.NONE or not ok.any()
                    assert kinds[i, j] != masks.FULL or ok.all()
                    assert masks._classify(rule, qp[qa:qb], qd[qa:qb], kp[ka:kb], kd[ka:kb], pad) == \
                        masks._KIND_NAMES[kinds[i, j]]
                    shape = masks._shape_of(rule, qp[qa:qb], qdoc[qa:qb], kp[ka:kb], kdoc[ka:kb])
                    assert shape == masks._shape(ok), (lay.name, rule, rank, src, qa, ka)
                    seen.add(shape)
                    if rule.cu_seqlens is not None and rnd.random() < 0.5:
                        one = torch.zeros(qb - qa, dtype=torch.int64)
                        differ += masks._shape_of(bare, qp[qa:qb], one, kp[ka:kb], one[:kb - ka]) != shape
    assert seen == {"none", "full", "causal", "reversed", "causal-1", "reversed-1", "mixed"}, seen
    assert differ  # the negative control


def test_the_schedule_cache_is_bounded_in_bytes(monkeypatch):
    """A packed batch brings new documents, so new schedules, every micro-batch: the cache keeps the recent ones up
    to its bound on the bytes their masks hold (here 1 MiB), not 4096 of any size; an evicted schedule is made again
    alike. Negative control: bounded by the count only, all 24 stay."""
    from megatron_ring.schedules.bounded import BoundedLRU

    layout, s = get_layout("striped"), 4096

    def plan_all(cache):
        monkeypatch.setattr(masks, "_CACHE", cache)
        first = None
        for seed in range(24):
            cu = (0, 100 + seed, 2 * s - 50, 2 * s)
            tasks = schedule(layout, AttentionMask(True, cu), 2, 0, 1, s, s)
            first = first or (cu, tasks)
        return first

    cache = BoundedLRU(4096, 1 << 20, masks._held_bytes)
    cu, tasks = plan_all(cache)
    per_schedule = masks._held_bytes(tasks)
    assert per_schedule >= 4 * 8 * s // 2  # the masks' index vectors (int64)
    assert cache.held <= 1 << 20 and len(cache) == (1 << 20) // per_schedule < 24
    again = schedule(layout, AttentionMask(True, cu), 2, 0, 1, s, s)  # evicted: planned anew, alike
    assert again is not tasks and [(t.q, t.kv, t.kind) for t in again] == [(t.q, t.kv, t.kind) for t in tasks]
    unbounded = BoundedLRU(4096, 1 << 40, masks._held_bytes)
    plan_all(unbounded)
    assert len(unbounded) == 24


def test_bounded_lru_keeps_the_newest_within_both_bounds():
    from megatron_ring.schedules.bounded import BoundedLRU

    c = BoundedLRU(3, 10, len)
    for k in "abc":
        c.put(k, "xx")
    assert c.get("a") == "xx"  # now the most recent
    c.put("d", "xx")  # four entries: the oldest ("b") goes
    assert c.get("b") is None and len(c) == 3 and c.held == 6
    c.put("e", "x" * 9)  # 15 bytes: the oldest go until 10 or one entry is left
    assert [c.get(k) is not None for k in "acde"] == [False, False, False, True] and c.held == 9
    c.put("f", "x" * 50)  # the newest is always kept, whatever its size
    assert len(c) == 1 and c.get("f") and c.held == 50
    c.put("f", "x")  # replacing an entry replaces its weight
    assert c.held == 1
    c.clear()
    assert len(c) == 0 and c.held == 0
