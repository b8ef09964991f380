#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, PyTorch and no Rust toolchain or network,
# with a binary built elsewhere by `cargo build --release --features wgpu,cuda`:
#
#   bench/gpu/check.sh [BIN] [DATA_DIR] [OUT_DIR]
#
# BIN defaults to .gpu/transformer-lab (or .gpu/transformer-lab.xz, unpacked), DATA_DIR to
# .gpu/data (holding tinyshakespeare/input.txt), OUT_DIR to $OUT or ./gpu-check. Each step has
# its own limit and the whole a deadline (GPU_CHECK_SECONDS, 540 s); it prints one table last.
#
# On a fresh machine the first CUDA steps are slow: every kernel is compiled (NVRTC, then the
# driver's PTX compiler, 0.7–1.3 s each on an H200), one at a time in each process, and every
# matmul shape autotunes ~10 candidates; the kernel check alone ran over 250 s there
# (2026-11-28). The binary keeps the compiled kernels and autotune choices in its cache
# directory (GPU_CHECK_CACHE here, kept out of OUT_DIR; cubecl's caches take writers from
# several processes at once). So the script first runs, all at once for at most
# GPU_CHECK_WARM_SECONDS (270 s), processes that between them compile what the later steps
# need: the kernel check split by operation (`doctor --only`), a composed training step at the
# step check's shape, bf16 training, cached generation and the compiled PyTorch peer, beside the
# learning checks whose verdicts need no quiet GPU (the raw fused cuda path, and wgpu after its
# `doctor`). Everything timed runs after them, one step at a time, on warm caches:
#
#   - `doctor` on cuda and wgpu: every fused kernel against its composed form on the device;
#   - a learning check per backend: experiments/shakespeare-char-gpu.json cut to 150 steps must
#     end below the unigram loss of its text (cuda with the kernel checks — each operation, then
#     the run's first step fused against composed, whose warnings name what runs composed —,
#     cuda without them — the raw fused path — and wgpu);
#   - `bench train` at f32 and bf16 on cuda, f32 on wgpu, alternating with the PyTorch peer on
#     the same GPU (bench/pytorch/train_bench.py at f32, f32 with TF32 products, bf16 and
#     compiled bf16);
#   - `bench generate` (cached) at batch 1 and 8 on cuda, and transformers' `generate`
#     (bench/pytorch/generate_bench.py); ours again with each product of a decoding step, its
#     LayerNorm, GELU and residual addition apart (what the decode_linear kernel saves);
#   - where a fused cuda step's (f32 and bf16) and a generated token's time goes: launches and
#     microseconds by kernel (bench/gpu/launches.sh at the experiment's full shape);
#   - the products, more than half the step: every candidate of burn's matmul at the
#     feed-forward layer's forward product and both gradients, in f32 and bf16, against the
#     autotuned choice (`bench matmul`), and what autotune chose at every shape the runs met
#     (bench/gpu/autotune.py).
#
# Every log goes to OUT_DIR (GPU_CHECK_PACK=1 packs them into one archive there); CI_EXPECT_CUDA=1
# is set for anything that reads it. Where the raw fused path does not learn, it runs the learning
# check once per fused operation with that one composed, to name the operation at fault.
set -uo pipefail
cd "$(dirname "$0")/../.."

BIN=${1:-.gpu/transformer-lab}
DATA=${2:-.gpu/data}
OUT_DIR=${3:-${OUT:-gpu-check}}
DEADLINE=${GPU_CHECK_SECONDS:-540}
mkdir -p "$OUT_DIR"
export CI_EXPECT_CUDA=1 TRANSFORMER_LAB_DATA="$DATA"
export TRANSFORMER_LAB_CACHE_DIR="${GPU_CHECK_CACHE:-${TMPDIR:-/tmp}/transformer-lab-gpu-check}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}" PYTHONUNBUFFERED=1

if [ ! -x "$BIN" ] && [ -f "$BIN.xz" ]; then
  xz -dkf "$BIN.xz" && chmod +x "$BIN"
fi
[ -x "$BIN" ] || { echo "error: no binary at $BIN (build with --features wgpu,cuda, strip, xz)"; exit 2; }
[ -f "$DATA/tinyshakespeare/input.txt" ] || { echo "error: no $DATA/tinyshakespeare/input.txt"; exit 2; }
# Absolute: bench/gpu/launches.sh runs the binary from a scratch directory.
DATA=$(realpath "$DATA")
export TRANSFORMER_LAB_DATA="$DATA"

ROWS=()
row() { ROWS+=("$(printf '%-40s %-10s %s' "$1" "$2" "$3")"); }

# Runs NAME LIMIT CMD...: logs to OUT_DIR/NAME.log, at most LIMIT seconds or what is left.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then echo "skipped (deadline)" >"$OUT_DIR/$name.log"; return 125; fi
  echo "== $name (limit ${limit}s, ${SECONDS}s in)" >&2
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s" >&2
  echo "exit $rc after $((SECONDS - start)) s" >>"$OUT_DIR/$name.log"
  return $rc
}

status() { case $1 in 0) echo ok;; 124|137) echo "timed out";; 125) echo skipped;; *) echo "exit $1";; esac; }
# The exit status a step's log ends with (125 where it was skipped or never ran).
rc_of() { sed -n 's/^exit \([0-9]*\) after .*/\1/p' "$OUT_DIR/$1.log" 2>/dev/null | tail -1 | grep . || echo 125; }
# What a failed step said: the first error line of its log, else its last line (a Python
# traceback's last).
why() {
  local log="$OUT_DIR/$1.log"
  { grep -m1 '^error' "$log" || grep -v '^exit [0-9]* after' "$log" | tail -1; } 2>/dev/null | cut -c1-100
}

# The learning check's experiment: 150 steps of the GPU experiment, against the unigram loss of
# its text; and the training step check's shape (one device's batch, at most 16 items) for the
# warm-up.
python3 - "$OUT_DIR/learn.json" "$OUT_DIR/composed.json" <<'EOF'
import json, sys
c = json.load(open("experiments/shakespeare-char-gpu.json"))
c["name"] = "gpu-check-learn"
c["train"].update(steps=150, steps_per_epoch=75, eval_batches=20, warmup_steps=30, decay_steps=150)
json.dump(c, open(sys.argv[1], "w"), indent=1)
c["train"].update(batch_size=16, steps=2, steps_per_epoch=2, eval_batches=1, warmup_steps=1, decay_steps=2)
json.dump(c, open(sys.argv[2], "w"), indent=1)
EOF
UNIGRAM=$(python3 - "$DATA/tinyshakespeare/input.txt" <<'EOF'
import collections, math, sys
text = open(sys.argv[1], encoding="utf-8").read()
counts = collections.Counter(text)
n = len(text)
print(f"{-sum(c / n * math.log(c / n) for c in counts.values()):.4f}")
EOF
)
learn_run() {
  local name=$1 backend=$2 limit=$3; shift 3
  step "learn-$name" "$limit" "$BIN" --backend "$backend" "$@" train -e "$OUT_DIR/learn.json" \
    --artifact-dir "${TMPDIR:-/tmp}/gpu-check-art-$name" --force --plain
}
learn_row() {
  local name=$1 rc valid speed composed
  rc=$(rc_of "learn-$name")
  valid=$(grep ' valid ' "$OUT_DIR/learn-$name.log" | tail -1 | sed -E 's/.*loss ([0-9.a-zA-Z]+).*/\1/')
  speed=$(grep -o '[0-9]* tok/s' "$OUT_DIR/learn-$name.log" | tail -1)
  local verdict="no validation $(why "learn-$name")"
  if [ -n "$valid" ]; then
    verdict=$(python3 -c "print('learns' if float('$valid') < $UNIGRAM else 'DOES NOT LEARN')" 2>/dev/null || echo "?")
  fi
  # The operations the kernel check or the step check made run composed (their warnings).
  composed=$(grep '^warning' "$OUT_DIR/learn-$name.log" | grep -o 'fused [a-z_]* kernel' | awk '{print $2}' | sort -u | paste -sd, - || true)
  row "learning ($name)" "$(status "$rc")" "valid ${valid:-?} vs unigram $UNIGRAM: $verdict; ${speed:-}${composed:+; composed: $composed}"
}
doctor_row() {
  local backend=$1 rc summary wrong
  rc=$(rc_of "doctor-$backend")
  summary=$(grep -o '[0-9]* of [0-9]* operations agree' "$OUT_DIR/doctor-$backend.log" || true)
  wrong=$(grep -o 'fused kernels wrong on this device: .*(' "$OUT_DIR/doctor-$backend.log" | sed 's/fused kernels wrong on this device: //; s/ (//' || true)
  row "kernels ($backend)" "$(status "$rc")" "${summary:-$(why "doctor-$backend")}${wrong:+; fallback: $wrong}"
}

# 1. The warm-up, all at once (see the top). The learning rows' tokens/s are no benchmark: those
# runs share the GPU and the processor with the others.
WARM=${GPU_CHECK_WARM_SECONDS:-270}
WARM_END=$((SECONDS + WARM))
NEVER=(--kernel-check never)
# The kernel check split by operation, the parts about as many kernels each (on lavapipe: 36,
# 64, 52, 51, 63 and 70 of the whole check's 203).
WARM_OPS=(linear attention packed_attention layer_norm gelu,dropout,adamw softmax,cross_entropy,embedding,decode_linear)
for i in "${!WARM_OPS[@]}"; do
  step "warm-doctor-$i" "$WARM" "$BIN" --backend cuda doctor --only "${WARM_OPS[$i]}" &
done
# The raw fused path (the learning check that matters most), and a composed step at the step
# check's shape.
learn_run cuda-unchecked cuda "$WARM" "${NEVER[@]}" &
step warm-composed "$WARM" "$BIN" --backend cuda --no-fused "${NEVER[@]}" train \
  -e "$OUT_DIR/composed.json" --artifact-dir "${TMPDIR:-/tmp}/gpu-check-art-composed" --force --plain &
step warm-bench-bf16 "$WARM" "$BIN" --backend cuda "${NEVER[@]}" bench train \
  -e experiments/shakespeare-char-gpu.json --precision bf16 --steps 2 --warmup 1 --runs 1 &
step warm-generate "$WARM" "$BIN" --backend cuda "${NEVER[@]}" bench generate \
  -e experiments/shakespeare-char-gpu.json --cached-only --batch 1,8 --runs 1 &
# wgpu: its whole check (which its learning run then reads from the cache), then that run.
{
  step doctor-wgpu "$WARM" "$BIN" --backend wgpu doctor
  learn_run wgpu wgpu "$((WARM_END - SECONDS))"
} &
# Every candidate matmul kernel at the feed-forward layer's three products (compiled here,
# timed in 7.).
for precision in f32 bf16; do
  step "warm-matmul-$precision" "$WARM" "$BIN" --backend cuda bench matmul \
    -e experiments/shakespeare-char-gpu.json --only ff1 --precision "$precision" --runs 1 &
done
step warm-pytorch-compiled "$WARM" python3 bench/pytorch/train_bench.py --data-dir "$DATA" \
  --config gpu --device cuda --adamw fused --dtype bf16 --compile --steps 2 --warmup 1 --runs 1 &
wait
for i in "${!WARM_OPS[@]}"; do
  rc=$(rc_of "warm-doctor-$i")
  [ "$rc" = 0 ] || row "warm-up (doctor --only ${WARM_OPS[$i]})" "$(status "$rc")" "$(why "warm-doctor-$i")"
done
for warm in composed bench-bf16 generate matmul-f32 matmul-bf16 pytorch-compiled; do
  rc=$(rc_of "warm-$warm")
  [ "$rc" = 0 ] || row "warm-up ($warm)" "$(status "$rc")" "$(why "warm-$warm")"
done

# 2. The kernels on each backend: cuda's whole check now, on warm caches (what the checked
# learning run below reads).
step doctor-cuda 200 "$BIN" --backend cuda doctor
doctor_row cuda
doctor_row wgpu

# 3. Learning: the raw fused cuda path and wgpu (run above), and cuda with the kernel checks —
# each operation, then the run's first step fused against composed, whose warnings name what
# runs composed.
learn_row cuda-unchecked
RAW_LEARNS=$(case "${ROWS[-1]}" in *"DOES NOT LEARN"*) echo no;; *) echo yes;; esac)
learn_run cuda cuda 200
learn_row cuda
learn_row wgpu

# Where the raw fused path does not learn: which operation. Each run forces one operation to
# its composed form through the kernel check's cache (its entry marked as failed), the others
# fused; the run that learns names the culprit.
CHECKS="$TRANSFORMER_LAB_CACHE_DIR/kernel-check.json"
if [ "$RAW_LEARNS" = no ] && [ -f "$CHECKS" ]; then
  cp "$CHECKS" "$OUT_DIR/kernel-check.json"
  for op in attention packed_attention cross_entropy adamw layer_norm gelu dropout softmax; do
    python3 - "$OUT_DIR/kernel-check.json" "$CHECKS" "$op" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
for ops in c["checks"].values():
    if sys.argv[3] in ops:
        ops[sys.argv[3]]["error"] = 1.0
json.dump(c, open(sys.argv[2], "w"))
EOF
    step "bisect-$op" 90 "$BIN" --backend cuda train -e "$OUT_DIR/learn.json" \
      --artifact-dir "${TMPDIR:-/tmp}/gpu-check-art-bisect" --force --plain
    rc=$?
    valid=$(grep ' valid ' "$OUT_DIR/bisect-$op.log" | tail -1 | sed -E 's/.*loss ([0-9.a-zA-Z]+).*/\1/')
    row "cuda, $op composed" "$(status $rc)" "valid ${valid:-?} vs unigram $UNIGRAM"
  done
  cp "$OUT_DIR/kernel-check.json" "$CHECKS"
fi

# 4. Training speed: ours and the PyTorch peer on the same GPU, alternating.
bench_train() {
  local name=$1 backend=$2; shift 2
  step "bench-train-$name" 120 "$BIN" --backend "$backend" bench train \
    -e experiments/shakespeare-char-gpu.json --steps 20 --warmup 5 --runs 3 "$@"
  local rc=$?
  local speed; speed=$(grep -E 'tokens/s|tok/s' "$OUT_DIR/bench-train-$name.log" | head -1)
  row "bench train ($name)" "$(status $rc)" "${speed:-$(why "bench-train-$name")}"
  local split; split=$(grep -E 'step .* ms' "$OUT_DIR/bench-train-$name.log" | head -1)
  [ -n "$split" ] && row "" "" "$split"
  local warm; warm=$(grep -E '^warm-up' "$OUT_DIR/bench-train-$name.log" | head -1 | cut -c1-100)
  [ -n "$warm" ] && row "" "" "$warm"
}
peer() {
  local name=$1; shift
  step "pytorch-$name" 100 python3 bench/pytorch/train_bench.py --data-dir "$DATA" --config gpu \
    --device cuda --adamw fused --steps 20 --warmup 5 --runs 3 "$@"
  local rc=$?
  local speed; speed=$(grep 'tokens/s' "$OUT_DIR/pytorch-$name.log" | sed -E 's/.*: ([0-9]+ tokens\/s).*/\1/')
  row "pytorch train ($name)" "$(status $rc)" "${speed:-$(why "pytorch-$name")}"
}
bench_train cuda-f32 cuda
peer f32 --dtype f32
peer f32-tf32 --dtype tf32
bench_train cuda-bf16 cuda --precision bf16
peer bf16 --dtype bf16
peer bf16-compiled --dtype bf16 --compile
bench_train wgpu-f32 wgpu

# 5. Generation speed: ours (cached) and transformers' generate.
step bench-generate-cuda 90 "$BIN" --backend cuda bench generate \
  -e experiments/shakespeare-char-gpu.json --cached-only --batch 1,8
rc=$?
for b in 1 8; do
  line=$(awk -v b="$b" '$1 == "cached" && $2 == b' "$OUT_DIR/bench-generate-cuda.log")
  row "bench generate (cuda, batch $b)" "$(status $rc)" "${line:-$(why bench-generate-cuda)}"
done
step transformers-generate 90 python3 bench/pytorch/generate_bench.py --device cuda --cached-only --batch 1,8 --runs 3
rc=$?
for b in 1 8; do
  line=$(awk -v b="$b" '$1 == "cached" && $2 == b' "$OUT_DIR/transformers-generate.log")
  row "transformers generate (batch $b)" "$(status $rc)" "${line:-$(why transformers-generate)}"
done
# The same decode with each product, its LayerNorm, GELU and residual addition apart (the
# decode_linear kernel broken on purpose, so it falls back): what folding them saves on a GPU.
step bench-generate-apart 90 env TRANSFORMER_LAB_BREAK_KERNEL=decode_linear "$BIN" --backend cuda \
  bench generate -e experiments/shakespeare-char-gpu.json --cached-only --batch 1,8
rc=$?
for b in 1 8; do
  line=$(awk -v b="$b" '$1 == "cached" && $2 == b' "$OUT_DIR/bench-generate-apart.log")
  row "bench generate, products apart (batch $b)" "$(status $rc)" "${line:-$(why bench-generate-apart)}"
done

# 6. Where a fused cuda step's and a generated token's time goes: launches and time by kernel
# at the experiment's full shape (bench/gpu/launches.sh; the whole tables in kernels-*.log).
kernels() {
  local name=$1 label=$2 limit=$3; shift 3
  step "kernels-$name" "$limit" "$@"
  local rc=$? log="$OUT_DIR/kernels-$name.log"
  local total; total=$(awk '$NF == "total" { printf "%.0f launches, %.1f ms of kernels", $1, $2 / 1000 }' "$log")
  local top; top=$(grep -A3 '^kernels per' "$log" | tail -3 | awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $4, $3 }')
  row "$label" "$(status $rc)" "${total:-$(why "kernels-$name")}${top:+; $top}"
}
kernels cuda-step "kernels per step (cuda, f32)" 100 \
  bench/gpu/launches.sh "$BIN" experiments/shakespeare-char-gpu.json cuda 3
kernels cuda-step-bf16 "kernels per step (cuda, bf16)" 60 \
  env PRECISION=bf16 bench/gpu/launches.sh "$BIN" experiments/shakespeare-char-gpu.json cuda 3
kernels cuda-token "kernels per token (cuda, batch 1)" 60 \
  env GENERATE=1 bench/gpu/launches.sh "$BIN" experiments/shakespeare-char-gpu.json cuda 32

# 7. The products, more than half a cuda step: every candidate kernel of burn's matmul at the
# feed-forward layer's three products (forward, dX, dW), against what autotune chose (whole
# tables in matmul-*.log), and what autotune chose at every shape the runs met (autotune.log).
for precision in f32 bf16; do
  step "matmul-$precision" 60 "$BIN" --backend cuda bench matmul \
    -e experiments/shakespeare-char-gpu.json --only ff1 --precision "$precision" --runs 5
  rc=$?
  line=$(grep -o '[0-9.]* ms as autotuned.*' "$OUT_DIR/matmul-$precision.log" | head -1)
  best=$(awk '/^ff1 forward/ { getline; print $1, $2, $3, $4, $5; exit }' "$OUT_DIR/matmul-$precision.log")
  row "products, ff1 ($precision)" "$(status $rc)" "${line:-$(why "matmul-$precision")}"
  [ -n "$best" ] && row "" "" "forward's fastest: $best"
done
# Where a candidate beat autotune at the forward product, the whole step with it named for
# every product (TRANSFORMER_LAB_MATMUL), against the bench train rows above.
for precision in f32 bf16; do
  kernel=$(awk '/^ff1 forward/ { f = 1; next } f && /TFLOP/ && !/WRONG/ { print $1; exit }' "$OUT_DIR/matmul-$precision.log")
  if [ -n "$kernel" ] && [ "$kernel" != autotune ]; then
    TRANSFORMER_LAB_MATMUL=$kernel bench_train "cuda-$precision-$kernel" cuda --precision "$precision"
  fi
done
# wgpu's f32 products: whether Vulkan's cooperative matrices (tensor cores) take f32 operands
# on this card, or only its unit kernels run (the likely cause of wgpu's slower step).
step matmul-wgpu 60 "$BIN" --backend wgpu bench matmul \
  -e experiments/shakespeare-char-gpu.json --only "ff1 forward" --runs 3
rc=$?
best=$(awk '/^ff1 forward/ { getline; print $1, $2, $3, $4, $5; exit }' "$OUT_DIR/matmul-wgpu.log")
refused=$(grep -o 'did not run ([0-9]*)' "$OUT_DIR/matmul-wgpu.log" | paste -sd, -)
row "products, ff1 forward (wgpu f32)" "$(status $rc)" "${best:-$(why matmul-wgpu)}${refused:+; $refused}"
python3 bench/gpu/autotune.py "$TRANSFORMER_LAB_CACHE_DIR" >"$OUT_DIR/autotune.log" 2>&1
row "matmul autotune (all runs)" "" "$(($(wc -l <"$OUT_DIR/autotune.log") - 1)) shapes: autotune.log"

# The table.
echo
echo "GPU check, $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), ${SECONDS}s"
printf '%-40s %-10s %s\n' "check" "status" "result"
for r in "${ROWS[@]}"; do echo "$r"; done

# GPU_CHECK_PACK=1: the logs as one archive in OUT_DIR (for a machine that returns few files).
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
  (cd "$OUT_DIR" && tar czf gpu-check-logs.tar.gz --exclude gpu-check-logs.tar.gz ./*.log ./*.json 2>/dev/null &&
    rm -f ./*.log ./*.json)
fi
