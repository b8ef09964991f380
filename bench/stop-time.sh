#!/usr/bin/env bash
# Seconds from SIGTERM to exit of a training run: starts `train -e EXPERIMENT` into ARTIFACT_DIR,
# sends SIGTERM once metrics.csv has logged step STEP, and prints the exit status, the time
# the stop took and the line the run ended with.
#
#   cargo build --release && bench/stop-time.sh experiments/shakespeare-char.json /tmp/stop 137
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 EXPERIMENT ARTIFACT_DIR STEP" >&2; exit 2; }
experiment=$1 art=$2 step=$3
bin=${BIN:-target/release/transformer-lab}
rm -rf "$art"
"$bin" train -e "$experiment" --artifact-dir "$art" --plain >"$art.log" 2>"$art.err" &
pid=$!
logged=0
while [ "$logged" -lt "$step" ]; do
  kill -0 "$pid" 2>/dev/null || { echo "the run ended before step $step" >&2; exit 1; }
  logged=$(awk -F, '$3 == "train" && $4 == "lr" { s = $1 } END { print s + 0 }' \
    "$art/metrics.csv" 2>/dev/null || echo 0)
  sleep 0.05
done
start=$(date +%s.%N)
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
end=$(date +%s.%N)
echo "signal at logged step $logged: exit $status after $(echo "$end - $start" | bc) s"
tail -1 "$art.err"
