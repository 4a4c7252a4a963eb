#!/usr/bin/env bash
# One run on a GPU machine: build the project with the cuda preset, run the test suite on the GPU, then time our
# kernels (perf/bench.cpp) and the peers (perf/peers.py) on the same shapes, in the same run. Builds nothing but
# this project: Kokkos (CUDA), Boost.Program_options, htslib and the peers are given by path.
#
#   perf/gpu_bench.sh --kokkos PREFIX --out DIR --mamba-ssm DIR [--causal-conv1d DIR] [--boost-po LIB]
#                     [--htslib PREFIX] [--stages build,test,bench,long,131k,cp,ecoli] [--test-timeout S]
#                     [--test-regex RE]   (test stage: only the ctest tests whose names match RE)
#                     [--test-jobs N]     (test stage: ctest -j N, default 4; the whole suite ran in 104 s at
#                                         -j 8 on one H200 machine's 16 cores)
#                     [--build-targets T1,T2]   (build stage: only these targets, e.g. unit_tests,mambamoe_bench;
#                                               their dependencies come with them; the regression tests need the
#                                               mambamoe driver, so pair it with --test-regex "unit_tests|mpi_tests")
#                     [--peer-timeout S]  (stop the peers' run after S seconds; peers.log keeps what it measured)
#                     [--bench-only LIST]
#                     [--commit HASH]   (the commit to print, where the copy on the GPU machine has no usable .git)
#                     [--peer-args "ARGS"]    (passed to perf/peers.py, e.g. "--ssd-dtypes bf16")
#                     [--bench-args "ARGS"]   (passed to mambamoe_bench, e.g. "--ssd gemm-tf32,portable --lm-ssd gemm-bf16")
#                     [--bench-rounds N]      (bench stage: ours then the peers, N times in turn, default 1; rounds
#                                             after the first under DIR/round_I; every "time" row of every round, in
#                                             run order, in DIR/rounds.txt: a peer that reads slow in one round is
#                                             seen against its others, and the medians compared; the peers'
#                                             first round on a fresh machine includes Triton's compilation, over
#                                             150 s for the LM at 4 x 8,192 on an H200: give --peer-timeout room.
#                                             --peer-args "--step-reps N" times N training steps a round, and the
#                                             peers' "time min" / "time max" rows show their spread)
#                     [--cp-args "ARGS"]      (passed to the cp stage's three runs, e.g. "--profile")
#                     [--runs NAME1,NAME2]    (stages dp and scale: only these runs, e.g. moe_1gpu,moe_ep2)
#                     [--ab-patch FILE] [--ab-runs N]   (stage ab, below)
#
# --mamba-ssm DIR is the folder that holds the mamba_ssm package (e.g. $PWD/.peers); --causal-conv1d DIR holds the
# built causal_conv1d_cuda*.so and the causal_conv1d package (built by the user beforehand, e.g. in the same device
# command with torch's cpp_extension.load; never by this script), without which the peer's LM runs its unfused path. --bench-only also takes tfm (a PyTorch Transformer, peers only), mamba1 (our
# Mamba-1 selective scan against the copy bandwidth, ours only), mamba3 (the Mamba-3 SISO block, both) and moe
# (the issue-5 MoE layer and its expert GEMM rate; the peer on torch._grouped_mm).
# --stages long: the LM step on one 1,048,576-token sequence with the Mamba-2 layers in windows of 131,072 tokens.
# --stages 131k: the LM step at batch 1 x 131,072 (issue 3: 1.5x the peer's tokens/s at half its memory) with the
#   Mamba-2 layers in windows of 32,768 tokens, the fused SSD and bf16 GEMMs (fused-bf16), the backbone's
#   activations recomputed (mixer) and kept (none): the planner's dry run (`--parallel.plan_gpus=1`) puts them at
#   19.0 and 28.3 GB against the peer's 48.1 GiB. The peer's own 131k step: the bench stage with --bench-only lm and
#   --peer-args "--lm-shapes 1x131072" (its fused path needs --causal-conv1d).
# --stages ab (with --ab-patch FILE, a patch that the tree holds, as `git diff -- src` writes it; not of this
#   script): mambamoe_bench built
#   from the tree as it is ("with") and with FILE reversed ("without"; the tree is restored afterwards, also when a
#   build fails), then --ab-runs N (default 2) alternating runs of the two with --bench-only and --bench-args, so a
#   change is timed against its absence on one machine; writes ab_build.log, ab_with_I.log, ab_without_I.log and
#   ab.txt (every "time" line of the runs, in run order). It builds in build/cuda as the build stage left it: give
#   --stages build,ab on a fresh machine.
# --stages ecoli: inputs/genomics/ecoli.in as committed (needs data/ecoli_mg1655.fa.gz: scripts/fetch_data.sh ecoli),
#   metrics under DIR/ecoli; it prints the held-out bits/base against the order-6 Markov baseline (1.934).
# --stages cp (2 GPUs): the LM step at 131,072 tokens on one GPU against cp = 2 at 262,144 tokens over two.
# --stages dp (2 GPUs; needs data/ecoli_mg1655.fa.gz): training steps of the 24-layer d_model 768 Mamba-2 LM through
#   the driver on one GPU (one micro-batch per step) and at dp = 2 (two, one per GPU), with the gradient exchange
#   overlapped with the backward and after it, at 2,048 and 8,192 tokens per micro-batch.
# --stages scale (2 GPUs; same data): issue 8's runs 2 and 3 at one and two GPUs: the MoE-Mamba model (M2 E x 12,
#   8 experts, d_ff 2,048, top-1) at ep = 1 / ep = 2 / dp = 2, and the d_model 2,048 Mamba-2 model at tp = 1 / 2.
#   Both stages take tokens/s from the metrics file's last train row (steps 5-8, after the warm-up steps) and the
#   peak device memory from nvidia-smi sampled every 100 ms (it includes the CUDA context); scale.csv / dp.csv.
# Writes under DIR: build.log, ctest.log, ours.csv, peers.csv, bench.log, and summary.txt (the table, also printed).
set -uo pipefail

commit="" kokkos="" out="" mamba="" cc1d="" po="" hts="" stages="build,test,bench" test_timeout=300 test_regex='' test_jobs=4 peer_timeout=0 build_targets='' bench_only="copy,gemm,ssd,lm" bench_args="" peer_args="" cp_args="" runs="" ab_patch="" ab_runs=2 bench_rounds=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kokkos) kokkos=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --mamba-ssm) mamba=$2; shift 2 ;;
    --causal-conv1d) cc1d=$2; shift 2 ;;
    --boost-po) po=$2; shift 2 ;;
    --htslib) hts=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --test-timeout) test_timeout=$2; shift 2 ;;
    --test-regex) test_regex=$2; shift 2 ;;
    --test-jobs) test_jobs=$2; shift 2 ;;
    --peer-timeout) peer_timeout=$2; shift 2 ;;
    --build-targets) build_targets=$2; shift 2 ;;
    --bench-only) bench_only=$2; shift 2 ;;
    --commit) commit=$2; shift 2 ;;
    --bench-args) bench_args=$2; shift 2 ;;
    --peer-args) peer_args=$2; shift 2 ;;
    --cp-args) cp_args=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --ab-patch) ab_patch=$2; shift 2 ;;
    --ab-runs) ab_runs=$2; shift 2 ;;
    --bench-rounds) bench_rounds=$2; shift 2 ;;
    *) echo "gpu_bench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n $kokkos && -n $out ]] || { echo "gpu_bench.sh: --kokkos and --out are required" >&2; exit 2; }
[[ $test_jobs =~ ^[1-9][0-9]*$ ]] || { echo "gpu_bench.sh: --test-jobs must be a positive integer (got '$test_jobs')" >&2; exit 2; }
[[ $ab_runs =~ ^[1-9][0-9]*$ ]] || { echo "gpu_bench.sh: --ab-runs must be a positive integer (got '$ab_runs')" >&2; exit 2; }
[[ $bench_rounds =~ ^[1-9][0-9]*$ ]] ||
  { echo "gpu_bench.sh: --bench-rounds must be a positive integer (got '$bench_rounds')" >&2; exit 2; }
if [[ ",$stages," == *",ab,"* ]]; then
  [[ -n $ab_patch && -f $ab_patch ]] || { echo "gpu_bench.sh: --stages ab needs --ab-patch FILE (got '$ab_patch')" >&2; exit 2; }
  ab_patch=$(cd "$(dirname "$ab_patch")" && pwd)/$(basename "$ab_patch")
  ! grep -q '^+++ b/perf/gpu_bench.sh' "$ab_patch" ||
    { echo "gpu_bench.sh: $ab_patch changes perf/gpu_bench.sh, which is running; leave it out of the patch" >&2; exit 2; }
fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
has() { [[ ",$stages," == *",$1,"* ]]; }
rc=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
[[ -n $commit ]] || commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $commit on $(head -2 "$out/gpu.txt" | tail -1)"

if has build; then
  t0=$SECONDS
  extra=()
  [[ -n $po ]] && extra+=("-DMAMBAMOE_BOOST_PO_LIBRARY=$po")
  [[ -n $hts ]] && extra+=("-DMAMBAMOE_HTSLIB_ROOT=$hts")
  (cd "$root" && cmake --preset cuda -DKokkos_ROOT="$kokkos" "${extra[@]}" && \
    cmake --build build/cuda -j"$(nproc)" ${build_targets:+--target ${build_targets//,/ }}) > "$out/build.log" 2>&1 || \
    { tail -30 "$out/build.log"; exit 1; }
  cp "$root/build/cuda/.ninja_log" "$out/ninja_log.txt" 2>/dev/null
  echo "build: $((SECONDS - t0)) s"
fi

if has test; then
  t0=$SECONDS
  (cd "$root/build/cuda" && ctest --output-on-failure -j "$test_jobs" --timeout "$test_timeout" ${test_regex:+-R "$test_regex"}) > "$out/ctest.log" 2>&1 || rc=1
  grep -E "tests passed|\(Failed\)|\(Timeout\)|Exception|\*\*\*Failed" "$out/ctest.log" | tail -20
  echo "tests: $((SECONDS - t0)) s"
fi

if has bench; then
  [[ $bench_rounds -gt 1 ]] && : > "$out/rounds.txt"
  for ((round = 1; round <= bench_rounds; ++round)); do
    d=$out
    [[ $round -gt 1 ]] && { d=$out/round_$round; mkdir -p "$d"; }
    "$root/build/cuda/perf/mambamoe_bench" --out "$d" --only "$bench_only" $bench_args > "$d/bench.log" 2>&1 ||
      { tail -20 "$d/bench.log"; rc=1; }
    if [[ -n $mamba ]]; then
      timeout "$peer_timeout" python3 "$root/perf/peers.py" --mamba-ssm "$mamba" ${cc1d:+--causal-conv1d "$cc1d"} \
        --out "$d" --only "$bench_only" $peer_args > "$d/peers.log" 2>&1 || { tail -20 "$d/peers.log"; rc=1; }
    fi
    if [[ $bench_rounds -gt 1 ]]; then
      grep -hE "[[:space:]]time[[:space:]]" "$d/bench.log" "$d/peers.log" 2>/dev/null | sed "s/^/round $round:/" \
        >> "$out/rounds.txt"
    fi
  done
  [[ $bench_rounds -gt 1 ]] && { echo "every round's time rows (DIR/rounds.txt):"; cat "$out/rounds.txt"; }
  { echo "commit $commit, $(date -u +%F), $(head -2 "$out/gpu.txt" | tail -1)"; cat "$out/bench.log"; cat "$out/peers.log" 2>/dev/null; } \
    | tee "$out/summary.txt"
fi

# The benchmark with and without a change, alternating on this machine (see --stages ab above).
if has ab; then
  t0=$SECONDS
  bin="$root/build/cuda/perf/mambamoe_bench"
  (cd "$root" && patch -p1 -R --dry-run < "$ab_patch") > "$out/ab_build.log" 2>&1 ||
    { echo "gpu_bench.sh: $ab_patch does not reverse-apply to the tree (ab_build.log)" >&2; exit 2; }
  tmp=$(mktemp -d)
  ab_build() { cmake --build "$root/build/cuda" -j"$(nproc)" --target mambamoe_bench >> "$out/ab_build.log" 2>&1; }
  if ab_build && cp "$bin" "$tmp/with" && (cd "$root" && patch -p1 -R < "$ab_patch") >> "$out/ab_build.log" 2>&1; then
    ab_build && cp "$bin" "$tmp/without"
    built=$?
    (cd "$root" && patch -p1 < "$ab_patch") >> "$out/ab_build.log" 2>&1 ||
      { echo "gpu_bench.sh: could not re-apply $ab_patch: the tree is left without it" >&2; exit 1; }
  else
    built=1
  fi
  [[ $built == 0 ]] || { tail -30 "$out/ab_build.log"; rm -rf "$tmp"; exit 1; }
  for i in $(seq 1 "$ab_runs"); do
    for v in with without; do
      "$tmp/$v" --out "$tmp/o_${v}_$i" --only "$bench_only" $bench_args > "$out/ab_${v}_$i.log" 2>&1 || rc=1
    done
  done
  for i in $(seq 1 "$ab_runs"); do
    for v in with without; do grep -E " time " "$out/ab_${v}_$i.log" | sed "s/^/$v, run $i:/"; done
  done | tee "$out/ab.txt"
  rm -rf "$tmp"
  echo "ab: $((SECONDS - t0)) s"
fi

# One 1,048,576-token sequence on one GPU (issue 3): the LM step with the Mamba-2 layers in windows of 131,072
# tokens (model.mixer_window), tf32 GEMMs.
if has long; then
  "$root/build/cuda/perf/mambamoe_bench" --out "$out" --only lm --lm-batch 1 --lm-seqlen 1048576 --lm-window 131072 \
    --lm-ssd gemm-tf32 --reps 3 > "$out/long.log" 2>&1 || rc=1
  mv "$out/ours.csv" "$out/long.csv" 2>/dev/null
  grep "lm train" "$out/long.log" || tail -20 "$out/long.log"
fi

# Batch 1 x 131,072 tokens with the mixers in windows of 32,768 (the layer working memory follows the window).
if has 131k; then
  "$root/build/cuda/perf/mambamoe_bench" --out "$out" --only lm --lm-batch 1 --lm-seqlen 131072 --lm-window 32768 \
    --lm-ssd fused-bf16 --lm-recompute mixer,none --reps 3 > "$out/131k.log" 2>&1 || rc=1
  mv "$out/ours.csv" "$out/131k.csv" 2>/dev/null
  grep "lm train" "$out/131k.log" || tail -20 "$out/131k.log"
fi

# The E. coli DNA language model on the GPU (issue 3): the committed deck, its held-out bits/base at the end.
if has ecoli; then
  t0=$SECONDS
  (cd "$root" && build/cuda/physics_style_drivers/mambamoe inputs/genomics/ecoli.in --run.output_dir="$out/ecoli" \
    --train.time_limit_minutes=4) > "$out/ecoli.log" 2>&1 || rc=1
  grep -iE "result|eval|error" "$out/ecoli.log" | tail -8
  echo "ecoli: $((SECONDS - t0)) s"
fi

# Context-parallel weak scaling on 2 GPUs (issue 6): the LM step on one GPU at 131,072 tokens, then cp = 2 over two
# GPUs at 262,144 tokens (one sequence) and at 32,768 tokens (the state-passing bytes per layer must not change).
# One SSD variant (fused-tf32, the LM's fastest measured), so that each csv holds one throughput row.
if has cp; then
  b="$root/build/cuda/perf/mambamoe_bench"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpi=(mpirun -np 2 --bind-to none -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM)
  b=("$b" --lm-ssd fused-tf32 $cp_args)
  { "${b[@]}" --out "$out" --only lm --lm-batch 1 --lm-seqlen 131072 --reps 3 && mv "$out/ours.csv" "$out/cp1.csv"
    "${mpi[@]}" "${b[@]}" --out "$out" --only lm --lm-batch 1 --lm-seqlen 262144 --reps 3 --cp 2 --backend nccl \
      --kokkos-map-device-id-by=mpi_rank && mv "$out/ours.csv" "$out/cp2.csv"
    "${mpi[@]}" "${b[@]}" --out "$out" --only lm --lm-batch 1 --lm-seqlen 32768 --reps 3 --cp 2 --backend nccl \
      --kokkos-map-device-id-by=mpi_rank && mv "$out/ours.csv" "$out/cp2_32k.csv"; } > "$out/cp.log" 2>&1 || rc=1
  grep -E "throughput|memory|cp bytes|error" "$out/cp.log"
  # (the csv's first field is a quoted name with commas in it: read it as csv)
  python3 - "$out/cp1.csv" "$out/cp2.csv" <<'PY' || rc=1
import csv, sys
t = [next(float(r["value"]) for r in csv.DictReader(open(f)) if r["metric"] == "throughput") for f in sys.argv[1:]]
print(f"cp=2 at 262,144 tokens / 1 GPU at 131,072: {t[1] / t[0]:.3f}x tokens/s")
PY
fi
# Training runs through the driver (stages dp and scale): run_driver NAME RANKS ARGS... appends NAME, ranks,
# tokens/s, peak MiB to $out/$csv and keeps the log and metrics under $out/runs/NAME.
run_driver() {
  local name=$1 np=$2; shift 2
  [[ -z $runs || ",$runs," == *",$name,"* ]] || return 0
  local dir="$out/runs/$name" cmd=("$root/build/cuda/physics_style_drivers/mambamoe")
  mkdir -p "$dir"
  if [[ $np -gt 1 ]]; then
    cmd=(mpirun -np "$np" --bind-to none -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "${cmd[@]}")
    set -- "$@" --parallel.backend=nccl --kokkos-map-device-id-by=mpi_rank
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$dir/mem.txt" 2>/dev/null &
  local smi=$!
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "${cmd[@]}" "$root/inputs/genomics/ecoli.in" \
    --run.output_dir="$dir" --train.steps=8 --train.log_interval=4 --train.warmup_steps=2 --train.eval_interval=0 \
    --data.holdout_fraction=0.01 --train.time_limit_minutes=0 --checkpoint.path= "$@" > "$dir/log.txt" 2>&1 || rc=1
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  local tps peak
  tps=$(awk -F, '$1 == "train" { t = $7 } END { print t }' "$dir/metrics.csv" 2>/dev/null)
  peak=$(sort -n "$dir/mem.txt" 2>/dev/null | tail -1)
  echo "$name,$np,${tps:-NA},${peak:-NA}" | tee -a "$out/$csv"
  grep -E "error|imbalance|layout|parameters" "$dir/log.txt" | head -12
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if has dp; then
  csv=dp.csv; echo "run,ranks,tokens_per_s,peak_mib" > "$out/$csv"
  lm=(--model.d_model=768 --model.n_layer=24 --model.d_state=128 --model.headdim=64 --model.expand=2
      --model.chunk_size=256 --train.batch_size=1)
  for L in 2048 8192; do
    run_driver "lm${L}_1gpu" 1 "${lm[@]}" --train.seq_len=$L --train.grad_accum=1
    run_driver "lm${L}_dp2_after" 2 "${lm[@]}" --train.seq_len=$L --train.grad_accum=2 --parallel.overlap_grad_reduce=false
    run_driver "lm${L}_dp2_overlap" 2 "${lm[@]}" --train.seq_len=$L --train.grad_accum=2 --parallel.overlap_grad_reduce=true
  done
fi
if has scale; then
  csv=scale.csv; echo "run,ranks,tokens_per_s,peak_mib" > "$out/$csv"
  moe=(--model.d_model=768 --model.n_layer=24 --model.d_state=128 --model.headdim=64 --model.chunk_size=256
       "--model.pattern=$(printf 'M2 E %.0s' {1..12})" --moe.n_experts=8 --moe.top_k=1 --moe.d_ff=2048
       --train.seq_len=8192 --train.batch_size=1 --train.grad_accum=4)
  run_driver moe_1gpu 1 "${moe[@]}"
  run_driver moe_ep2 2 "${moe[@]}" --parallel.ep=2
  run_driver moe_dp2 2 "${moe[@]}" --parallel.dp=2
  wide=(--model.d_model=2048 --model.n_layer=24 --model.d_state=128 --model.headdim=64 --model.ngroups=8
        --model.chunk_size=256 --train.seq_len=8192 --train.batch_size=1 --train.grad_accum=1 --train.recompute=mixer)
  run_driver wide_tp1 1 "${wide[@]}"
  run_driver wide_tp2 2 "${wide[@]}" --parallel.tp=2
fi
exit $rc
