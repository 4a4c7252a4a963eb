#!/usr/bin/env python3
"""Times the peers on the shapes of mambamoe_bench, in the same run on the same GPU.

  peers.py --mamba-ssm DIR [--causal-conv1d DIR] --out DIR [--only copy,gemm,ssd,lm]

DIR for --mamba-ssm is a folder holding the mamba_ssm package (github:state-spaces/mamba); --causal-conv1d is a
folder holding the built causal_conv1d extension. Nothing is built here. Rows "name,metric,value,unit" go to
OUT/peers.csv. Medians from triton.testing.do_bench (CUDA events), random inputs.
"""
import argparse
import csv
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mamba-ssm", required=True)
    ap.add_argument("--causal-conv1d", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="copy,gemm,ssd")
    args = ap.parse_args()
    want = set(args.only.split(","))
    sys.path.insert(0, args.mamba_ssm)
    if args.causal_conv1d:
        sys.path.insert(0, args.causal_conv1d)

    import torch
    import triton

    rows = []

    def record(name, metric, value, unit):
        rows.append((name, metric, value, unit))
        print(f"  {name:<40} {metric:<22} {value:14.4g} {unit}", flush=True)

    def bench(fn, ms=2000):
        return triton.testing.do_bench(fn, warmup=200, rep=ms, return_mode="median") * 1e-3

    dev = torch.device("cuda")
    print(f"peers on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")

    if "copy" in want:
        a = torch.rand(1 << 29, device=dev)
        b = torch.empty_like(a)
        t = bench(lambda: b.copy_(a))
        record("copy (torch copy_, fp32)", "bandwidth", 2 * a.numel() * 4 / t / 1e12, "TB/s")
        del a, b

    if "gemm" in want:
        for dt, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            m = 8192
            A = torch.randn(m, m, device=dev, dtype=dt)
            B = torch.randn(m, m, device=dev, dtype=dt)
            t = bench(lambda: A @ B)
            record(f"torch.matmul {label} 8192^3", "rate", 2 * m ** 3 / t / 1e12, "TFLOP/s")
            del A, B

    if "ssd" in want:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        bsz, L, H, P, N, Q = 1, 65536, 24, 64, 128, 256
        torch.manual_seed(0)
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            x = torch.randn(bsz, L, H, P, device=dev, dtype=dtype, requires_grad=True)
            dt = (torch.rand(bsz, L, H, device=dev) * 3 - 3).to(dtype).requires_grad_()
            A = (-torch.exp(torch.rand(H, device=dev) * 2.7)).requires_grad_()
            Bm = torch.randn(bsz, L, 1, N, device=dev, dtype=dtype, requires_grad=True)
            Cm = torch.randn(bsz, L, 1, N, device=dev, dtype=dtype, requires_grad=True)
            D = torch.randn(H, device=dev, requires_grad=True)
            dt_bias = (torch.rand(H, device=dev) * 2 - 4).requires_grad_()
            dy = torch.randn(bsz, L, H, P, device=dev, dtype=dtype)

            def fwd():
                return mamba_chunk_scan_combined(x, dt, A, Bm, Cm, Q, D=D, dt_bias=dt_bias, dt_softplus=True)

            def fwd_bwd():
                y = fwd()
                torch.autograd.backward(y, dy, inputs=[x, dt, A, Bm, Cm, D, dt_bias])

            name = f"mamba_chunk_scan_combined {label} L=65536"
            with torch.no_grad():
                record(name, "fwd time", bench(fwd) * 1e3, "ms")
            record(name, "fwd+bwd time", bench(fwd_bwd) * 1e3, "ms")
            del x, dt, Bm, Cm, dy

    with open(os.path.join(args.out, "peers.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "metric", "value", "unit"])
        w.writerows(rows)


if __name__ == "__main__":
    main()
