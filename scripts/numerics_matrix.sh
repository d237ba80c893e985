#!/usr/bin/env bash
# The numerics tests under every CPU instruction set this machine supports (docs/numerics.md, "Test
# tolerances"): torch's kernels are chosen per ATEN_CPU_CAPABILITY (default / avx2 / avx512) and MKL's per
# MKL_ENABLE_INSTRUCTIONS, and each rounds differently; the derived tolerances must hold under all of them.
#   bash scripts/numerics_matrix.sh            the numerics test files, every configuration
#   bash scripts/numerics_matrix.sh --fast     the fast tier of them (-m "not slow"), which holds the MLA / sinks /
#                                              dropout matrix at P = 1..4 with the ranks as threads (CP=P vs CP=1 with
#                                              dropout); a CI step of scripts/test.sh
#   bash scripts/numerics_matrix.sh --fast --native-report FILE
#                                              the same, but the configuration the fast tier itself ran in (torch's own
#                                              choice: the highest capability, MKL unlimited; nothing set in the
#                                              environment) is not run again: its line is FILE, the report the fast tier
#                                              wrote ($MEGATRON_RING_NUMERICS_REPORT); scripts/test.sh does this
#   bash scripts/numerics_matrix.sh --slow     the slow tiers of scripts/test.sh (the model-level tests): $PYTHON -m slow
#                                              tests/, then, where $PYTHON312 (else .venv312/bin/python) exists, tests/megatron
#                                              on it, and where .bridge312 exists the Bridge tests; by hand (about an hour per
#                                              configuration on 2 cores), not a CI step
# Extra arguments go to pytest. Configurations: each capability from /proc/cpuinfo (default always; avx2 with
# avx2+fma; avx512 with avx512f/bw/vl/dq), then the highest one with MKL limited to AVX2
# (MKL_ENABLE_INSTRUCTIONS=AVX2). Each run checks that torch really took the capability, and prints the worst
# error/bound ratio of every check (tests/helpers/numerics.py writes them to $MEGATRON_RING_NUMERICS_REPORT).
# Python: $PYTHON, else .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
FILES=(tests/test_kernel_contract.py tests/test_merge_and_kernels.py tests/test_validation.py tests/test_properties.py
       tests/test_codec.py tests/test_ring_attention.py tests/test_strategies.py tests/test_documents.py
       tests/test_kv_pieces.py tests/test_model_features.py tests/test_strategy_features.py tests/test_wire_accuracy.py
       tests/test_cost_model.py tests/test_dynamic_cp.py tests/test_document_zigzag.py tests/test_ulysses_heads.py
       tests/test_row_tiles.py)
MARK=(); SLOW=0; NATIVE_REPORT=""
if [ "${1:-}" = "--fast" ]; then
  MARK=(-m "not slow"); shift
  if [ "${1:-}" = "--native-report" ]; then NATIVE_REPORT="$2"; shift 2; fi
elif [ "${1:-}" = "--slow" ]; then
  SLOW=1; shift
fi
PY312="${PYTHON312:-.venv312/bin/python}"
BRIDGE=(tests/megatron/test_bridge.py tests/megatron/test_bridge_hybrid.py)
# one pytest run under the configuration's environment (env_, report): extra pytest arguments first
pyt() { local py="$1"; shift; env "${env_[@]}" MEGATRON_RING_NUMERICS_REPORT="$report" "$py" -m pytest -q -p no:cacheprovider "$@"
  local r=$?; [ "$r" -eq 5 ] && r=0; return "$r"; }
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { for f in "$@"; do [[ " $flags " == *" $f "* ]] || return 1; done; }
caps=(default)
has avx2 fma && caps+=(avx2)
has avx512f avx512bw avx512vl avx512dq && caps+=(avx512)
configs=(); for c in "${caps[@]}"; do configs+=("$c:"); done
configs+=("${caps[-1]}:AVX2")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# --native-report: the fast tier ran torch's own choice already; it is skipped here where that choice is the highest
# capability (torch took it) and nothing in the environment chose another
native=""
if [ -n "$NATIVE_REPORT" ] && [ -z "${ATEN_CPU_CAPABILITY:-}" ] && [ -z "${MKL_ENABLE_INSTRUCTIONS:-}" ]; then
  got=$("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
  if [ "${got,,}" = "${caps[-1],,}" ]; then
    native="${caps[-1]}:"; kept=(); for c in "${configs[@]}"; do [ "$c" = "$native" ] || kept+=("$c"); done
    configs=("${kept[@]}")
  fi
fi
summarise() {  # report file: checks, comparisons and the worst error/bound of its rows
  "$PY" - "$1" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
worst = max(rows, key=lambda r: r["worst_ratio"]) if rows else None
print(f"{len(rows)} checks, {sum(r['rows'] for r in rows)} comparisons, worst error/bound "
      + (f"{worst['worst_ratio']:.3f} ({worst['check']}: {worst['worst']})" if worst else "-"))
PYEOF
}
# Configurations run MEGATRON_RING_NUMERICS_JOBS at a time (default 2 in --fast mode, where each run is one
# process and the machine has two cores or more; 1 otherwise); each one's output is printed when it ends, in order.
jobs_=1
if [ "${MARK[*]:-}" != "" ] && [ "$(env -u OMP_NUM_THREADS nproc 2>/dev/null || echo 1)" -ge 2 ]; then jobs_=2; fi
jobs_="${MEGATRON_RING_NUMERICS_JOBS:-$jobs_}"
run_config() {  # index, "capability:mkl", pytest arguments...: writes $tmp/<index>.log and $tmp/<index>.result
  local i="$1" cfg="$2"; shift 2
  local cap=${cfg%%:*} mkl=${cfg#*:} rc rc2 got t0 worst label
  label="ATEN_CPU_CAPABILITY=$cap${mkl:+ MKL_ENABLE_INSTRUCTIONS=$mkl}"
  env_=(ATEN_CPU_CAPABILITY="$cap"); [ -n "$mkl" ] && env_+=(MKL_ENABLE_INSTRUCTIONS="$mkl")
  report="$tmp/$i.report"; : > "$report"
  got=$(env "${env_[@]}" "$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
  if [ "${got,,}" != "${cap,,}" ]; then
    echo "[numerics] $label: torch reports capability '$got', not '$cap'"; echo "1 capability not taken" > "$tmp/$i.result"
    return
  fi
  echo "[numerics] === $label (started $(date +%T))"
  t0=$(date +%s)
  if [ "$SLOW" = 1 ]; then
    pyt "$PY" -m slow "$@" tests; rc=$?
    if [ -x "$PY312" ]; then
      pyt "$PY312" "$@" tests/megatron tests/fake_cuda --ignore="${BRIDGE[0]}" --ignore="${BRIDGE[1]}"
      rc2=$?; [ "$rc" -eq 0 ] && rc=$rc2
      if [ -d .bridge312 ]; then
        PYTHONPATH="$PWD/.bridge312:$PYTHONPATH" pyt "$PY312" "$@" "${BRIDGE[@]}"
        rc2=$?; [ "$rc" -eq 0 ] && rc=$rc2
      fi
    fi
  else
    pyt "$PY" "${MARK[@]}" "$@" "${FILES[@]}"; rc=$?
  fi
  worst=$(summarise "$report")
  echo "$rc rc=$rc, $(( $(date +%s) - t0 )) s, $worst" > "$tmp/$i.result"
}
for i in "${!configs[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_" ]; do wait -n; done
  run_config "$i" "${configs[$i]}" "$@" > "$tmp/$i.log" 2>&1 &
done
wait
rc_all=0
for i in "${!configs[@]}"; do cat "$tmp/$i.log"; done
echo "[numerics] summary:"
if [ -n "$native" ]; then
  if [ -s "$NATIVE_REPORT" ]; then worst=$(summarise "$NATIVE_REPORT"); else worst="no report"; fi
  echo "  ATEN_CPU_CAPABILITY=${native%:} (torch's own choice): not run again, the fast tier's run (its exit code is" \
       "its own): $worst"
fi
for i in "${!configs[@]}"; do cfg=${configs[$i]}; cap=${cfg%%:*}; mkl=${cfg#*:}
  read -r rc rest < "$tmp/$i.result" 2>/dev/null || { rc=1; rest="no result"; }
  [ "$rc" -eq 0 ] || rc_all=1
  echo "  ATEN_CPU_CAPABILITY=$cap${mkl:+ MKL_ENABLE_INSTRUCTIONS=$mkl}: $rest"; done
exit $rc_all
