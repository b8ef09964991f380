#!/usr/bin/env bash
# Two benchmarks run in alternation, round after round, and the median of their ratios: the way
# every speed comparison in the README is taken, since a shared machine's speed drifts by 20–50%
# within minutes and only runs side by side in time can be compared. Each command must print a
# line `median step X ms` (as `transformer-lab bench train` and bench/pytorch/train_bench.py do).
# The order is swapped every round, so neither always runs first.
#
#   bench/alternate.sh [ROUNDS] [COMMAND_A COMMAND_B]
#
# ROUNDS defaults to 6. Without commands, A is PyTorch eager on 2 threads
# (bench/pytorch/train_bench.py --adamw fused) and B is `transformer-lab bench train` on the
# default experiment, built at target/release/transformer-lab (BIN overrides it); the data
# directory comes from TRANSFORMER_LAB_DATA. The ratio printed is A's step over B's: how many
# times faster B is.
#
# Example, two builds of ours against each other:
#   bench/alternate.sh 8 "/tmp/before --backend flex bench train --steps 100 --runs 5" \
#                        "/tmp/after --backend flex bench train --steps 100 --runs 5"
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-6}
if ! [[ $ROUNDS =~ ^[1-9][0-9]*$ ]]; then
  echo "error: ROUNDS must be a positive whole number, not '$ROUNDS'" >&2
  exit 2
fi
if [ $# -ge 3 ]; then
  A=$2
  B=$3
elif [ $# -le 1 ]; then
  : "${TRANSFORMER_LAB_DATA:?set TRANSFORMER_LAB_DATA to the data directory}"
  BIN=${BIN:-target/release/transformer-lab}
  A="python3 bench/pytorch/train_bench.py --data-dir '$TRANSFORMER_LAB_DATA' --adamw fused --runs 3 --threads 2"
  B="'$BIN' --backend flex bench train --steps 30 --warmup 5 --runs 3"
else
  echo "usage: bench/alternate.sh [ROUNDS] [COMMAND_A COMMAND_B]" >&2
  exit 2
fi

# The step time a command prints, in ms; the command's own output goes to stderr on failure.
step() {
  local out
  if ! out=$(bash -c "$1" 2>&1); then
    echo "$out" >&2
    echo "error: this command failed: $1" >&2
    exit 1
  fi
  local ms
  ms=$(sed -n 's/^median step \([0-9.]*\) ms.*/\1/p' <<<"$out" | head -1)
  if [ -z "$ms" ]; then
    echo "$out" >&2
    echo "error: no 'median step X ms' line from: $1" >&2
    exit 1
  fi
  echo "$ms"
}

echo "A: $A"
echo "B: $B"
printf '%-6s %10s %10s %8s\n' round "A ms" "B ms" "A/B"
rows=()
for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then
    a=$(step "$A")
    b=$(step "$B")
  else
    b=$(step "$B")
    a=$(step "$A")
  fi
  rows+=("$a $b")
  printf '%-6s %10s %10s %8s\n' "$round" "$a" "$b" "$(python3 -c "print(f'{$a / $b:.2f}')")"
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
rows = [tuple(map(float, line.split())) for line in sys.stdin]
a, b = zip(*rows)
ratio = statistics.median(x / y for x, y in rows)
print(f"median   {statistics.median(a):10.1f} {statistics.median(b):10.1f} {ratio:8.2f}"
      f"   (A/B over {len(rows)} rounds: {min(x / y for x, y in rows):.2f} to {max(x / y for x, y in rows):.2f})")
'
