"""Shrink a Megatron-LM command line to a toy model that keeps its structure.

Kept as given: the layer kinds and their order (``--hybrid-layer-pattern`` / ``--hybrid-override-pattern``
repeated blocks shortened, ``--moe-layer-freq``), MoE (experts, top-k, aux / z-loss, routing options), MTP,
MLA, GQA / MQA (the query-group ratio), attention sinks (``--softmax-type``), sliding windows, norms,
activation, biases, position embedding, packing / document flags, dropout, activation recompute, pipeline
stages (``--pipeline-model-parallel-size``), the CP comm type and the data flags. Changed: sizes (hidden 64,
FFN 128, 4 heads, 16 per head, sequence 64 or 128, 2 micro-batches of at most 2 samples, DP = TP = EP = 1),
fp32, the iteration count, logging every iteration, no checkpoints or loggers, and the CPU flags of the
CPU opt-in (gloo, local implementation, no fusions). :func:`shrink` returns the new argument list and the
changes made (printed by the doctor).
"""
from __future__ import annotations

import re

#: flags that make Megatron-LM's loop run on CPU/gloo through the CPU opt-in
CPU_FLAGS = ["--distributed-backend", "gloo", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
             "--transformer-impl", "local", "--rerun-mode", "disabled", "--no-rope-fusion",
             "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
             "--no-persist-layer-norm"]

#: flags dropped with their values (GPU-, precision-, checkpoint- or logger-only), name -> number of values
_DROP = {"--bf16": 0, "--fp16": 0, "--fp8-format": 1, "--fp8": 1, "--sequence-parallel": 0, "--use-flash-attn": 0,
         "--attention-backend": 1, "--save": 1, "--load": 1, "--save-interval": 1, "--tensorboard-dir": 1,
         "--wandb-project": 1, "--wandb-exp-name": 1, "--wandb-save-dir": 1, "--use-mcore-models": 0,
         "--overlap-grad-reduce": 0, "--overlap-param-gather": 0, "--tp-comm-overlap": 0,
         "--cuda-graph-impl": 1, "--enable-cuda-graph": 0, "--moe-grouped-gemm": 0, "--moe-permute-fusion": 0,
         "--cross-entropy-loss-fusion": 0, "--apply-rope-fusion": 0, "--use-distributed-optimizer": 0,
         "--accumulate-allreduce-grads-in-fp32": 0, "--ckpt-format": 1, "--exit-interval": 1,
         "--exit-duration-in-mins": 1, "--distributed-timeout-minutes": 1}


class Args:
    """A Megatron-LM argument list with flag access (a flag's values run to the next ``--flag``)."""

    def __init__(self, argv: list[str]):
        self.items: list[tuple[str, list[str]]] = []
        for tok in argv:
            if tok.startswith("--") and not re.fullmatch(r"--?\d.*", tok):
                self.items.append((tok, []))
            elif self.items:
                self.items[-1][1].append(tok)
            else:
                self.items.append(("", [tok]))

    def has(self, flag: str) -> bool:
        return any(f == flag for f, _ in self.items)

    def get(self, flag: str, default: str | None = None) -> str | None:
        for f, v in self.items:
            if f == flag:
                return v[0] if v else ""
        return default

    def values(self, flag: str) -> list[str]:
        for f, v in self.items:
            if f == flag:
                return list(v)
        return []

    def set(self, flag: str, *values: object) -> None:
        vals = [str(v) for v in values]
        for i, (f, _) in enumerate(self.items):
            if f == flag:
                self.items[i] = (f, vals)
                return
        self.items.append((flag, vals))

    def drop(self, flag: str) -> bool:
        n = len(self.items)
        self.items = [(f, v) for f, v in self.items if f != flag]
        return len(self.items) != n

    def argv(self) -> list[str]:
        out: list[str] = []
        for f, v in self.items:
            out += ([f] if f else []) + v
        return out


def _shorten_pattern(pattern: str) -> str:
    """A hybrid layer pattern with each run of one symbol cut to one layer (``MMM*MMM-`` -> ``M*M-``);
    pipeline separators (``|``) and the MTP suffix (after ``/``) are kept."""
    def runs(s: str) -> str:
        return re.sub(r"(.)\1+", r"\1", s)
    main, *mtp = pattern.split("/")
    return "/".join(["|".join(runs(p) for p in main.split("|")), *mtp])


def shrink(argv: list[str], *, iters: int, max_cp: int) -> tuple[list[str], list[str]]:
    """(toy argument list, the changes made)."""
    a = Args(argv)
    notes: list[str] = []

    def change(flag: str, *values: object, why: str = "") -> None:
        old = a.values(flag) if a.has(flag) else None
        a.set(flag, *values)
        new = [str(v) for v in values]
        if old != new:
            notes.append(f"{flag} {' '.join(old) if old else '(unset)'} -> {' '.join(new)}" + (f" ({why})" if why else ""))

    for flag in list(_DROP):
        if a.drop(flag):
            notes.append(f"{flag} dropped (GPU / precision / checkpoint / logger option)")
    for flag, why in (("--tensor-model-parallel-size", "TP=1"), ("--expert-model-parallel-size", "EP=1"),
                      ("--expert-tensor-parallel-size", "ETP=1")):
        if a.has(flag):
            change(flag, 1, why=why)
    a.drop("--context-parallel-size")
    pp = int(a.get("--pipeline-model-parallel-size", "1") or 1)

    heads = int(a.get("--num-attention-heads", "4") or 4)
    groups = int(a.get("--num-query-groups", str(heads)) or heads) if a.has("--group-query-attention") else heads
    new_heads = 4
    new_groups = 4 if groups == heads else (1 if groups == 1 else 2)
    change("--num-attention-heads", new_heads, why="4 heads")
    if a.has("--group-query-attention"):
        change("--num-query-groups", new_groups, why=f"keeps {'MQA' if new_groups == 1 else 'GQA'}")
    change("--hidden-size", 64)
    if a.has("--ffn-hidden-size"):
        change("--ffn-hidden-size", 128)
    if a.has("--kv-channels"):
        change("--kv-channels", 16)
    if a.has("--multi-latent-attention"):
        for flag, v in (("--q-lora-rank", 32), ("--kv-lora-rank", 32), ("--qk-head-dim", 16),
                        ("--qk-pos-emb-head-dim", 8), ("--v-head-dim", 16)):
            if flag != "--q-lora-rank" or a.has(flag):
                change(flag, v, why="MLA kept, small")

    pattern_flag = next((f for f in ("--hybrid-layer-pattern", "--hybrid-override-pattern") if a.has(f)), None)
    if pattern_flag:
        short = _shorten_pattern(a.get(pattern_flag) or "")
        change(pattern_flag, short, why="each run of one layer kind cut to one layer; kinds and order kept")
        if a.has("--num-layers"):
            change("--num-layers", len(short.split("/")[0].replace("|", "")))
    else:
        layers = int(a.get("--num-layers", "2") or 2)
        freq = a.get("--moe-layer-freq")
        new_layers = max(2, pp)
        if freq and "[" in freq:
            # the 0/1 entries of a list such as "([0]*3+[1]*45)" (multipliers are other numbers or follow "*")
            kinds = sorted(set(re.findall(r"(?<![\d*])[01](?!\d)", freq)) & {"0", "1"})
            new_freq = "[" + ",".join(kinds * max(1, (new_layers + len(kinds) - 1) // len(kinds))) + "]"
            new_layers = new_freq.count(",") + 1
            change("--moe-layer-freq", new_freq, why="dense and MoE layers kept")
        elif freq and freq.isdigit() and int(freq) > 1:
            new_layers = max(new_layers, min(int(freq), 4))
        if layers != new_layers:
            change("--num-layers", new_layers, why=f"{new_layers} layers" + (f" over PP={pp}" if pp > 1 else ""))
        for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
            if a.drop(flag):
                notes.append(f"{flag} dropped (even split of the toy layers)")
    if a.has("--num-experts"):
        change("--num-experts", min(int(a.get("--num-experts") or 4), 4), why="at most 4 experts")
        topk = int(a.get("--moe-router-topk", "2") or 2)
        change("--moe-router-topk", min(topk, 2))
        if a.has("--moe-ffn-hidden-size"):
            change("--moe-ffn-hidden-size", 64)
        if a.has("--moe-shared-expert-intermediate-size"):
            change("--moe-shared-expert-intermediate-size", 64)
        for flag in ("--moe-router-num-groups", "--moe-router-group-topk"):
            if a.drop(flag):
                notes.append(f"{flag} dropped (4 experts)")

    seq = 128 if any(a.has(f) for f in ("--window-size",)) else 64
    seq = max(seq, 4 * max_cp)
    seq += (-seq) % (2 * max_cp)
    change("--seq-length", seq, why=f"divisible by 2 x CP={max_cp} (zigzag)")
    if a.has("--max-position-embeddings") or a.get("--position-embedding-type") == "learned_absolute":
        change("--max-position-embeddings", seq)
    if a.has("--window-size"):
        w = a.get("--window-size") or ""
        nums = [int(x) for x in re.findall(r"-?\d+", w)]
        new = tuple(min(n, seq // 4) if n > 0 else n for n in nums)
        change("--window-size", "(" + ",".join(map(str, new)) + ")", why="window below the toy sequence")
    mbs = min(int(a.get("--micro-batch-size", "1") or 1), 2)
    change("--micro-batch-size", mbs)
    change("--global-batch-size", 2 * mbs, why="2 micro-batches, DP=1")
    a.drop("--rampup-batch-size")
    change("--train-iters", iters)
    a.drop("--train-samples")
    for flag in ("--lr-decay-iters", "--lr-warmup-samples", "--lr-decay-samples", "--lr-wsd-decay-iters",
                 "--lr-warmup-fraction"):
        if a.drop(flag):
            notes.append(f"{flag} dropped (schedule over the toy iterations)")
    change("--lr-warmup-iters", 1)
    change("--log-interval", 1)
    if a.has("--eval-iters") and (a.get("--eval-iters") or "0") != "0":
        change("--eval-iters", 1)
        change("--eval-interval", iters, why="one evaluation after the last iteration")
    else:
        change("--eval-iters", 0)
        change("--eval-interval", 10 ** 6)
    if a.get("--tokenizer-type", "NullTokenizer") == "NullTokenizer":
        change("--vocab-size", 128)
        change("--make-vocab-size-divisible-by", 64)
    for i in range(0, len(CPU_FLAGS)):
        flag = CPU_FLAGS[i]
        if not flag.startswith("--"):
            continue
        val = CPU_FLAGS[i + 1] if i + 1 < len(CPU_FLAGS) and not CPU_FLAGS[i + 1].startswith("--") else None
        if val is None:
            if not a.has(flag):
                a.set(flag)
        else:
            a.set(flag, val)
    return a.argv(), notes
