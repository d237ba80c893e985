"""torchrun entry point for the multi-node tests: examples/train_gpt.py plus fault injection and a record.

    torchrun ... tests/multinode/mn_driver.py <train_gpt.py arguments>

Runs ``examples/train_gpt.main(argv)`` unchanged, after

* ``init_process_group("gloo", timeout=MN_PG_TIMEOUT_S)`` (train_gpt.py keeps torch's 30-minute default), and
  the same timeout for Megatron's groups (``distributed_timeout_minutes``, 30 minutes by default),
* wrapping ``initialize_context_parallel`` to record the ring this rank joined (ring order, neighbours,
  hierarchical sub-rings) and which host it runs on (its network-namespace inode),
* an optional fault from ``MN_FAULT`` (see :func:`parse_fault`),
* optional per-rank extra arguments from ``MN_RANK_ARGS`` (JSON ``{"rank": [args...]}``; argparse keeps the
  last value, so these override the common ones: a different --seq-length on one rank, ...).

Every rank writes ``$MN_OUT/rank<R>.json``: host identity, ring topology, number of ring exchanges, and how
it ended (``ok``, ``error`` with the exception text, or ``sigterm`` when torchrun's agent stopped it) with
wall-clock times (``time.time()``; all namespaces share the machine's clock). A failing rank prints
``[mn_driver] rank R FAILED ...`` on stderr and exits 1 at once (``os._exit``: no teardown that could block).
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (ROOT, os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

RANK = int(os.environ.get("RANK", "0"))
OUT = os.environ.get("MN_OUT", ".")
RECORD: dict = {"rank": RANK, "pid": os.getpid(), "node_rank": int(os.environ.get("GROUP_RANK", "0")),
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "netns": os.stat("/proc/self/ns/net").st_ino, "t_start": time.time(), "status": "running",
                "exchanges": 0}
_lock = threading.Lock()


def save(**updates) -> None:
    with _lock:
        RECORD.update(updates)
        tmp = os.path.join(OUT, f".rank{RANK}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(RECORD, f)
        os.replace(tmp, os.path.join(OUT, f"rank{RANK}.json"))


def parse_fault(spec: str) -> dict:
    """``kind:key=value:...``; kinds:

    * ``kill:rank=R:exchange=E``  rank R SIGKILLs itself when starting its E-th ring exchange (mid-step);
    * ``stop:rank=R:exchange=E``  rank R writes ``$MN_OUT/fault_marker`` and SIGSTOPs itself there; the test
      harness then takes the whole node down (link down + SIGKILL of every process on it);
    * ``sleep:rank=R:exchange=E:secs=S``  rank R stalls S seconds before that exchange, then carries on;
    * ``dtype:rank=R``  rank R feeds ring attention bf16 q/k/v (everyone else fp32);
    * ``seq:rank=R``  rank R feeds ring attention only the first half of its local sequence (a rank whose
      shard has another length, e.g. a padding bug; the configuration is the same everywhere).
    """
    if not spec:
        return {}
    kind, *kvs = spec.split(":")
    out: dict = {"kind": kind}
    for kv in kvs:
        k, v = kv.split("=", 1)
        out[k] = float(v) if k == "secs" else int(v)
    return out


def _install_sigterm_recorder() -> None:
    """torchrun's agent SIGTERMs the other local workers when one fails; record that before exiting.

    SIGTERM is blocked in every thread (threads created later inherit the mask) and consumed by a
    watcher thread with ``sigwait``, so it is seen even while the main thread waits inside gloo.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        signal.sigwait({signal.SIGTERM})
        save(status="sigterm", t_exit=time.time(),
             message="stopped by SIGTERM (torchrun's agent stops the remaining local workers after a failure)")
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="mn-sigterm", daemon=True).start()


def _install_fault(fault: dict) -> None:
    import torch

    import megatron_ring
    from megatron_ring.transport import ring as comm

    kind = fault.get("kind")
    orig_exchange = comm.Ring.exchange

    def exchange(self, send, recv, channel, step):
        with _lock:
            RECORD["exchanges"] += 1
            n = RECORD["exchanges"]
        if fault and RANK == fault.get("rank") and n == fault.get("exchange"):
            if kind == "kill":
                save(status="killed", t_fault=time.time(), fault_at=f"{channel} step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                save(status="stopped", t_marker=time.time(), fault_at=f"{channel} step {step}")
                with open(os.path.join(OUT, "fault_marker"), "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "sleep":
                save(slept_at=f"{channel} step {step}", t_sleep=time.time(), slept_s=fault["secs"])
                time.sleep(fault["secs"])
        return orig_exchange(self, send, recv, channel, step)

    comm.Ring.exchange = exchange

    if kind in ("dtype", "seq") and RANK == fault.get("rank"):
        orig_attention = megatron_ring.ring_attention

        def ring_attention(q, k, v, **kw):
            if kind == "dtype":
                return orig_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).to(q.dtype)
            half = q.shape[0] // 2  # Megatron passes sbhd: [s, b, h, d]
            out = orig_attention(q[:half], k[:half], v[:half], **kw)
            return torch.cat([out, out])

        megatron_ring.ring_attention = ring_attention  # attention.py looks it up at call time


def _record_ring(train_gpt, pg_timeout_s: float) -> None:
    orig = train_gpt.initialize_context_parallel

    def initialize_context_parallel(*args, **kwargs):
        # Megatron's groups (TP, CP, DP, ...) get their own timeout (30 min by default), not the world's
        kwargs.setdefault("distributed_timeout_minutes", pg_timeout_s / 60.0)
        state = orig(*args, **kwargs)
        save(ring=list(state.global_ranks), ring_index=state.rank, next_rank=state.next_rank,
             prev_rank=state.prev_rank, hierarchical=[list(r) for r in state.hierarchical_ranks],
             layout=state.layout, cp=state.size)
        return state

    train_gpt.initialize_context_parallel = initialize_context_parallel


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    save()
    _install_sigterm_recorder()
    argv = sys.argv[1:]
    extra = json.loads(os.environ.get("MN_RANK_ARGS", "{}") or "{}").get(str(RANK), [])
    argv = argv + list(extra)
    try:
        import torch.distributed as dist

        pg_timeout = float(os.environ.get("MN_PG_TIMEOUT_S", "60"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
        save(t_init=time.time())
        import train_gpt  # examples/train_gpt.py

        _install_fault(parse_fault(os.environ.get("MN_FAULT", "")))
        _record_ring(train_gpt, pg_timeout)
        rc = train_gpt.main(argv)
    except BaseException as exc:  # noqa: BLE001 - recorded, printed, then a hard non-zero exit
        msg = f"{type(exc).__name__}: {exc}"
        save(status="error", t_exit=time.time(), error_type=type(exc).__name__, message=str(exc),
             traceback=traceback.format_exc()[-4000:])
        print(f"[mn_driver] rank {RANK} FAILED after {time.time() - RECORD['t_start']:.1f}s: {msg}",
              file=sys.stderr, flush=True)
        os._exit(1)
    save(status="ok", t_exit=time.time(), rc=rc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)


if __name__ == "__main__":
    main()
