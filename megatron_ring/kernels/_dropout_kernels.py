"""The Triton kernels of :mod:`.dropout_triton` (imported, with Triton, at the first launch only; the interpreter
tests re-import it under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads when it decorates)."""
import triton
import triton.language as tl


@triton.jit
def _own_larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _own_plus(a, b):
    return a + b


# The combine functions of the row reductions: Triton's own, those of ``tl.max`` and ``tl.sum`` (the same bodies as
# the fallbacks above), passed to ``tl.reduce`` (a builtin): ``tl.max``/``tl.sum`` are jitted wrappers, which
# Triton's interpreter cannot call when Triton was imported before it was asked for. The interpreter reduces
# Triton's own with numpy; a kernel's own combine function it runs element by element in Python (the dropout
# kernels' interpreted tests took ~5x as long).
_larger = getattr(tl.standard, "_elementwise_max", _own_larger)
_plus = getattr(tl.standard, "_sum_combine", _own_plus)


@triton.jit
def _fmix(x):
    """murmur3's 32-bit finaliser on uint32 (kernels/dropout.py ``_fmix``)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([], 0xC2B2AE35, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_hash(seed, rid, qpos):
    """The hash of (row id, query position): ``fmix(fmix(rid * C + seed) ^ qpos)``, per query row."""
    r = _fmix(rid.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32) + seed)
    return _fmix(r ^ qpos.to(tl.uint32))


@triton.jit
def _key_hash(kpos):
    return _fmix(kpos.to(tl.uint32) * tl.full([], 0x27D4EB2F, tl.uint32) + tl.full([], 0x165667B1, tl.uint32))


@triton.jit
def _seed(SEED, seed_int, SEED_PTR: tl.constexpr):
    """The seed folded to 32 bits (kernels/dropout.py ``_seed32``): ``seed_int`` folded on the host, or the
    one-element int64 device seed folded here, ``(s ^ (s >> 32))`` (arithmetic shift) to its low word."""
    if SEED_PTR:
        s = tl.load(SEED).to(tl.int64)
        return (s ^ (s >> 32)).to(tl.uint32)
    return seed_int.to(tl.uint32)


@triton.jit
def _visible(rows, cols, row_ok, col_ok, mq, mk, qd, kd, LEFT, RIGHT,
             CAUSAL: tl.constexpr, MASKED: tl.constexpr, RULE_CAUSAL: tl.constexpr,
             WIN_L: tl.constexpr, WIN_R: tl.constexpr):
    vis = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        vis = vis & (cols[None, :] <= rows[:, None])
    if MASKED:
        vis = vis & (qd[:, None] == kd[None, :]) & (qd >= 0)[:, None]
        if RULE_CAUSAL:
            vis = vis & (mk[None, :] <= mq[:, None])
        if WIN_L:
            vis = vis & (mk[None, :] >= mq[:, None] - LEFT)
        if WIN_R:
            vis = vis & (mk[None, :] <= mq[:, None] + RIGHT)
    return vis


@triton.jit
def _tile(P, b, h, s_b, s_h, s_n, s_d, idx, ok, dcols, D):
    """The ``[len(idx), len(dcols)]`` tile of head ``h`` of batch row ``b``: rows ``idx`` (``ok``: in range), head-dim
    columns ``dcols`` (those ``< D``); 0 outside."""
    return tl.load(P + b * s_b + h * s_h + idx[:, None] * s_n + dcols[None, :] * s_d,
                   mask=ok[:, None] & (dcols[None, :] < D), other=0.0)


@triton.jit
def _mask_vectors(MPOS, DOC, idx, ok, pad, MASKED: tl.constexpr):
    """An explicit mask's positions and documents of the rows (or keys) ``idx`` (``pad``: the document of a row out
    of range); ``idx`` itself for both where the task has no explicit mask (unused then)."""
    pos = idx
    doc = idx
    if MASKED:  # int32 (positions and document ids of one stream): int64 [BM, BN] comparisons spill registers
        pos = tl.load(MPOS + idx, mask=ok, other=0).to(tl.int32)
        doc = tl.load(DOC + idx, mask=ok, other=pad).to(tl.int32)
    return pos, doc


@triton.jit
def _any(vis, MASKED: tl.constexpr):
    """Whether a tile pair has a visible pair (an explicit mask's tile pairs may have none: the work is skipped);
    always where the task has no explicit mask."""
    if MASKED:
        return tl.reduce(tl.reduce(vis.to(tl.int32), 1, _larger), 0, _larger) > 0
    return True


@triton.jit
def _kept(hq, hkey, thresh, inv_keep):
    """``1 / (1 - p)`` where the pair is kept, else 0: the row hashes ``hq`` against the key hashes ``hkey``."""
    return tl.where((_fmix(hq[:, None] ^ hkey[None, :]) >> 8) >= thresh, inv_keep, 0.0)


@triton.jit
def _ds(q, k, v, do, lse, delta, vis, z, scale):
    """The backward's probabilities ``p`` (the forward's, from its lse; 0 where hidden) and ``dS / scale`` of one
    tile pair: ``p (dP z - delta)``."""
    p = tl.where(vis, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
    return p, p * (tl.dot(do, tl.trans(v)) * z - delta[:, None])


@triton.jit
def _query_tile(H, G, M, N, BM: tl.constexpr, CAUSAL: tl.constexpr):
    """The program's batch row ``b``, query head ``h`` and K/V head, its query rows and which are in range (program
    ids: query tile, batch row x head), and the end of the keys they may see (causal: the tile's last row)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BM)
    return b, h, h // G, rows, rows < M, hi


@triton.jit
def _key_tile(start, N, MKPOS, KDOC, rows, row_ok, mq, qd, LEFT, RIGHT, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              RULE_CAUSAL: tl.constexpr, WIN_L: tl.constexpr, WIN_R: tl.constexpr, BN: tl.constexpr):
    """The key tile from ``start``: its columns, which are in range, and the pairs the query rows see there."""
    cols = start + tl.arange(0, BN)
    col_ok = cols < N
    mk, kd = _mask_vectors(MKPOS, KDOC, cols, col_ok, -2, MASKED)
    vis = _visible(rows, cols, row_ok, col_ok, mq, mk, qd, kd, LEFT, RIGHT, CAUSAL, MASKED, RULE_CAUSAL, WIN_L, WIN_R)
    return cols, col_ok, vis


@triton.jit
def _rows_hash(QPOS, seed, b, HEADS, HOFF, h, rows, row_ok):
    """The row hashes of query head ``h`` (``HOFF + h`` of the call's ``HEADS``) at the rows' global positions."""
    return _row_hash(seed, b * HEADS + HOFF + h, tl.load(QPOS + rows, mask=row_ok, other=0))


@triton.jit(do_not_specialize=["seed_int"])  # a folded seed of 1 would become a constexpr (no .to)
def dropout_fwd(Q, K, V, O, L, QPOS, KPOS, MQPOS, MKPOS, QDOC, KDOC, SEED, seed_int,
                s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                s_ob, s_oh, s_om, s_od, s_lb, s_lh, s_lm,
                H, G, HEADS, HOFF, M, N, DQK, DV, scale, thresh, inv_keep, LEFT, RIGHT,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, RULE_CAUSAL: tl.constexpr, WIN_L: tl.constexpr,
                WIN_R: tl.constexpr, SEED_PTR: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr):
    """Output and lse of one query tile of one head: the online softmax over the key tiles."""
    b, h, hk, rows, row_ok, hi = _query_tile(H, G, M, N, BM, CAUSAL)
    dq_ = tl.arange(0, BDQ)
    dv_ = tl.arange(0, BDV)
    q = _tile(Q, b, h, s_qb, s_qh, s_qm, s_qd, rows, row_ok, dq_, DQK)
    hq = _rows_hash(QPOS, _seed(SEED, seed_int, SEED_PTR), b, HEADS, HOFF, h, rows, row_ok)
    mq, qd = _mask_vectors(MQPOS, QDOC, rows, row_ok, -1, MASKED)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.full([BM, BDV], 0.0, tl.float32)
    for start in range(0, hi, BN):
        cols, col_ok, vis = _key_tile(start, N, MKPOS, KDOC, rows, row_ok, mq, qd, LEFT, RIGHT,
                                      CAUSAL, MASKED, RULE_CAUSAL, WIN_L, WIN_R, BN)
        if _any(vis, MASKED):
            k = _tile(K, b, hk, s_kb, s_kh, s_kn, s_kd, cols, col_ok, dq_, DQK)
            s = tl.where(vis, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _larger))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _plus)
            z = _kept(hq, _key_hash(tl.load(KPOS + cols, mask=col_ok, other=0)), thresh, 1.0)
            v = _tile(V, b, hk, s_vb, s_vh, s_vn, s_vd, cols, col_ok, dv_, DV)
            acc = acc * alpha[:, None] + tl.dot((p * z).to(v.dtype), v)
            m_i = m_new
    inv = tl.where(l_i == 0.0, 0.0, inv_keep / l_i)
    tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_om + dv_[None, :] * s_od,
             (acc * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & (dv_[None, :] < DV))
    tl.store(L + b * s_lb + h * s_lh + rows * s_lm,
             tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i)), mask=row_ok)


@triton.jit(do_not_specialize=["seed_int"])  # a folded seed of 1 would become a constexpr (no .to)
def dropout_bwd_kv(Q, K, V, DO, L, DELTA, DK, DVG, QPOS, KPOS, MQPOS, MKPOS, QDOC, KDOC, SEED, seed_int,
                   s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                   s_ob, s_oh, s_om, s_od, s_lb, s_lh, s_lm,
                   s_gb, s_gh, s_gn, s_gd, s_wb, s_wh, s_wn, s_wd,
                   HK, G, HEADS, HOFF, M, N, DQK, DV, scale, thresh, inv_keep, LEFT, RIGHT,
                   CAUSAL: tl.constexpr, MASKED: tl.constexpr, RULE_CAUSAL: tl.constexpr, WIN_L: tl.constexpr,
                   WIN_R: tl.constexpr, SEED_PTR: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr):
    """dK, dV of one key tile of one K/V head, over the group's query heads (DO, L, DELTA: strides s_o*, s_l*;
    DK: s_g*, DVG: s_w*)."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HK).to(tl.int64)
    hk = (bhk % HK).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    dq_ = tl.arange(0, BDQ)
    dv_ = tl.arange(0, BDV)
    k = _tile(K, b, hk, s_kb, s_kh, s_kn, s_kd, cols, col_ok, dq_, DQK)
    v = _tile(V, b, hk, s_vb, s_vh, s_vn, s_vd, cols, col_ok, dv_, DV)
    hkey = _key_hash(tl.load(KPOS + cols, mask=col_ok, other=0))
    mk, kd = _mask_vectors(MKPOS, KDOC, cols, col_ok, -2, MASKED)
    seed = _seed(SEED, seed_int, SEED_PTR)
    dk = tl.full([BN, BDQ], 0.0, tl.float32)
    dv = tl.full([BN, BDV], 0.0, tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BN // BM) * BM
    for g in range(0, G):
        h = hk * G + g
        for start in range(lo, M, BM):
            rows = start + tl.arange(0, BM)
            row_ok = rows < M
            mq, qd = _mask_vectors(MQPOS, QDOC, rows, row_ok, -1, MASKED)
            vis = _visible(rows, cols, row_ok, col_ok, mq, mk, qd, kd, LEFT, RIGHT,
                           CAUSAL, MASKED, RULE_CAUSAL, WIN_L, WIN_R)
            if _any(vis, MASKED):
                q = _tile(Q, b, h, s_qb, s_qh, s_qm, s_qd, rows, row_ok, dq_, DQK)
                do = _tile(DO, b, h, s_ob, s_oh, s_om, s_od, rows, row_ok, dv_, DV)
                lse = tl.load(L + b * s_lb + h * s_lh + rows * s_lm, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + (b * HK * G + h) * M + rows, mask=row_ok, other=0.0)
                z = _kept(_rows_hash(QPOS, seed, b, HEADS, HOFF, h, rows, row_ok), hkey, thresh, inv_keep)
                p, ds = _ds(q, k, v, do, lse, delta, vis, z, scale)
                dv += tl.dot(tl.trans((p * z).to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(DK + b * s_gb + hk * s_gh + cols[:, None] * s_gn + dq_[None, :] * s_gd,
             (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & (dq_[None, :] < DQK))
    tl.store(DVG + b * s_wb + hk * s_wh + cols[:, None] * s_wn + dv_[None, :] * s_wd,
             dv.to(DVG.dtype.element_ty), mask=col_ok[:, None] & (dv_[None, :] < DV))


@triton.jit(do_not_specialize=["seed_int"])  # a folded seed of 1 would become a constexpr (no .to)
def dropout_bwd_q(Q, K, V, DO, L, DELTA, DQ, QPOS, KPOS, MQPOS, MKPOS, QDOC, KDOC, SEED, seed_int,
                  s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
                  s_ob, s_oh, s_om, s_od, s_lb, s_lh, s_lm, s_gb, s_gh, s_gm, s_gd,
                  H, G, HEADS, HOFF, M, N, DQK, DV, scale, thresh, inv_keep, LEFT, RIGHT,
                  CAUSAL: tl.constexpr, MASKED: tl.constexpr, RULE_CAUSAL: tl.constexpr, WIN_L: tl.constexpr,
                  WIN_R: tl.constexpr, SEED_PTR: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BDQ: tl.constexpr, BDV: tl.constexpr):
    """dQ of one query tile of one head (DQ: strides s_g*)."""
    b, h, hk, rows, row_ok, hi = _query_tile(H, G, M, N, BM, CAUSAL)
    dq_ = tl.arange(0, BDQ)
    dv_ = tl.arange(0, BDV)
    q = _tile(Q, b, h, s_qb, s_qh, s_qm, s_qd, rows, row_ok, dq_, DQK)
    do = _tile(DO, b, h, s_ob, s_oh, s_om, s_od, rows, row_ok, dv_, DV)
    lse = tl.load(L + b * s_lb + h * s_lh + rows * s_lm, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (b * H + h) * M + rows, mask=row_ok, other=0.0)
    hq = _rows_hash(QPOS, _seed(SEED, seed_int, SEED_PTR), b, HEADS, HOFF, h, rows, row_ok)
    mq, qd = _mask_vectors(MQPOS, QDOC, rows, row_ok, -1, MASKED)
    dq = tl.full([BM, BDQ], 0.0, tl.float32)
    for start in range(0, hi, BN):
        cols, col_ok, vis = _key_tile(start, N, MKPOS, KDOC, rows, row_ok, mq, qd, LEFT, RIGHT,
                                      CAUSAL, MASKED, RULE_CAUSAL, WIN_L, WIN_R, BN)
        if _any(vis, MASKED):
            k = _tile(K, b, hk, s_kb, s_kh, s_kn, s_kd, cols, col_ok, dq_, DQK)
            v = _tile(V, b, hk, s_vb, s_vh, s_vn, s_vd, cols, col_ok, dv_, DV)
            z = _kept(hq, _key_hash(tl.load(KPOS + cols, mask=col_ok, other=0)), thresh, inv_keep)
            _, ds = _ds(q, k, v, do, lse, delta, vis, z, scale)
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + b * s_gb + h * s_gh + rows[:, None] * s_gm + dq_[None, :] * s_gd,
             (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dq_[None, :] < DQK))


@triton.jit
def dropout_delta(O, DO, DELTA, s_ob, s_oh, s_om, s_od, s_db, s_dh, s_dm, s_dd, H, M, DV,
                  BM: tl.constexpr, BDV: tl.constexpr):
    """``delta = rowsum(dO * O)`` in fp32 for one tile of query rows of one head (DELTA: ``[b, h, M]``
    contiguous)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    dv_ = tl.arange(0, BDV)
    o = _tile(O, b, h, s_ob, s_oh, s_om, s_od, rows, row_ok, dv_, DV)
    do = _tile(DO, b, h, s_db, s_dh, s_dm, s_dd, rows, row_ok, dv_, DV)
    tl.store(DELTA + (b * H + h) * M + rows, tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _plus), mask=row_ok)
