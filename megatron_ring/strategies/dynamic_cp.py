"""Dynamic context parallelism: each packed sub-sample of a global batch on the CP group its length needs.

Given the documents of one global batch (their lengths) and the ``world`` DP x CP ranks, a schedule says
which consecutive ranks run which documents: every :class:`SubSample` is ONE ``ring_attention`` call
(``qkv_format="thd"``, ``cu_seqlens`` of its documents, padded at the end to the layout's multiple) on
the group of its ranks. Ranks of a round run their sub-samples one after another; a round ends with a
barrier (ours need one round: the groups of a round partition the ranks, so no rank ever waits for a
group it is not in). See docs/dynamic_cp.md.

* :func:`schedule_dynamic_cp`: ours. Minimises the slowest rank's PREDICTED time (cost model: causal work
  per rank of the packed documents, exchange bytes and latency, overlap, per comm type), group sizes any
  integer ``1..world`` (the ring is exact for any P) or powers of two (``sizes="pow2"``, Megatron's groups).
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
from megatron_ring.strategies.cost_model import (Machine, Problem, activation_bytes, candidate_types, predict,
                                                 workspace_bytes)

__all__ = ["SubSample", "Schedule", "PackCost", "schedule_dynamic_cp", "schedule_megatron_balanced",
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
class Schedule:
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


def predict_schedule(rounds: Sequence[Sequence[SubSample]], world: int, policy: str) -> Schedule:
    """A :class:`Schedule` with its prediction: per round the busiest rank's sum; ranks' busy time."""
    rank_s = [0.0] * world
    step = 0.0
    for rnd in rounds:
        busy = [0.0] * world
        for s in rnd:
            for r in s.ranks:
                busy[r] += s.predicted_s
        step += max(busy)
        rank_s = [a + b for a, b in zip(rank_s, busy)]
    return Schedule(world, tuple(tuple(r) for r in rounds), policy, step, tuple(rank_s))


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


def _pack(order: Sequence[int], lens: Sequence[int], size: int, cost: PackCost, cap: int | None) -> list[list[int]]:
    """First-fit of the group's documents (in ``order``) into packs of at most ``cap`` tokens per rank."""
    packs: list[list[int]] = []
    room: list[int] = []
    limit = None if cap is None else cap * size
    for d in order:
        for i, pk in enumerate(packs):
            if limit is None or cost.pad(room[i] + lens[d], size) <= limit:
                pk.append(d)
                room[i] += lens[d]
                break
        else:
            packs.append([d])
            room.append(lens[d])
    return packs


def _evaluate(parts: Sequence[Sequence[int]], order: Sequence[int], lens: Sequence[int], cost: PackCost,
              cap: int | None) -> tuple[float, list[list[SubSample]]] | None:
    """Documents onto the groups of the rounds' partitions ``parts`` (consecutive rank ranges per round):
    each document, longest first, where it adds least to the sum of the rounds' spans (then: where it
    finishes first) by its own prediction; then each group's documents packed. None: one fits nowhere."""
    load = [[0.0] * len(part) for part in parts]
    span = [0.0] * len(parts)
    members: list[list[list[int]]] = [[[] for _ in part] for part in parts]
    for d in order:
        best = None
        for i, part in enumerate(parts):
            for g, p in enumerate(part):
                if cap is not None and cost.pad(lens[d], p) // p > cap:
                    continue
                t = load[i][g] + cost([lens[d]], p)["time_s"]
                key = (max(span[i], t) - span[i], t, i, g)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        _, t, i, g = best
        load[i][g] = t
        span[i] = max(span[i], t)
        members[i][g].append(d)
    rounds, step = [], 0.0
    for i, part in enumerate(parts):
        subs, worst, start = [], 0.0, 0
        for g, p in enumerate(part):
            ranks = tuple(range(start, start + p))
            start += p
            total = 0.0
            for pk in _pack(members[i][g], lens, p, cost, cap):
                s = cost.subsample(ranks, pk, [lens[d] for d in pk])
                subs.append(s)
                total += s.predicted_s
            worst = max(worst, total)
        if subs:
            rounds.append(subs)
            step += worst
    return step, rounds


def _moves(part: list[int], allowed: set[int]) -> list[list[int]]:
    out = []
    for i, s in enumerate(part):  # split a group in two
        cands = {s // 2} | {1 << k for k in range(s.bit_length())} | {s - (1 << k) for k in range(s.bit_length())}
        for a in sorted(c for c in cands if 0 < c < s and c in allowed and s - c in allowed):
            out.append(part[:i] + [a, s - a] + part[i + 1:])
    for i in range(len(part) - 1):  # merge two neighbours
        if part[i] + part[i + 1] in allowed:
            out.append(part[:i] + [part[i] + part[i + 1]] + part[i + 2:])
    for i in range(len(part) - 1):  # move one rank between neighbours
        for da in (-1, 1):
            a, b = part[i] + da, part[i + 1] - da
            if a > 0 and b > 0 and a in allowed and b in allowed:
                out.append(part[:i] + [a, b] + part[i + 2:])
    return out


def _round_moves(parts: tuple[tuple[int, ...], ...], allowed: set[int], uniform: list[tuple[int, ...]],
                 max_rounds: int) -> list[tuple[tuple[int, ...], ...]]:
    out = []
    for i, part in enumerate(parts):
        out += [parts[:i] + (tuple(m),) + parts[i + 1:] for m in _moves(list(part), allowed)]
    if len(parts) < max_rounds:
        out += [parts + (u,) for u in uniform]
    if len(parts) > 1:
        out += [parts[:i] + parts[i + 1:] for i in range(len(parts))]
    return out


def schedule_dynamic_cp(lengths: Sequence[int], world: int, problem: Problem, machine: Machine, *,
                        max_tokens_per_rank: int | None = None, sizes: str | Sequence[int] = "any",
                        comm_types: Sequence[str] = ("p2p",), seed: int = 0, max_rounds: int = 2,
                        max_iters: int | None = None, cost: PackCost | None = None) -> Schedule:
    """Our scheduler: group sizes and packing that minimise the slowest rank's predicted time.

    Args:
        lengths: document lengths of the global batch (tokens; 0-length documents are placed nowhere
            and listed in no sub-sample).
        world: DP x CP ranks.
        problem: attention shape (heads, K/V heads, head dim, dtype bytes, layout); ``seq`` is ignored.
        machine: the cost model's machine numbers (measured ones for the cluster at hand).
        max_tokens_per_rank: memory cap: no sub-sample may hold more than this many (padded) tokens per
            rank (Megatron's ``max_seqlen_per_dp_cp_rank``); None: no cap.
        sizes: "any" (every group size 1..world: exact for the ring with end padding), "pow2" (the groups
            megatron-core's ``parallel_state`` builds for hybrid CP), or an explicit list.
        comm_types: exchanges to consider per sub-sample (the cheapest predicted one is used).
        seed: breaks ties between documents of equal length (the result is a function of the batch, the
            arguments and the seed only: no clocks, no global random state).
        max_rounds: rounds (barrier-separated partitions of the ranks) the search may use.
        max_iters: hill-climbing steps (default ``min(4 * world, 24)``).

    Algorithm: a schedule is a list of rounds, each a partition of the ranks into consecutive groups.
    It is scored by placing the documents, longest first, where each adds least to the sum of the rounds'
    predicted spans (ties: where it finishes first), first-fit packing each group's documents into
    sub-samples within the memory cap, and summing the rounds' slowest groups. The search starts from every
    fixed CP size that divides ``world`` (and every pair of them as two rounds), then climbs: split a
    group, merge two neighbours, move one rank between neighbours, add or drop a round -- keeping the best
    strictly better schedule until none is. Finally the baselines (:func:`schedule_fixed_cp` for every
    allowed size dividing ``world``; :func:`schedule_megatron_balanced` when a cap is given and its group
    sizes are allowed) are candidates too, so the result is never predicted slower than any of them.
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
    aset = set(allowed)
    uniform = [tuple([c] * (world // c)) for c in allowed if world % c == 0] or [(world,)]
    seeds = [(u,) for u in uniform]
    if max_rounds > 1:
        seeds += [(u, v) for u in uniform for v in uniform if u != v]
    best_parts, best = None, None
    for parts in seeds:
        res = _evaluate(parts, order, lens, cost, max_tokens_per_rank)
        if res is not None and (best is None or res[0] < best[0] * (1 - 1e-9)):
            best_parts, best = parts, res
    if best is None:  # no uniform partition holds the longest document: one group of all ranks
        best_parts = ((world,),)
        best = _evaluate(best_parts, order, lens, cost, max_tokens_per_rank)
        if best is None:
            raise _too_long(lens[order[0]], world, max_tokens_per_rank)
    seen = set(seeds) | {best_parts}
    for _ in range(max_iters if max_iters is not None else min(4 * world, 24)):
        step = None
        for cand in _round_moves(best_parts, aset, uniform, max_rounds):
            if cand in seen:
                continue
            seen.add(cand)
            res = _evaluate(cand, order, lens, cost, max_tokens_per_rank)
            if res is not None and res[0] < (step[1][0] if step else best[0]) * (1 - 1e-9):
                step = (cand, res)
        if step is None:
            break
        best_parts, best = step
    out = predict_schedule(best[1], world, "dynamic")
    # the baselines are candidates too: the result is never predicted slower than any of them
    for base in _baselines(lens, world, problem, machine, max_tokens_per_rank, aset, cost):
        if base.step_s < out.step_s * (1 - 1e-9):
            out = dataclasses.replace(base, policy=f"dynamic (= {base.policy})")
    return out


def _baselines(lens, world, problem, machine, cap, allowed, cost) -> list[Schedule]:
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
                      cost: PackCost | None = None) -> Schedule:
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
                               delta: float = 0.05, cost: PackCost | None = None) -> Schedule:
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
