#!/usr/bin/env bash
# Bad input through the real executable: every case must exit non-zero with a message that names the file, line
# or key at fault. usage: cli_errors.sh <mambamoe> <source dir> <scratch dir>
set -uo pipefail
exe=$1 src=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
lambda_deck=$src/inputs/genomics/lambda.in
fails=0

# expect <name> <substring>... -- <command...>: the command fails and its stderr contains every substring
expect() {
  local name=$1
  shift
  local subs=()
  while [[ $1 != -- ]]; do subs+=("$1"); shift; done
  shift
  local out rc
  out=$("$@" 2>&1 >/dev/null)
  rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "FAIL $name: exit status 0"
    fails=$((fails + 1))
    return
  fi
  for s in "${subs[@]}"; do
    if [[ $out != *"$s"* ]]; then
      echo "FAIL $name: message lacks '$s': $out"
      fails=$((fails + 1))
      return
    fi
  done
  echo "ok   $name (exit $rc): $out"
}

run() { "$exe" "$@" --run.output_dir="$work/out" --train.steps=2 --train.log_interval=0; }

printf '[run]\ndriver = genomics_lm\n[train]\nsteps = 2\nbogus_key = 1\n' > "$work/unknown_key.in"
expect "unknown deck key" "$work/unknown_key.in:5" "unknown key 'bogus_key'" "valid keys:" -- run "$work/unknown_key.in"

expect "unknown driver" "unknown driver 'nope'" "known drivers: genomics_lm" -- run "$lambda_deck" --run.driver=nope

expect "unknown override" "unknown key 'stepz'" -- run "$lambda_deck" --train.stepz=3

expect "bad value" "train.batch_size" "not an integer" -- run "$lambda_deck" --train.batch_size=many

expect "missing deck" "$work/absent.in" "cannot open" -- run "$work/absent.in"

expect "missing FASTA" "$work/absent.fa" "does not exist" -- run "$lambda_deck" --data.fasta="$work/absent.fa"

printf 'ACGT\n>r1\nACGT\n' > "$work/headerless.fa"
expect "malformed FASTA" "$work/headerless.fa:1" "before the first '>'" -- run "$lambda_deck" --data.fasta="$work/headerless.fa"

printf '>r1\nACGTX!\n' > "$work/badchar.fa"
expect "invalid FASTA character" "$work/badchar.fa:2" "invalid character" -- run "$lambda_deck" --data.fasta="$work/badchar.fa"

: > "$work/empty.fa"
expect "empty FASTA" "$work/empty.fa" "empty" -- run "$lambda_deck" --data.fasta="$work/empty.fa"

expect "shapes that do not divide" "headdim = 48" "not divisible" -- run "$lambda_deck" --model.headdim=48

expect "unknown SSD algorithm" "model.ssd_algorithm" "'fast'" "auto, portable, gemm" -- \
  run "$lambda_deck" --model.ssd_algorithm=fast
expect "unknown GEMM precision" "gemm_precision" "'fp16'" "fp32, tf32, bf16" -- run "$lambda_deck" --run.gemm_precision=fp16
expect "negative mixer window" "window" "-3" -- run "$lambda_deck" --model.mixer_window=-3

expect "heads not divisible by groups" "ngroups = 3" "not divisible" -- run "$lambda_deck" --model.ngroups=3

# A real checkpoint, then truncated to half its size.
"$exe" "$lambda_deck" --run.output_dir="$work/ckpt" --train.steps=1 --train.log_interval=0 >/dev/null 2>&1 ||
  { echo "FAIL could not write a checkpoint"; fails=$((fails + 1)); }
ck=$work/ckpt/truncated.h5
if [[ -f $work/ckpt/checkpoint.h5 ]]; then
  cp "$work/ckpt/checkpoint.h5" "$ck"
  truncate -s $(($(stat -c %s "$ck") / 2)) "$ck"
  expect "truncated checkpoint" "$ck" -- run "$lambda_deck" --checkpoint.resume="$ck"
fi
expect "missing checkpoint" "$work/none.h5" -- run "$lambda_deck" --checkpoint.resume="$work/none.h5"

expect "resume into another shape" "params/backbone.embedding.weight" "expected" -- \
  run "$lambda_deck" --checkpoint.resume="$work/ckpt/checkpoint.h5" --model.d_model=32

expect "plan for a GPU count the layout does not divide" "plan_gpus" "3 GPUs do not divide by tp * cp * ep = 2" -- \
  run "$lambda_deck" --parallel.cp=2 --parallel.plan_gpus=3

# The planner's dry run (not an error): it prints the layout and memory for 4 GPUs on one rank and exits 0 before
# reading any data (the FASTA path does not exist).
plan=$("$exe" "$lambda_deck" --data.fasta="$work/absent.fa" --train.seq_len=1024 --parallel.cp=4 \
  --parallel.plan_gpus=4 2>&1)
if [[ $? -ne 0 || $plan != *"plan for 4 GPUs"* || $plan != *"layout tp=1 cp=4 ep=1 dp=1"* ||
      $plan != *"memory per GPU"* ]]; then
  echo "FAIL planner dry run: $plan"
  fails=$((fails + 1))
else
  echo "ok   planner dry run: $(grep "^layout tp" <<< "$plan")"
fi

if [[ $fails -gt 0 ]]; then
  echo "$fails case(s) failed"
  exit 1
fi
echo "all bad-input cases give clear errors"
