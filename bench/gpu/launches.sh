#!/usr/bin/env bash
# Kernel launches per training step on a GPU backend, and the time each kernel takes, by kernel:
# what a step costs in launches before any kernel runs (each is a few microseconds of driver and
# queue time on CUDA, more on wgpu), and where its time goes. Runs `bench train` for 1 step (to
# fill the autotune cache), then N and 2·N steps, with cubecl's profiling log on (a `cubecl.toml`
# in a scratch working directory: each kernel's run and duration) and takes the difference, so
# the warm-up, compilation and autotune launches cancel out. The durations are each kernel's
# alone (cubecl times kernels one at a time), so their total can exceed a step's time in
# `bench train`, where kernels overlap with the host's work; on lavapipe they say nothing about
# a GPU:
#
#   bench/gpu/launches.sh [BIN] [EXPERIMENT] [BACKEND] [STEPS]
#
# BIN defaults to target/release/transformer-lab, EXPERIMENT to
# experiments/shakespeare-char-gpu.json cut to batch 4 and context 64 (launches do not depend
# on the batch: the same kernels run, on less data; on lavapipe a full-size step takes
# minutes), BACKEND to wgpu, STEPS to 10. The data directory comes from TRANSFORMER_LAB_DATA.
#
# PRECISION=bf16 (or f16) times a half-precision step (`bench train --precision`).
#
# GENERATE=B measures a generated token instead (cached greedy decoding at batch B, one prompt
# token, random weights: `bench generate`, whose warm-up and timed run each generate N, then 2·N
# tokens; the difference over 2·N).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=$(realpath "${1:-target/release/transformer-lab}")
EXPERIMENT=${2:-}
BACKEND=${3:-wgpu}
STEPS=${4:-10}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "$EXPERIMENT" ]; then
  EXPERIMENT=$WORK/small.json
  python3 - "$EXPERIMENT" <<'EOF'
import json, sys
c = json.load(open("experiments/shakespeare-char-gpu.json"))
c["model"]["context"] = 64
c["train"].update(batch_size=4, eval_batches=1, num_workers=1)
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF
fi
EXPERIMENT=$(realpath "$EXPERIMENT")
# The binary runs from a scratch directory: a relative data directory would not be found.
if [ -n "${TRANSFORMER_LAB_DATA:-}" ]; then export TRANSFORMER_LAB_DATA=$(realpath "$TRANSFORMER_LAB_DATA"); fi
export TRANSFORMER_LAB_CACHE_DIR=${TRANSFORMER_LAB_CACHE_DIR:-$WORK/cache}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$WORK}

count() {
  local steps=$1
  cat >"$WORK/cubecl.toml" <<EOF
[profiling.logger]
level = "basic"
file = "$WORK/kernels-$steps.log"
append = false
EOF
  local run=(bench train -e "$EXPERIMENT" --steps "$steps" --warmup 2 --runs 1
    ${PRECISION:+--precision "$PRECISION"})
  [ -n "${GENERATE:-}" ] && run=(bench generate -e "$EXPERIMENT" --cached-only --batch "$GENERATE"
    --tokens "$steps" --runs 1)
  (cd "$WORK" && "$BIN" --backend "$BACKEND" "${run[@]}" >"$WORK/bench-$steps.txt" 2>&1) ||
    { echo "error: ${run[*]:0:2} failed:" >&2; tail -3 "$WORK/bench-$steps.txt" >&2; exit 1; }
  # "| <duration> | <kernel> | <detail> | … | <runtime>", one line per kernel run: the
  # kernel's name (type parameters dropped), with burn's binary kernels' operation
  # ("KernelBinop(MulOp)") and a matmul's algorithm ("MatmulEntry(SimpleMatmulFamily)"); then
  # per name the runs and the microseconds they took.
  grep -E '^\| [0-9.]+(ns|µs|ms|s) +\| ' "$WORK/kernels-$steps.log" |
    sed -E 's/<[^|]*//g' |
    awk -v steps="$steps" -F ' *[|] *' '{
        t = $2; unit = t; sub(/^[0-9.]+/, "", unit); sub(/[^0-9.]+$/, "", t)
        us = t * (unit == "ns" ? 0.001 : unit == "µs" ? 1 : unit == "ms" ? 1000 : 1000000)
        if (us >= 1000000) { slow += 1; next } # compilation (a kernel at these sizes runs in ms)
        name = $3
        if ($4 ~ /Op$/) name = name "(" $4 ")"
        if (name == "MatmulEntry") for (i = 4; i <= NF; i++) if ($i ~ /MatmulFamily$/) { name = name "(" $i ")"; break }
        runs[name] += 1; time[name] += us
      } END { for (n in runs) printf "%s %d %.1f\n", n, runs[n], time[n]
        if (slow) printf "%d kernel runs over 1 s (compilation) left out of the %d-step run\n", slow, steps > "/dev/stderr" }' |
    sort >"$WORK/count-$steps.txt"
}

count 1 # fills the autotune cache, whose timing runs would otherwise fall in the first count
count "$STEPS"
count $((2 * STEPS))
what="training step"
per=$STEPS
if [ -n "${GENERATE:-}" ]; then what="generated token (batch $GENERATE)"; per=$((2 * STEPS)); fi
echo "kernels per $what ($BACKEND, $(basename "$EXPERIMENT")): launches, µs, share of the kernels' time"
join -a 2 -e 0 -o 0,1.2,1.3,2.2,2.3 "$WORK/count-$STEPS.txt" "$WORK/count-$((2 * STEPS)).txt" |
  awk -v n="$per" '{ d = ($4 - $2) / n; t = ($5 - $3) / n
      if (d != 0) { name[++k] = $1; runs[k] = d; us[k] = t; total += d; time += t } }
    END { for (i = 1; i <= k; i++)
        printf "%8.1f %12.1f %6.1f%%  %s\n", runs[i], us[i], (time > 0 ? 100 * us[i] / time : 0), name[i] | "sort -k2,2 -rn"
      close("sort -k2,2 -rn"); printf "%8.1f %12.1f %6.1f%%  total\n", total, time, 100 }'
