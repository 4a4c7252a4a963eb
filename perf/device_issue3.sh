#!/usr/bin/env bash
# One device call for issue 3 (us vs the peers), in priority order, each part under its own time limit so that
# one failing or slow part does not lose the others. Runs in the repository root on the GPU machine, with
# .kokkos-src/deps.tgz and .peers (mamba_ssm, causal-conv1d sources) carried.
#
#   perf/device_issue3.sh COMMIT [DEADLINE_S]      (DEADLINE_S: seconds the whole script may take, default 570)
#
# (a) builds causal-conv1d for sm_90 in the background (perf/build_causal_conv1d.py) and returns the .so as
#     $OUT/cc1d.so.gz.part-* (gzip, split to fit the 16 MiB-a-file limit);
# (c) meanwhile builds mambamoe and runs ctest on the GPU (perf/gpu_bench.sh --stages build,test);
# (e) our lm step (mambamoe_bench --only lm) while the peer's build may still run (GPU otherwise idle);
# (b) the peer's LM training steps on its fused path (peers.py --only lm), then (d) the Transformer (--only tfm).
# Logs go to /tmp/res, packed into $OUT/res.tgz after every part.
set -u
commit=${1:-unknown}
deadline=${2:-570}
t0=$SECONDS
R=/tmp/res
mkdir -p "$R"
left() { echo $((deadline - (SECONDS - t0))); }
lim() { local l; l=$(($(left) - ${2:-15})); ((l > $1)) && l=$1; echo $((l > 1 ? l : 1)); }
say() { echo "[$((SECONDS - t0)) s] $*" | tee -a "$R/timeline.txt"; }
pack() { tar czf "$OUT/res.tgz" -C /tmp res; }
export PYTHONUNBUFFERED=1

tar xzf .kokkos-src/deps.tgz -C / || { say "deps.tgz did not unpack"; exit 1; }
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)' \
  > "$R/versions.txt" 2>&1
nvcc --version | tail -2 >> "$R/versions.txt"
A=(--kokkos /tmp/pfx/kokkos --boost-po /tmp/pfx/libboost_program_options.a --htslib /tmp/pfx/hts --commit "$commit")

say "start: causal-conv1d build in the background"
(
  timeout "$(lim 450 60)" python3 perf/build_causal_conv1d.py --src .peers/causal-conv1d --build /tmp/cc1d_build \
    --dest .peers/cc1d > "$R/cc1d_build.log" 2>&1
  echo "exit $?" >> "$R/cc1d_build.log"
  if [[ -f .peers/cc1d/causal_conv1d_cuda.so ]]; then
    gzip -c .peers/cc1d/causal_conv1d_cuda.so | split -b 15M - "$OUT/cc1d.so.gz.part-"
    sha256sum .peers/cc1d/causal_conv1d_cuda.so > "$R/cc1d.sha256"
  fi
) &
cc=$!

say "start: our build + ctest"
timeout "$(lim 330 150)" bash perf/gpu_bench.sh "${A[@]}" --out "$R/ours" --stages build,test --test-timeout 200 \
  > "$R/ours_build_test.txt" 2>&1
say "our build + ctest: exit $?"
pack

ran_ours_lm=0
ours_lm() {
  timeout "$(lim 120 20)" bash perf/gpu_bench.sh "${A[@]}" --out "$R/ours_lm" --stages bench --bench-only lm \
    > "$R/ours_lm.txt" 2>&1
  say "our lm bench: exit $? (causal-conv1d build $(kill -0 $cc 2>/dev/null && echo still running || echo done))"
  ran_ours_lm=1
  pack
}
if kill -0 $cc 2>/dev/null && [[ -x build/cuda/perf/mambamoe_bench ]]; then ours_lm; fi

wait $cc
say "causal-conv1d: $(tail -1 "$R/cc1d_build.log")"
pack

mkdir -p "$R/peers_lm"
cc1d=()
[[ -f .peers/cc1d/causal_conv1d_cuda.so ]] && cc1d=(--causal-conv1d "$PWD/.peers/cc1d")
timeout "$(lim 200 40)" python3 perf/peers.py --mamba-ssm "$PWD/.peers" "${cc1d[@]}" --out "$R/peers_lm" --only lm \
  > "$R/peers_lm.log" 2>&1
say "peers lm: exit $?"
pack
mkdir -p "$R/peers_tfm"
timeout "$(lim 90 10)" python3 perf/peers.py --mamba-ssm "$PWD/.peers" --out "$R/peers_tfm" --only tfm \
  > "$R/peers_tfm.log" 2>&1
say "peers tfm: exit $?"
pack
if ((ran_ours_lm == 0)) && [[ -x build/cuda/perf/mambamoe_bench ]] && (($(left) > 60)); then ours_lm; fi
say "done"
pack
