#!/usr/bin/env python3
"""Builds the peer's causal-conv1d CUDA extension (github:Dao-AILab/causal-conv1d) for sm_90 only, on the GPU machine.

  build_causal_conv1d.py --src DIR --build DIR --dest DIR

--src is an unpacked causal-conv1d source tree (csrc/, causal_conv1d/). The extension is compiled with PyTorch's
JIT loader under the module name its Python package imports, causal_conv1d_cuda, with the nvcc flags of the
repository's setup.py except that only sm_90 is built (and -lineinfo and ptxas verbosity are left out: they
do not change the code). --dest gets the .so and a copy of the causal_conv1d package, so that one folder on
sys.path (peers.py --causal-conv1d DEST) gives mamba_ssm its fused path. Ends with a check of causal_conv1d_fn
against torch's conv1d. Nothing here is the peer's code; it only drives the peer's build.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--dest", required=True)
    args = ap.parse_args()
    src = os.path.abspath(args.src)
    os.makedirs(args.build, exist_ok=True)
    os.makedirs(args.dest, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "4")

    from torch.utils.cpp_extension import load

    nvcc = ["-O3", "-gencode=arch=compute_90,code=sm_90",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
            "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math"]
    sources = [os.path.join(src, "csrc", f) for f in
               ("causal_conv1d.cpp", "causal_conv1d_fwd.cu", "causal_conv1d_bwd.cu", "causal_conv1d_update.cu")]
    t0 = time.time()
    mod = load(name="causal_conv1d_cuda", sources=sources, extra_cflags=["-O3"], extra_cuda_cflags=nvcc,
               extra_include_paths=[os.path.join(src, "csrc")], build_directory=os.path.abspath(args.build),
               verbose=True)
    print(f"built {mod.__file__} in {time.time() - t0:.0f} s", flush=True)
    shutil.copy2(mod.__file__, os.path.join(args.dest, "causal_conv1d_cuda.so"))
    shutil.copytree(os.path.join(src, "causal_conv1d"), os.path.join(args.dest, "causal_conv1d"), dirs_exist_ok=True)

    check = (
        "import sys; sys.path.insert(0, sys.argv[1]); import torch, torch.nn.functional as F\n"
        "import causal_conv1d_cuda; from causal_conv1d import causal_conv1d_fn\n"
        "torch.manual_seed(0); b, d, L, w = 2, 256, 1000, 4\n"
        "x = torch.randn(b, d, L, device='cuda', dtype=torch.bfloat16); wt = torch.randn(d, w, device='cuda') / 2\n"
        "bias = torch.randn(d, device='cuda')\n"
        "y = causal_conv1d_fn(x, wt.bfloat16(), bias.bfloat16(), activation='silu').float()\n"
        "r = F.silu(F.conv1d(x.float(), wt.bfloat16().float()[:, None, :], bias.bfloat16().float(), padding=w - 1,"
        " groups=d)[..., :L])\n"
        "err = (y - r).abs().max().item(); print('causal_conv1d_fn vs F.conv1d, bf16: max abs err', err)\n"
        "assert err < 0.1, err\n")
    subprocess.run([sys.executable, "-c", check, os.path.abspath(args.dest)], check=True)


if __name__ == "__main__":
    main()
