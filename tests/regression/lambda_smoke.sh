#!/usr/bin/env bash
# End-to-end smoke test of the default deck on the shipped lambda genome, shortened:
#   1. the held-out loss falls;
#   2. two runs with the same seed give bit-identical training losses;
#   3. a run resumed from a mid-run checkpoint reproduces the uninterrupted run step for step.
# usage: lambda_smoke.sh <mambamoe> <source dir> <scratch dir> [steps]
set -euo pipefail
exe=$1 src=$2 work=$3 steps=${4:-40}
half=$((steps / 2))
deck=$src/inputs/genomics/lambda.in
rm -rf "$work" && mkdir -p "$work"
common=(--train.steps="$steps" --train.log_interval=1 --train.eval_interval="$half" --checkpoint.interval="$half"
        --checkpoint.keep_all=true --train.warmup_steps=5)

"$exe" "$deck" "${common[@]}" --run.output_dir="$work/a" > "$work/a.log"
"$exe" "$deck" "${common[@]}" --run.output_dir="$work/b" > "$work/b.log"
"$exe" "$deck" "${common[@]}" --run.output_dir="$work/c" \
  --checkpoint.resume="$work/a/checkpoint_step$(printf %08d "$half").h5" > "$work/c.log"

# train rows: kind,step,loss,bits,lr,grad_norm,tokens_per_s,elapsed -> step,loss,bits,lr,grad_norm
losses() { grep '^train,' "$1" | cut -d, -f2-6; }
evals() { grep '^eval,' "$1" | cut -d, -f4; }

first=$(evals "$work/a/metrics.csv" | head -1)
last=$(evals "$work/a/metrics.csv" | tail -1)
echo "held-out bits/base: $first at step $half -> $last at step $steps"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || { echo "FAIL: held-out loss did not fall"; exit 1; }

diff <(losses "$work/a/metrics.csv") <(losses "$work/b/metrics.csv") > /dev/null ||
  { echo "FAIL: two runs with the same seed differ"; exit 1; }
echo "two runs: identical training losses over $steps steps"

diff <(losses "$work/a/metrics.csv" | awk -F, -v h="$half" '$1 > h') <(losses "$work/c/metrics.csv") > /dev/null ||
  { echo "FAIL: the resumed run differs from the uninterrupted one"; diff <(losses "$work/a/metrics.csv") \
      <(losses "$work/c/metrics.csv") | head; exit 1; }
echo "resumed at step $half: steps $((half + 1))-$steps identical to the uninterrupted run"
