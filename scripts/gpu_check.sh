#!/usr/bin/env bash
# One command for GPU users: on whatever NVIDIA GPUs this machine has, run
#   1. tests/gpu (one-GPU kernel/engine/Megatron checks; test_fake_tier_on_gpu.py runs every case of the
#      fake-CUDA tier, tests/fake_cuda, for real: real CUDA tensors, streams and autograd);
#   2. with 2 or more GPUs: ring attention over NCCL on all of them vs float64 (tests/gpu/nccl_check.py);
#   3. with TransformerEngine installed and 2 or more GPUs: ours vs TransformerEngine's context parallelism,
#      side by side (tests/gpu/te_cp_check.py: errors vs float64 and fwd+bwd times);
#   4. the GPU benchmark rows (each rank's ring schedule on one GPU vs one-GPU SDPA, P = 2 4 8);
# and print one table. Needs no download (uses the project venv, set up by scripts/setup_env.sh with a CUDA
# build of torch). Budget: under 10 minutes on one GPU. On a machine without a usable GPU it says so and
# exits 0 without running anything.
# Env: MEGATRON_RING_VENV (default .venv), GPU_CHECK_SEQ (default 8192).
set -uo pipefail
cd "$(dirname "$0")/.."
# the library and the lab from this checkout, whatever Python runs them (a venv or a system Python)
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
PY="${MEGATRON_RING_VENV:-.venv}/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
SEQ="${GPU_CHECK_SEQ:-8192}"
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ "$NGPU" = 0 ]; then
  echo "[gpu_check] no usable CUDA GPU here (torch.cuda.is_available() is False, or torch is a CPU build:" \
       "$("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null))."
  echo "[gpu_check] nothing to check on this machine; CPU users run: bash scripts/test.sh"
  exit 0
fi
OUT="$(mktemp -d)"; trap 'rm -rf "$OUT"' EXIT
echo "[gpu_check] $NGPU GPU(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
timeout 420 "$PY" -m pytest -q -rfE tests/gpu -p no:cacheprovider > "$OUT/pytest.txt" 2>&1; rc_tests=$?
tail -3 "$OUT/pytest.txt"
rc_nccl=0
if [ "$NGPU" -ge 2 ]; then
  timeout 240 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --master-addr 127.0.0.1 \
    --master-port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')" \
    tests/gpu/nccl_check.py --seq "$SEQ" > "$OUT/nccl.txt" 2>&1; rc_nccl=$?
fi
rc_te=0
HAVE_TE="$("$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1 && echo 1 || echo 0)"
if [ "$HAVE_TE" = 1 ] && [ "$NGPU" -ge 2 ]; then
  timeout 300 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" --master-addr 127.0.0.1 \
    --master-port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')" \
    tests/gpu/te_cp_check.py --seq "$SEQ" > "$OUT/te.txt" 2>&1; rc_te=$?
fi
timeout 240 "$PY" -m megatron_ring_lab.benchmark --gpu-row --world-sizes 2 4 8 --seq "$SEQ" --heads 16 --kv-heads 4 \
  --head-dim 128 --dtype bf16 --causal --iters 5 > "$OUT/bench.json" 2> "$OUT/bench.err"; rc_bench=$?
"$PY" - "$OUT" "$NGPU" "$rc_tests" "$rc_nccl" "$rc_bench" "$HAVE_TE" "$rc_te" <<'PYEOF'
import json, os, re, sys
out, ngpu, rc_t, rc_n, rc_b, have_te, rc_te = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
rows = []
tail = open(os.path.join(out, "pytest.txt")).read().strip().splitlines()
rows.append(("tests/gpu", tail[-1] if tail else "no output", "ok" if rc_t == 0 else f"FAIL rc={rc_t}"))
fake = [l for l in open(os.path.join(out, "pytest.txt")) if "test_fake_tier_on_gpu" in l and ("FAILED" in l or "ERROR" in l)]
rows.append(("fake tier for real", f"{len(fake)} case(s) failed" + (": " + fake[0].strip()[:200] if fake else ""),
             "ok" if rc_t == 0 or not fake else "FAIL"))
if not have_te:
    rows.append(("ours vs TE context parallel", "TransformerEngine not installed", "skipped"))
elif ngpu < 2:
    rows.append(("ours vs TE context parallel", "one GPU: TransformerEngine's CP needs 2 or more", "skipped"))
else:
    te_rows = [json.loads(l) for l in open(os.path.join(out, "te.txt")) if l.startswith("{")]
    for r in te_rows:
        rows.append((r["case"], f"ours {r['ours_ms']} ms err {r['ours_err']:.2e} | TE {r['te_ms']} ms err "
                     f"{r['te_err']:.2e}", "ok" if r["ok"] else "FAIL"))
    if rc_te or not te_rows:
        tail = open(os.path.join(out, "te.txt")).read().strip().splitlines()[-3:]
        rows.append(("ours vs TE context parallel", f"rc={rc_te}: " + " / ".join(tail)[-300:], "FAIL"))
if ngpu >= 2:
    for line in open(os.path.join(out, "nccl.txt")):
        if line.startswith("{"):
            r = json.loads(line)
            rows.append((r["case"], f"max err {r['max_err']:.2e}, {r['ms']} ms fwd+bwd", "ok" if r["ok"] else "FAIL"))
    if rc_n:
        rows.append(("nccl check", "see its log", f"FAIL rc={rc_n}"))
else:
    rows.append(("nccl", "one GPU: NCCL ring not run (needs 2 or more)", "skipped"))
try:
    text = open(os.path.join(out, "bench.json")).read()
    for r in json.loads(text[text.index("["):]):
        rows.append((f"bench P={r.get('P')}", ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                           for k, v in r.items() if k != "P"), "ok"))
except Exception as e:  # noqa: BLE001
    rows.append(("benchmark rows", f"{type(e).__name__}: {open(os.path.join(out, 'bench.err')).read()[-300:]}",
                 f"FAIL rc={rc_b}"))
w = max(len(r[0]) for r in rows)
print(f"\n{'check':<{w}}  {'result':<6}  detail")
for name, detail, res in rows:
    print(f"{name:<{w}}  {res:<6}  {detail}")
sys.exit(0 if all(r[2] in ("ok", "skipped") for r in rows) else 1)
PYEOF
