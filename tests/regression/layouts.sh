#!/usr/bin/env bash
# Parallel layouts end to end, and checkpoints that reshard: a Mamba-2 + MoE model (M2 E M2 E on the lambda deck,
# seq_len 200: neither it nor a cp slice is a multiple of the chunk 64) trained for 6 steps on 4 ranks at
# (tp2, cp2), writing a checkpoint at step 3, then
#   1. its first 3 training losses equal a 1-rank run's within 2e-5 relative (the losses are printed with 6 digits);
#   2. resumed from its step-3 checkpoint at (dp4) and at 1 rank, steps 4-6 give identical losses (dp is exact)
#      and the same losses as the (tp2, cp2) run itself within 2e-5;
#   3. a layout whose heads or groups do not divide by tp fails naming the values;
#   4. layout = auto prints the planner's layout and memory estimate and trains.
# usage: layouts.sh <mambamoe> <source dir> <scratch dir>   (exit 77 = skipped: no mpirun)
set -euo pipefail
exe=$1 src=$2 work=$3
if ! command -v mpirun > /dev/null; then
  echo "SKIP: mpirun not found (parallel runs need an MPI launcher)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
mpi=(mpirun -np 4 --oversubscribe)
deck=$src/inputs/genomics/lambda.in
rm -rf "$work" && mkdir -p "$work"
common=(--model.n_layer=4 "--model.pattern=M2 E M2 E" --model.ngroups=2 --moe.n_experts=4 --moe.top_k=2
        --moe.d_ff=64 --moe.shared_d_ff=32 --train.seq_len=200 --train.batch_size=2 --train.grad_accum=4
        --train.log_interval=1 --train.eval_interval=0 --train.warmup_steps=2 --checkpoint.interval=3
        --checkpoint.keep_all=true)
fail() { echo "FAIL: $*"; exit 1; }
losses() { grep '^train,' "$1" | cut -d, -f2,3; }
# same steps, losses within a relative tolerance
close() {
  paste -d, <(losses "$1") <(losses "$2") | awk -F, -v tol="$3" '
    { n++; if ($1 != $3) bad = 1; d = $2 - $4; if (d < 0) d = -d; m = $4 < 0 ? -$4 : $4;
      if (d > tol * m) { bad = 1; printf "step %s: %s vs %s\n", $1, $2, $4 } }
    END { exit (n == 0 || bad) }'
}

"${mpi[@]}" "$exe" "$deck" "${common[@]}" --train.steps=6 --parallel.tp=2 --parallel.cp=2 \
  --run.output_dir="$work/tp2cp2" > "$work/tp2cp2.log" 2>&1 || fail "(tp2, cp2) run (see $work/tp2cp2.log)"
"$exe" "$deck" "${common[@]}" --train.steps=3 --run.output_dir="$work/r1" > "$work/r1.log" 2>&1 ||
  fail "1-rank run (see $work/r1.log)"
close "$work/r1/metrics.csv" <(losses "$work/tp2cp2/metrics.csv" | head -3 | sed 's/^/train,/') 2e-5 ||
  fail "(tp2, cp2) training losses differ from 1 rank's"
echo "(tp2, cp2) steps 1-3 equal the 1-rank run's losses within 2e-5"

ck=$work/tp2cp2/checkpoint_step00000003.h5
"${mpi[@]}" "$exe" "$deck" "${common[@]}" --train.steps=6 --parallel.dp=4 --checkpoint.resume="$ck" \
  --run.output_dir="$work/dp4" > "$work/dp4.log" 2>&1 || fail "dp4 resumed run (see $work/dp4.log)"
"$exe" "$deck" "${common[@]}" --train.steps=6 --checkpoint.resume="$ck" --run.output_dir="$work/r1resume" \
  > "$work/r1resume.log" 2>&1 || fail "1-rank resumed run (see $work/r1resume.log)"
diff <(losses "$work/dp4/metrics.csv") <(losses "$work/r1resume/metrics.csv") ||
  fail "resumed at dp4 and at 1 rank: the losses differ"
[ "$(losses "$work/dp4/metrics.csv" | wc -l)" = 3 ] || fail "the resumed runs should run steps 4-6"
close "$work/r1resume/metrics.csv" <(losses "$work/tp2cp2/metrics.csv" | tail -3 | sed 's/^/train,/') 2e-5 ||
  fail "the resumed runs differ from the (tp2, cp2) run's steps 4-6"
echo "the (tp2, cp2) step-3 checkpoint resumes at dp4 and at 1 rank with identical losses (and the (tp2, cp2) run's)"

if "${mpi[@]}" "$exe" "$deck" "${common[@]}" --train.steps=1 --parallel.tp=4 --run.output_dir="$work/bad" \
  > "$work/bad.log" 2>&1; then
  fail "tp = 4 with 2 groups was accepted"
fi
grep -q "ngroups = 2 .*tp = 4\|tp = 4.*ngroups = 2" "$work/bad.log" ||
  { grep error "$work/bad.log"; fail "the tp = 4 error does not name the values"; }
echo "tp = 4 with 2 groups rejected with its values named"

# layout = auto: the planner picks the layout for the ranks and prints it with its memory estimate, and the run trains
"${mpi[@]}" "$exe" "$deck" "${common[@]}" --train.steps=1 --parallel.layout=auto --parallel.gpu_memory_gb=80 \
  --run.output_dir="$work/auto" > "$work/auto.log" 2>&1 || fail "layout = auto run (see $work/auto.log)"
grep -q "^layout tp=[0-9]* cp=[0-9]* ep=[0-9]* dp=[0-9]*, micro-batch" "$work/auto.log" || fail "layout = auto printed no plan"
grep -q "total .* GB of 72.00 GB usable" "$work/auto.log" || fail "layout = auto printed no memory estimate"
[ "$(losses "$work/auto/metrics.csv" | wc -l)" = 1 ] || fail "the layout = auto run did not train"
echo "layout = auto: $(grep '^layout tp=' "$work/auto.log")"
