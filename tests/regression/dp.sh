#!/usr/bin/env bash
# Data parallelism is exact: the default lambda deck trained for 10 steps (2 micro-batches of 4 windows per step)
#   1. on 1 rank and on 2 ranks (dp = 2, one micro-batch each) gives bit-identical training and held-out losses
#      in metrics.csv and bit-identical final checkpoints (parameters and both AdamW moments);
#   2. 2 ranks resumed from the 1-rank run's step-5 checkpoint reproduce the 1-rank run (every rank reads it);
#   3. ZeRO-1 on 2 ranks gives the same losses and the same final checkpoint;
#   4. a layout that does not match the ranks (dp = 3 on 2) and a grad_accum that does not divide over dp fail with
#      messages naming the values.
# usage: dp.sh <mambamoe> <source dir> <scratch dir> <ckpt_compare>   (exit 77 = skipped: no mpirun)
set -euo pipefail
exe=$1 src=$2 work=$3 cmp=$4
if ! command -v mpirun > /dev/null; then
  echo "SKIP: mpirun not found (data-parallel runs need an MPI launcher)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
mpi=(mpirun -np 2 --oversubscribe)
deck=$src/inputs/genomics/lambda.in
rm -rf "$work" && mkdir -p "$work"
common=(--train.steps=10 --train.batch_size=4 --train.grad_accum=2 --train.log_interval=1 --train.eval_interval=5
        --checkpoint.interval=5 --checkpoint.keep_all=true --train.warmup_steps=3)
fail() { echo "FAIL: $*"; exit 1; }

"$exe" "$deck" "${common[@]}" --run.output_dir="$work/r1" > "$work/r1.log" 2>&1 || fail "1-rank run (see $work/r1.log)"
"${mpi[@]}" "$exe" "$deck" "${common[@]}" --run.output_dir="$work/r2" > "$work/r2.log" 2>&1 ||
  fail "2-rank run (see $work/r2.log)"
"${mpi[@]}" "$exe" "$deck" "${common[@]}" --run.output_dir="$work/r2resume" \
  --checkpoint.resume="$work/r1/checkpoint_step00000005.h5" > "$work/r2resume.log" 2>&1 ||
  fail "2-rank resumed run (see $work/r2resume.log)"

# train rows: step,loss,bits,lr,grad_norm; eval rows: step,loss,bits
losses() { grep '^train,' "$1" | cut -d, -f2-6; }
evals() { grep '^eval,' "$1" | cut -d, -f2-4; }
[ "$(losses "$work/r1/metrics.csv" | wc -l)" = 10 ] || fail "the 1-rank run did not log 10 steps"
diff <(losses "$work/r1/metrics.csv") <(losses "$work/r2/metrics.csv") ||
  fail "training losses differ between 1 and 2 ranks"
diff <(evals "$work/r1/metrics.csv") <(evals "$work/r2/metrics.csv") || fail "held-out losses differ"
echo "1 vs 2 ranks: identical training losses over 10 steps, identical held-out losses"
"$cmp" "$work/r1/checkpoint.h5" "$work/r2/checkpoint.h5" || fail "final checkpoints differ between 1 and 2 ranks"
[ "$(grep -c '^step ' "$work/r2.log")" = 10 ] || fail "the 2-rank run should print each step once (rank 0 only)"

diff <(losses "$work/r1/metrics.csv" | awk -F, '$1 > 5') <(losses "$work/r2resume/metrics.csv") ||
  fail "2 ranks resumed from the 1-rank step-5 checkpoint differ from the 1-rank run"
"$cmp" "$work/r1/checkpoint.h5" "$work/r2resume/checkpoint.h5" || fail "resumed final checkpoint differs"
echo "2 ranks resumed from the 1-rank step-5 checkpoint: steps 6-10 and the final checkpoint identical"

# ZeRO-1 (moments sharded over the 2 ranks, gathered into the checkpoint): the same checkpoint as 1 rank
"${mpi[@]}" "$exe" "$deck" "${common[@]}" --parallel.zero1=true --run.output_dir="$work/r2zero" > "$work/r2zero.log" 2>&1 ||
  fail "2-rank ZeRO-1 run (see $work/r2zero.log)"
diff <(losses "$work/r1/metrics.csv") <(losses "$work/r2zero/metrics.csv") || fail "ZeRO-1 losses differ from 1 rank's"
"$cmp" "$work/r1/checkpoint.h5" "$work/r2zero/checkpoint.h5" || fail "the ZeRO-1 final checkpoint differs from 1 rank's"
echo "ZeRO-1 on 2 ranks: identical losses and final checkpoint (parameters and both moments)"

# bad layouts: the error names the values
if "${mpi[@]}" "$exe" "$deck" --train.steps=1 --run.output_dir="$work/bad" --parallel.dp=3 > "$work/bad.log" 2>&1; then
  fail "dp = 3 on 2 ranks was accepted"
fi
grep -q "error: \[parallel\]: tp = 1, cp = 1, ep = 1, dp = 3: .* but the run has 2 MPI ranks" "$work/bad.log" ||
  { cat "$work/bad.log"; fail "the dp = 3 on 2 ranks error does not name the values"; }
if "${mpi[@]}" "$exe" "$deck" --train.steps=1 --run.output_dir="$work/bad2" --train.grad_accum=3 > "$work/bad2.log" 2>&1
then fail "grad_accum = 3 over dp = 2 was accepted"; fi
grep -q "error: \[train\] grad_accum: grad_accum = 3 micro-batches per step do not divide over ep \* dp = 2" "$work/bad2.log" ||
  { cat "$work/bad2.log"; fail "the grad_accum error does not name the values"; }
echo "bad layouts rejected with their values named"
