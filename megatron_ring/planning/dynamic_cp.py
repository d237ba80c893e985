"""Dynamic context parallelism: each packed sub-sample of a global batch on the CP group its length needs.

Given the documents of one global batch (their lengths) and the ``world`` DP x CP ranks, a schedule says
which consecutive ranks run which documents: every :class:`SubSample` is ONE ``ring_attention`` call
(``qkv_format="thd"``, ``cu_seqlens`` of its documents, padded at the end to the layout's multiple) on
the group of its ranks. Every rank runs its sub-samples in the round's one list order (a sub-sample
starts when the last of its ranks is free: no deadlock, as the earliest unfinished sub-sample always has
all its ranks free); a round ends with a barrier (Megatron's policy uses several rounds, ours one). See
docs/dynamic_cp.md.

* :func:`schedule_dynamic_cp`: ours. Minimises the slowest rank's PREDICTED time (cost model: causal work
  per rank of the packed documents, exchange bytes and latency, overlap, per comm type) by list
  scheduling on a timeline without barriers; group sizes any integer ``1..world`` (the ring is exact for
  any P) or powers of two (``sizes="pow2"``, Megatron's groups; ``aligned=True``: its exact groups).
* :func:`schedule_megatron_balanced`: our own implementation of the policy of megatron-core's
  ``BalancedCPScheduler`` (token-count workload ``L^2/cp``, power-of-two groups, rounds with barriers),
  as the baseline.
* :func:`schedule_fixed_cp`: fixed CP size ``cp`` x DP ``world/cp``: documents packed in arrival order into
  sequences of ``cp * max_tokens_per_rank`` tokens, dealt round-robin to the DP replicas.
* :func:`predict_schedule` / :class:`PackCost`: the prediction any schedule is judged by.

The prediction of one sub-sample (:class:`PackCost`) wraps the cost model's public :func:`predict`:
compute = the model's compute-only time of the padded stream as one causal sequence, scaled by the
busiest rank's share of the visible (query, key) pairs of the DOCUMENT mask over that of the plain causal
mask (exact pair counts from the layout's positions); exchange = the model's transfer-only time of the
same call; the two overlap as the machine's ``overlap`` says (``C + X - overlap * min(C, X)``).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Sequence

from megatron_ring.schedules.layouts import get_layout
from megatron_ring.planning.cost_model import (Machine, Problem, activation_bytes, candidate_types, predict,
                                                 workspace_bytes)

__all__ = ["SubSample", "DynamicCPSchedule", "PackCost", "schedule_dynamic_cp", "schedule_megatron_balanced",
           "schedule_fixed_cp", "predict_schedule", "padded_length"]


@dataclass(frozen=True)
class SubSample:
    """One ring-attention call: ``docs`` (ids into the batch) packed in this order on ``ranks``."""

    ranks: tuple[int, ...]  # consecutive indices into the DP x CP group
    docs: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: int  # tokens of the packed stream after end padding (a multiple of the layout's need)
    comm_type: str = "p2p"
    predicted_s: float = 0.0
    bytes_per_rank: float = 0.0
    memory_bytes: float = 0.0  # per rank, one layer: activations + the comm type's workspace

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


@dataclass(frozen=True)
class DynamicCPSchedule:
    """Rounds of sub-samples (a barrier after each round), their prediction, and who made them."""

    world: int
    rounds: tuple[tuple[SubSample, ...], ...]
    policy: str
    step_s: float = 0.0  # predicted slowest-rank time: sum over rounds of the round's busiest rank
    rank_s: tuple[float, ...] = ()  # predicted busy seconds per rank

    @property
    def imbalance(self) -> float:
        """Slowest rank's time (barrier waits included) over the mean busy time (1.0: perfect)."""
        mean = sum(self.rank_s) / max(1, len(self.rank_s))
        return self.step_s / mean if mean > 0 else 1.0

    @property
    def subsamples(self) -> list[SubSample]:
        return [s for r in self.rounds for s in r]

    def for_rank(self, rank: int) -> list[list[SubSample]]:
        """Per round, the sub-samples ``rank`` takes part in, in the order it runs them."""
        return [[s for s in rnd if rank in s.ranks] for rnd in self.rounds]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Distinct rank groups (size > 1) in first-use order: create them on every rank in this order."""
        seen: dict[tuple[int, ...], None] = {}
        for s in self.subsamples:
            if s.size > 1:
                seen.setdefault(s.ranks, None)
        return list(seen)

    def bytes_per_rank(self) -> list[float]:
        out = [0.0] * self.world
        for s in self.subsamples:
            for r in s.ranks:
                out[r] += s.bytes_per_rank
        return out

    def memory_per_rank(self) -> list[float]:
        out = [0.0] * self.world
        for s in self.subsamples:
            for r in s.ranks:
                out[r] = max(out[r], s.memory_bytes)
        return out


def padded_length(total: int, size: int, layout: str = "zigzag") -> int:
    """Tokens after end padding so that ``size`` ranks can split the stream with ``layout``
    (zigzag: a multiple of 2P; striped and contiguous: of P)."""
    need = get_layout(layout).local_multiple() * size
    return max(need, -(-total // need) * need)


_PROGRESSIONS: dict[tuple, list[list[tuple[int, int, int]]]] = {}


def _progressions(layout, padded: int, size: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, its global positions as arithmetic runs ``(first, count, step)`` (zigzag: two runs;
    contiguous: one; striped: one of step P); cached."""
    key = (layout.name, padded, size)
    if key not in _PROGRESSIONS:
        out = []
        for r in range(size):
            pos = layout.positions(padded, size, r).tolist()
            runs, i = [], 0
            while i < len(pos):
                step = pos[i + 1] - pos[i] if i + 1 < len(pos) else 1
                j = i + 1
                while j < len(pos) and pos[j] - pos[j - 1] == step:
                    j += 1
                runs.append((pos[i], j - i, step))
                i = j
            out.append(runs)
        if len(_PROGRESSIONS) > 4096:
            _PROGRESSIONS.clear()
        _PROGRESSIONS[key] = out
    return _PROGRESSIONS[key]


def _causal_pairs_per_rank(layout, cu: Sequence[int], padded: int, size: int) -> list[int]:
    """Exact visible (query, key) pairs per rank of causal attention within documents (keys <= query in
    the same document, the diagonal included: the cost model's ``rows (rows + 1) / 2`` convention).
    Closed form: a query at position q of a document starting at a sees ``q - a + 1`` keys, summed over
    each rank's arithmetic runs of positions."""
    out = []
    for runs in _progressions(layout, padded, size):
        total = 0
        for first, count, step in runs:
            last = first + (count - 1) * step
            for a, b in zip(cu[:-1], cu[1:]):
                if b <= a or b <= first or a > last:
                    continue
                k0 = max(0, -(-(a - first) // step))  # first run index with q >= a
                k1 = min(count, -(-(b - first) // step))  # past the last with q < b
                n = k1 - k0
                if n > 0:
                    total += n * (first - a + 1) + step * (k0 + k1 - 1) * n // 2
        out.append(total)
    return out


class PackCost:
    """Predicted forward+backward seconds (one layer's attention) of one packed sub-sample on P ranks.

    ``problem`` gives heads, K/V heads, head dim, dtype, layout and batch (its ``seq`` is ignored);
    ``comm_types`` the exchanges to consider (the cheapest predicted one is used per sub-sample; those
    that cannot run for the head count are skipped)."""

    def __init__(self, problem: Problem, machine: Machine, comm_types: Sequence[str] = ("p2p",)) -> None:
        self.problem, self.machine, self.comm_types = problem, machine, tuple(comm_types)
        self.layout = get_layout(problem.layout)
        self._compute_only = dataclasses.replace(machine, bw_intra=1e30, bw_inter=None, latency=0.0)
        self._comm_only = dataclasses.replace(machine, flops=1e30, bwd_flops=1e30, call_overhead=0.0)
        self._cache: dict[tuple, dict] = {}

    def pad(self, total: int, size: int) -> int:
        return padded_length(total, size, self.problem.layout)

    def __call__(self, lengths: Sequence[int], size: int) -> dict:
        """{time_s, comm_type, bytes_per_rank, memory_bytes, padded} of the documents ``lengths`` packed."""
        lengths = tuple(int(n) for n in lengths)
        key = (lengths, size)
        if key not in self._cache:
            self._cache[key] = self._predict(lengths, size)
        return self._cache[key]

    def _predict(self, lengths: tuple[int, ...], size: int) -> dict:
        padded = self.pad(sum(lengths), size)
        pb = dataclasses.replace(self.problem, seq=padded, causal=True)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        docs = max(_causal_pairs_per_rank(self.layout, cu, padded, size))
        plain = self._plain(padded, size)
        share = docs / plain if plain else 0.0
        ov = self.machine.overlap
        best = None
        for ct in self.comm_types:
            if ct not in candidate_types(pb.heads, size, None):
                continue
            c = self._model(ct, pb, size, "compute")["time_s"] * share
            full = self._model(ct, pb, size, "full")
            x = self._model(ct, pb, size, "comm")["time_s"] if size > 1 else 0.0
            t = c + x - ov * min(c, x)
            row = {"time_s": t, "comm_type": ct, "bytes_per_rank": full["bytes_per_rank"], "padded": padded,
                   "compute_s": c, "exchange_s": x,
                   "memory_bytes": activation_bytes(pb, size) + workspace_bytes(ct, pb, size)}
            if best is None or t < best["time_s"]:
                best = row
        if best is None:
            raise ValueError(f"none of the comm types {self.comm_types} can run on {size} ranks with "
                             f"{pb.heads} heads; add 'p2p' to comm_types")
        return best

    def _plain(self, padded: int, size: int) -> int:
        key = ("plain", padded, size)
        if key not in self._cache:
            self._cache[key] = max(_causal_pairs_per_rank(self.layout, [0, padded], padded, size))
        return self._cache[key]

    def _model(self, ct: str, pb: Problem, size: int, which: str) -> dict:
        key = ("model", ct, pb.seq, size, which)
        if key not in self._cache:
            m = {"full": self.machine, "compute": self._compute_only, "comm": self._comm_only}[which]
            self._cache[key] = predict(ct, pb, size, m)
        return self._cache[key]

    def subsample(self, ranks: Sequence[int], docs: Sequence[int], lengths: Sequence[int]) -> SubSample:
        p = self(lengths, len(ranks))
        return SubSample(tuple(ranks), tuple(docs), tuple(int(n) for n in lengths), p["padded"], p["comm_type"],
                         p["time_s"], p["bytes_per_rank"], p["memory_bytes"])


def predict_schedule(rounds: Sequence[Sequence[SubSample]], world: int, policy: str) -> DynamicCPSchedule:
    """A :class:`DynamicCPSchedule` with its prediction. Within a round every rank runs its sub-samples in the
    round's list order, and a sub-sample starts when the last of its ranks is free (the ring exchange
    itself waits for the partners); a round ends when its last rank is done (the barrier)."""
    rank_s = [0.0] * world
    step = 0.0
    for rnd in rounds:
        free = [0.0] * world
        for sub in rnd:
            start = max(free[r] for r in sub.ranks)
            for r in sub.ranks:
                free[r] = start + sub.predicted_s
                rank_s[r] += sub.predicted_s
        step += max(free)
    return DynamicCPSchedule(world, tuple(tuple(r) for r in rounds), policy, step, tuple(rank_s))


def _check(lengths: Sequence[int], world: int, max_tokens_per_rank: int | None) -> list[int]:
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    lens = [int(n) for n in lengths]
    if any(n < 0 for n in lens):
        raise ValueError("document lengths must be >= 0")
    if max_tokens_per_rank is not None and max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
    return lens


def _min_size(n: int, cost: PackCost, cap: int | None, sizes: Sequence[int]) -> int | None:
    for p in sizes:
        if cap is None or cost.pad(n, p) // p <= cap:
            return p
    return None


def _allowed_sizes(world: int, sizes: str | Sequence[int]) -> list[int]:
    if sizes == "any":
        return list(range(1, world + 1))
    if sizes == "pow2":
        return [p for p in range(1, world + 1) if p & (p - 1) == 0] + ([world] if world & (world - 1) else [])
    out = sorted({int(p) for p in sizes if 1 <= int(p) <= world})
    if not out:
        raise ValueError(f"sizes {sizes!r} holds no group size in 1..{world}")
    return out


def _too_long(n: int, world: int, cap: int | None) -> ValueError:
    return ValueError(f"a document of {n} tokens does not fit on {world} ranks with max_tokens_per_rank={cap}; "
                      f"raise max_tokens_per_rank (memory allowing) or use more ranks")


def _timeline(order: Sequence[int], lens: Sequence[int], world: int, cost: PackCost, cap: int | None,
              sizes: Sequence[int], aligned: bool, alpha: float) -> list[tuple[tuple[int, ...], int]]:
    """List scheduling: each document (in ``order``) on the consecutive ranks and group size where it
    finishes first, plus ``alpha`` x its rank-seconds / world (a price on work, so that a document does not
    take many ranks to finish a little earlier). Returns [(ranks, doc)] in start order."""
    free = [0.0] * world
    placed = []
    for d in order:
        best = None
        prev, rising = None, 0
        for p in sizes:
            if cap is not None and cost.pad(lens[d], p) // p > cap:
                continue
            t = cost([lens[d]], p)["time_s"]
            rising = rising + 1 if prev is not None and t >= prev else 0
            prev = t
            if rising >= 2:  # slower on more ranks twice in a row: larger groups only cost more
                break
            for s0 in range(0, world - p + 1, p if aligned else 1):
                start = max(free[s0:s0 + p])
                key = (start + t + alpha * p * t / world, start + t, p, s0)
                if best is None or key < best[0]:
                    best = (key, p, s0, start + t)
        _, p, s0, end = best
        for r in range(s0, s0 + p):
            free[r] = end
        placed.append((end - cost([lens[d]], p)["time_s"], tuple(range(s0, s0 + p)), d))
    placed.sort(key=lambda x: (x[0], x[1][0]))
    return [(ranks, d) for _, ranks, d in placed]


def _merge(placed: list[tuple[tuple[int, ...], int]], lens: Sequence[int], cost: PackCost,
           cap: int | None) -> list[SubSample]:
    """Consecutive documents on the same ranks (nothing else on those ranks between them) become one
    packed sub-sample while it fits the cap and is not predicted slower than running them apart."""
    runs: list[list] = []  # [ranks, docs]
    last: dict[int, int] = {}  # rank -> index of its latest run
    for ranks, d in placed:
        i = last.get(ranks[0])
        if i is not None and runs[i][0] == ranks and all(last.get(r) == i for r in ranks):
            docs = runs[i][1] + [d]
            ls = [lens[x] for x in docs]
            fits = cap is None or cost.pad(sum(ls), len(ranks)) // len(ranks) <= cap
            if fits and cost(ls, len(ranks))["time_s"] <= (cost([lens[x] for x in runs[i][1]], len(ranks))["time_s"]
                                                           + cost([lens[d]], len(ranks))["time_s"]):
                runs[i][1] = docs
                continue
        runs.append([ranks, [d]])
        for r in ranks:
            last[r] = len(runs) - 1
    return [cost.subsample(ranks, docs, [lens[x] for x in docs]) for ranks, docs in runs]


ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0)


def schedule_dynamic_cp(lengths: Sequence[int], world: int, problem: Problem, machine: Machine, *,
                        max_tokens_per_rank: int | None = None, sizes: str | Sequence[int] = "any",
                        aligned: bool = False, comm_types: Sequence[str] = ("p2p",), seed: int = 0,
                        pack: bool = True, cost: PackCost | None = None) -> DynamicCPSchedule:
    """Our scheduler: group sizes, placement and packing that minimise the slowest rank's predicted time.

    Args:
        lengths: document lengths of the global batch (tokens; 0-length documents are placed nowhere
            and listed in no sub-sample).
        world: DP x CP ranks.
        problem: attention shape (heads, K/V heads, head dim, dtype bytes, layout); ``seq`` is ignored.
        machine: the cost model's machine numbers (measured ones for the cluster at hand).
        max_tokens_per_rank: memory cap: no sub-sample may hold more than this many (padded) tokens per
            rank (Megatron's ``max_seqlen_per_dp_cp_rank``); None: no cap.
        sizes: "any" (every group size 1..world: exact for the ring with end padding), "pow2" (the sizes
            megatron-core's ``parallel_state`` builds for hybrid CP), or an explicit list.
        aligned: groups of size p start at a multiple of p (megatron-core's hybrid groups: with
            ``sizes="pow2"`` every group is one ``parallel_state`` already holds).
        comm_types: exchanges to consider per sub-sample (the cheapest predicted one is used).
        seed: breaks ties between documents of equal length (the result is a function of the batch, the
            arguments and the seed only: no clocks, no global random state).
        pack: pack consecutive documents on the same ranks into one sub-sample (one call); False: one
            document per sub-sample (Megatron's hybrid-CP data path moves and runs documents one by one).

    Algorithm (one round, no barriers): documents, longest first, are list-scheduled on a timeline of the
    ranks: each goes to the group size and consecutive ranks where it is predicted to finish first, plus
    a price ``alpha`` on the rank-seconds it uses; consecutive documents on the same ranks are then packed
    into one sub-sample when that is not predicted slower. Every rank runs its sub-samples in the one
    global start order, so a group's ranks meet without a barrier and no rank can deadlock (the earliest
    unfinished sub-sample always has all its ranks free). Several prices (``ALPHAS``) are tried and the
    baselines (:func:`schedule_fixed_cp` for every allowed size dividing ``world``;
    :func:`schedule_megatron_balanced` when a cap is given and its group sizes are allowed) are candidates
    too: the best prediction wins, so the result is never predicted slower than any of them.
    """
    lens = _check(lengths, world, max_tokens_per_rank)
    allowed = _allowed_sizes(world, sizes)
    cost = cost or PackCost(problem, machine, comm_types)
    rnd = random.Random(seed)
    tie = list(range(len(lens)))
    rnd.shuffle(tie)
    order = sorted((d for d in range(len(lens)) if lens[d] > 0), key=lambda d: (-lens[d], tie[d]))
    for d in order:
        if _min_size(lens[d], cost, max_tokens_per_rank, allowed) is None:
            raise _too_long(lens[d], world, max_tokens_per_rank)
    if not order:
        return predict_schedule([()], world, "dynamic")
    out = None
    for alpha in ALPHAS:
        placed = _timeline(order, lens, world, cost, max_tokens_per_rank, allowed, aligned, alpha)
        subs = _merge(placed, lens, cost, max_tokens_per_rank) if pack else \
            [cost.subsample(ranks, [d], [lens[d]]) for ranks, d in placed]
        cand = predict_schedule([subs], world, "dynamic")
        if out is None or cand.step_s < out.step_s * (1 - 1e-9):
            out = cand
    for base in _baselines(lens, world, problem, machine, max_tokens_per_rank, set(allowed), cost):
        ok = all((not aligned or x.ranks[0] % x.size == 0) and (pack or len(x.docs) == 1) for x in base.subsamples)
        if ok and base.step_s < out.step_s:  # exact: never predicted slower than a baseline
                out = dataclasses.replace(base, policy=f"dynamic (= {base.policy})")
    return out


def _baselines(lens, world, problem, machine, cap, allowed, cost) -> list[DynamicCPSchedule]:
    out = []
    for cp in sorted(allowed):
        if world % cp == 0:
            try:
                out.append(schedule_fixed_cp(lens, world, cp, problem, machine, max_tokens_per_rank=cap, cost=cost))
            except ValueError:
                pass
    if cap is not None:
        try:
            meg = schedule_megatron_balanced(lens, world, problem, machine, max_tokens_per_rank=cap, cost=cost)
        except ValueError:
            meg = None
        if meg is not None and all(s.size in allowed for s in meg.subsamples):
            out.append(meg)
    return out


def schedule_fixed_cp(lengths: Sequence[int], world: int, cp: int, problem: Problem, machine: Machine, *,
                      max_tokens_per_rank: int | None = None, comm_types: Sequence[str] = ("p2p",),
                      cost: PackCost | None = None) -> DynamicCPSchedule:
    """Fixed CP size ``cp`` (DP = world / cp): documents packed in arrival order into sequences of at most
    ``cp * max_tokens_per_rank`` tokens (no cap: one sequence per DP replica's even share of the tokens),
    sequences dealt round-robin to the DP replicas -- what a packed data loader does without balancing."""
    lens = _check(lengths, world, max_tokens_per_rank)
    if cp < 1 or world % cp:
        raise ValueError(f"cp={cp} must divide world={world}")
    cost = cost or PackCost(problem, machine, comm_types)
    dp = world // cp
    limit = cp * max_tokens_per_rank if max_tokens_per_rank is not None else \
        max(max(lens, default=1), -(-sum(lens) // dp))
    packs: list[list[int]] = []
    cur: list[int] = []
    for d, n in enumerate(lens):
        if n == 0:
            continue
        if cost.pad(n, cp) > limit:
            raise _too_long(n, cp, max_tokens_per_rank)
        if cur and cost.pad(sum(lens[i] for i in cur) + n, cp) > limit:
            packs.append(cur)
            cur = []
        cur.append(d)
    if cur:
        packs.append(cur)
    subs = [cost.subsample(tuple(range((i % dp) * cp, (i % dp) * cp + cp)), pk, [lens[d] for d in pk])
            for i, pk in enumerate(packs)]
    return predict_schedule([tuple(subs)], world, f"fixed cp={cp} dp={dp}")


def schedule_megatron_balanced(lengths: Sequence[int], world: int, problem: Problem, machine: Machine, *,
                               max_tokens_per_rank: int, comm_types: Sequence[str] = ("p2p",),
                               delta: float = 0.05, cost: PackCost | None = None) -> DynamicCPSchedule:
    """Megatron's hybrid-CP policy (megatron-core 0.19's ``BalancedCPScheduler``), written from its
    description, predicted with our cost model (one document per sub-sample, as Megatron runs them):

    1. each document needs a CP size: the next power of two of ``length / max_tokens_per_rank``; its
       workload estimate is ``length^2 / size`` (token counts only);
    2. documents, longest first, are cut into as many buckets of about equal total workload as there
       are distinct sizes; a round is built by repeatedly taking the head of the first bucket that can be
       placed -- on the least-loaded existing group of exactly its size, or on fresh idle ranks (the
       least-loaded idle ones) when that is less loaded -- adding its workload to every member; once the
       sizes being placed have dropped below the first one, the round closes as soon as every rank's
       load is within ``delta`` (5%) of the busiest;
    3. while the spread is above ``delta`` and no rank is idle, the busiest rank's last document goes
       back to the leftovers if that narrows the spread;
    4. while ranks are idle, the smallest group doubles (up to all ranks), taking the idle ranks next to
       it (later groups shift up): its documents then run on twice the ranks;
    5. rounds repeat over the leftovers; a barrier separates rounds.
    """
    lens = _check(lengths, world, max_tokens_per_rank)
    cost = cost or PackCost(problem, machine, comm_types)

    def need(n: int) -> int:
        p = 1
        while p < n / max_tokens_per_rank:
            p *= 2
        if p > world:
            raise _too_long(n, world, max_tokens_per_rank)
        return p

    def work(n: int, p: int | None = None) -> float:
        return n * n / (p or need(n))

    todo = sorted(((d, n) for d, n in enumerate(lens) if n > 0), key=lambda x: -x[1])
    rounds = []
    while todo:
        groups, todo = _megatron_round(todo, world, need, work, delta)
        subs = []
        for ranks, docs in groups:
            for d in docs:
                subs.append(cost.subsample(ranks, [d], [lens[d]]))
        rounds.append(tuple(subs))
    return predict_schedule(rounds, world, "megatron balanced")


def _megatron_round(todo, world, need, work, delta):
    """One round of Megatron's policy: ([(ranks, [doc, ...]), ...], leftovers)."""
    k = len({need(n) for _, n in todo})
    target = sum(work(n) for _, n in todo) / k
    buckets: list[list[tuple[int, int]]] = []
    cur, cur_w = [], 0.0
    for i, (d, n) in enumerate(todo):  # about equal work per bucket, one doc at least per bucket
        if cur and (cur_w + work(n) > 1.1 * target or len(todo) - i <= k - len(buckets)):
            buckets.append(cur)
            cur, cur_w = [], 0.0
        cur.append((d, n))
        cur_w += work(n)
    if cur:
        buckets.append(cur)
    owner: list[int | None] = [None] * world  # group id per rank
    gsize: dict[int, int] = {}
    gmembers: dict[int, list[int]] = {}
    gdocs: dict[int, list[tuple[int, int]]] = {}
    load = [0.0] * world
    first_need, balance_on = None, False
    while any(buckets):
        pick = None
        for bi, b in enumerate(buckets):
            if not b:
                continue
            p = need(b[0][1])
            idle = [r for r in range(world) if owner[r] is None]
            if any(s == p for s in gsize.values()) or len(idle) >= p:
                pick = bi
                break
        if pick is None:
            break
        d, n = buckets[pick].pop(0)
        p = need(n)
        first_need = p if first_need is None else first_need
        same = [g for g, s in gsize.items() if s == p]
        best_g = min(same, key=lambda g: (max(load[r] for r in gmembers[g]), g)) if same else None
        best_load = max(load[r] for r in gmembers[best_g]) if same else float("inf")
        idle = sorted((r for r in range(world) if owner[r] is None), key=lambda r: (load[r], r))
        if len(idle) >= p and load[idle[p - 1]] < best_load:
            best_g = len(gsize)
            gsize[best_g], gmembers[best_g], gdocs[best_g] = p, sorted(idle[:p]), []
            for r in gmembers[best_g]:
                owner[r] = best_g
        gdocs[best_g].append((d, n))
        for r in gmembers[best_g]:
            load[r] += work(n)
        if p < first_need:
            balance_on = True
        if balance_on and any(buckets) and max(load) - min(load) <= delta * max(load):
            break
    leftovers = [x for b in buckets for x in b]
    while True:  # trim the busiest rank's last document while that narrows the spread
        hi, lo = max(load), min(load)
        if hi - lo <= delta * hi or lo == 0:
            break
        g = owner[load.index(hi)]
        if len(gdocs[g]) <= 1:
            break
        d, n = gdocs[g][-1]
        trial = list(load)
        for r in gmembers[g]:
            trial[r] -= work(n)
        if max(trial) - min(trial) >= hi - lo:
            break
        gdocs[g].pop()
        load = trial
        leftovers.append((d, n))
    # idle ranks: double the smallest group, taking the ranks after it (later groups shift up)
    order = sorted(gsize, key=lambda g: gmembers[g][0])
    sizes = [gsize[g] for g in order]
    while sum(sizes) < world:
        i = min(range(len(sizes)), key=lambda j: (sizes[j], j))
        sizes[i] = min(2 * sizes[i], world - (sum(sizes) - sizes[i]))
    groups, start = [], 0
    for g, s in zip(order, sizes):
        groups.append((tuple(range(start, start + s)), [d for d, _ in gdocs[g]]))
        start += s
    return groups, leftovers
