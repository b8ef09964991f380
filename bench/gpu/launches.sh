#!/usr/bin/env bash
# Kernel launches per training step on a GPU backend, by kernel: what a step costs in launches
# before any kernel runs (each is a few microseconds of driver and queue time on CUDA, more on
# wgpu). Runs `bench train` for 1 step (to fill the autotune cache), then N and 2·N steps, with cubecl's execution log on (a
# `cubecl.toml` in a scratch working directory) and counts the difference, so the warm-up,
# compilation and autotune launches cancel out:
#
#   bench/gpu/launches.sh [BIN] [EXPERIMENT] [BACKEND] [STEPS]
#
# BIN defaults to target/release/transformer-lab, EXPERIMENT to
# experiments/shakespeare-char-gpu.json cut to batch 4 and context 64 (launches do not depend
# on the batch: the same kernels run, on less data; on lavapipe a full-size step takes
# minutes), BACKEND to wgpu, STEPS to 10. The data directory comes from TRANSFORMER_LAB_DATA.
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
export TRANSFORMER_LAB_CACHE_DIR=${TRANSFORMER_LAB_CACHE_DIR:-$WORK/cache}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$WORK}

count() {
  local steps=$1
  cat >"$WORK/cubecl.toml" <<EOF
[profiling.logger]
level = "minimal"
file = "$WORK/launches-$steps.log"
append = false
EOF
  (cd "$WORK" && "$BIN" --backend "$BACKEND" bench train -e "$EXPERIMENT" --steps "$steps" \
    --warmup 2 --runs 1 >"$WORK/bench-$steps.txt" 2>&1) ||
    { echo "error: bench train failed:" >&2; tail -3 "$WORK/bench-$steps.txt" >&2; exit 1; }
  # "Executing <kernel> | <operation> | …": the kernel's name, with its element-wise operation
  # where it names one (burn's binary kernels: "KernelBinop(MulOp)").
  sed -E 's/^Executing //; s/<[^|]*//g' "$WORK/launches-$steps.log" |
    awk -F ' [|] ' '{ name = $1; if ($2 ~ /Op *$/) name = name "(" $2 ")"; gsub(/ /, "", name); print name }' |
    sort | uniq -c | awk '{print $2, $1}' | sort >"$WORK/count-$steps.txt"
}

count 1 # fills the autotune cache, whose timing runs would otherwise fall in the first count
count "$STEPS"
count $((2 * STEPS))
echo "kernel launches per training step ($BACKEND, $(basename "$EXPERIMENT"))"
join -a 2 -e 0 -o 0,1.2,2.2 "$WORK/count-$STEPS.txt" "$WORK/count-$((2 * STEPS)).txt" |
  awk -v n="$STEPS" '{ d = ($3 - $2) / n; if (d != 0) printf "%8.1f  %s\n", d, $1; total += d }
    END { printf "%8.1f  total\n", total }' | sort -n
