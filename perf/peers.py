#!/usr/bin/env python3
"""Times the peers on the shapes of mambamoe_bench, in the same run on the same GPU.

  peers.py --mamba-ssm DIR [--causal-conv1d DIR] --out DIR [--only copy,gemm,ssd,mamba3,moe,lm,tfm]

DIR for --mamba-ssm is a folder holding the mamba_ssm package (github:state-spaces/mamba), e.g. .peers, not
.peers/mamba_ssm; --causal-conv1d is a folder holding both the built extension causal_conv1d_cuda*.so and the
causal_conv1d Python package (built beforehand by the user; see perf/README.md). Nothing is built here. Rows
"name,metric,value,unit" go to OUT/peers.csv. Kernels: medians from triton.testing.do_bench (CUDA events);
training steps (lm, tfm): median of per-step CUDA-event times after warm-up steps. Random inputs.

  lm:  mamba_ssm MambaLMHeadModel, the issue-3 LM (24 Mamba-2 layers, d_model 768, d_state 128, headdim 64,
       expand 2, vocab 16, chunk 256), fp32 parameters under bf16 autocast, fused AdamW, one training step =
       forward, cross-entropy, backward, optimizer step; batch 4 x 8192, 1 x 131072, 1 x 262144 (--lm-shapes).
  mamba3: mamba_ssm's Mamba3 module, SISO (Triton mamba3_siso_combined), d_model 768, d_state 128, headdim 64,
       expand 2, chunk 64, forward and forward + backward at batch 8 x 8192 (issue 4).
  moe: the issue-5 MoE layer (65,536 tokens, d_model 768, 8 SwiGLU experts of 2,048, top-1 and top-2) in PyTorch
       on torch._grouped_mm, bf16, forward and forward + backward, and its expert GEMM against a dense one.
  tfm: a PyTorch Transformer of about the same size (12 layers, d_model 768, 12 heads, MLP 4x GELU, RMSNorm,
       RoPE, causal F.scaled_dot_product_attention), same precision and optimizer, batch 4 x 8192.
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
    ap.add_argument("--ssd-dtypes", default="bf16,fp32",
                    help="dtypes of the mamba_chunk_scan_combined timings (fp32 autotunes for minutes)")
    ap.add_argument("--mamba3-params", default="fp32,bf16",
                    help="mamba3: the block's parameter types (fp32: under bf16 autocast, as the LM; bf16)")
    ap.add_argument("--lm-shapes", default="4x8192,1x131072,1x262144",
                    help="batch x length of the LM training steps timed (comma separated)")
    ap.add_argument("--step-reps", type=int, default=8,
                    help="lm, tfm: training steps timed (after 3 warm-up steps); the median is reported")
    args = ap.parse_args()
    if args.step_reps < 1:
        ap.error(f"--step-reps must be at least 1 (got {args.step_reps})")
    lm_shapes = [tuple(int(v) for v in w.split("x")) for w in args.lm_shapes.split(",") if w]
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
            if label not in args.ssd_dtypes.split(","):
                continue
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

    if "mamba3" in want:
        # issue 4's peer: mamba_ssm's Mamba-3 SISO block (Triton mamba3_siso_combined), d_model 768, d_state 128,
        # headdim 64, expand 2, chunk 64, batch 8 x 8192; fp32 parameters under bf16 autocast (as the LM), and the
        # block in bf16 parameters too
        from mamba_ssm.modules.mamba3 import Mamba3

        torch.manual_seed(0)
        kinds = {"fp32": (torch.float32, "fp32 params, bf16 autocast"), "bf16": (torch.bfloat16, "bf16 params")}
        for pdtype, label in (kinds[k] for k in args.mamba3_params.split(",")):
            blk = Mamba3(d_model=768, d_state=128, headdim=64, expand=2, chunk_size=64, is_mimo=False,
                         device=dev, dtype=pdtype)
            u = torch.randn(8, 8192, 768, device=dev, dtype=pdtype, requires_grad=True)
            g = torch.randn_like(u)

            def fwd():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=pdtype == torch.float32):
                    return blk(u)

            def fwd_bwd():
                out = fwd()
                out.backward(g)

            name = f"mamba_ssm Mamba3 SISO block 8x8192 ({label})"
            record(name, "fwd time", bench(fwd) * 1e3, "ms")
            torch.cuda.reset_peak_memory_stats()
            record(name, "fwd+bwd time", bench(fwd_bwd) * 1e3, "ms")
            record(name, "peak memory allocated", torch.cuda.max_memory_allocated() / 2**30, "GiB")
            del blk, u, g
            torch.cuda.empty_cache()

    if "moe" in want:
        # issue 5's peer: the same MoE layer in PyTorch on torch._grouped_mm, bf16: 65,536 tokens, d_model 768,
        # 8 SwiGLU experts of d_ff 2,048, softmax router with fp32 logits, top-1 and top-2, dropless; tokens sorted
        # by expert into groups padded to multiples of 16 rows (as torchtitan does for _grouped_mm), combined with
        # index_add; forward and forward + backward (autograd); then the expert GEMM alone, grouped (8 equal
        # groups) against one dense bf16 GEMM of the same total size
        import torch.nn.functional as F

        T_, D_, E_, FF = 65536, 768, 8, 2048
        torch.manual_seed(0)
        bf = torch.bfloat16
        x = torch.randn(T_, D_, device=dev, dtype=bf, requires_grad=True)
        gx = torch.randn_like(x)
        wr = (torch.randn(E_, D_, device=dev) / D_ ** 0.5).requires_grad_()
        w1 = (torch.randn(E_, FF, D_, device=dev, dtype=bf) / D_ ** 0.5).requires_grad_()
        w3 = (torch.randn(E_, FF, D_, device=dev, dtype=bf) / D_ ** 0.5).requires_grad_()
        w2 = (torch.randn(E_, D_, FF, device=dev, dtype=bf) / FF ** 0.5).requires_grad_()
        params = [x, wr, w1, w3, w2]

        def moe(k):
            probs = (x.float() @ wr.t()).softmax(-1)
            gate, idx = probs.topk(k, dim=-1)
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            tok = order // k
            counts = torch.bincount(flat, minlength=E_)
            padded = (counts + 15) // 16 * 16
            start, start_p = counts.cumsum(0) - counts, padded.cumsum(0) - padded
            e_sorted = flat[order]
            dest = torch.arange(flat.numel(), device=dev) - start[e_sorted] + start_p[e_sorted]
            offs = padded.cumsum(0).to(torch.int32)
            xp = x.new_zeros(int(padded.sum().item()), D_).index_copy(0, dest, x[tok])
            h = F.silu(torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)) * \
                torch._grouped_mm(xp, w3.transpose(-2, -1), offs=offs)
            y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[dest]
            wgt = gate.reshape(-1)[order].to(bf).unsqueeze(1)
            return torch.zeros_like(x).index_add(0, tok, y * wgt)

        for k in (1, 2):
            name = f"torch._grouped_mm MoE layer {T_} tok d768 ff2048 E8 top{k} (bf16)"
            with torch.no_grad():
                record(name, "fwd time", bench(lambda: moe(k)) * 1e3, "ms")
            torch.cuda.reset_peak_memory_stats()
            record(name, "fwd+bwd time",
                   bench(lambda: torch.autograd.backward(moe(k), gx, inputs=params)) * 1e3, "ms")
            record(name, "peak memory allocated", torch.cuda.max_memory_allocated() / 2 ** 30, "GiB")
        xp = torch.randn(T_, D_, device=dev, dtype=bf)
        offs = torch.arange(1, E_ + 1, device=dev, dtype=torch.int32) * (T_ // E_)
        flops = 2.0 * T_ * D_ * FF
        with torch.no_grad():
            t_g = bench(lambda: torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs))
            t_d = bench(lambda: xp @ w1[0].t())
        name = f"torch expert GEMM {T_}x768x2048 in 8 groups (bf16)"
        record(name, "rate", flops / t_g / 1e12, "TFLOP/s")
        record(name, "dense rate, same size", flops / t_d / 1e12, "TFLOP/s")
        record(name, "of the dense rate", 100.0 * t_d / t_g, "%")
        del x, gx, wr, w1, w3, w2, params, xp
        torch.cuda.empty_cache()

    if "lm" in want or "tfm" in want:
        import torch.nn.functional as F

        def train_steps(name, model, shapes, vocab, warm=3, reps=args.step_reps):
            """Times forward + cross-entropy + backward + fused AdamW step at each (batch, seqlen)."""
            nparam = sum(p.numel() for p in model.parameters())
            record(name, "parameters", nparam / 1e6, "M")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for bsz, L in shapes:
                shape = f"{name} {bsz}x{L}"
                ids = torch.randint(0, vocab, (bsz, L), device=dev)
                tgt = torch.randint(0, vocab, (bsz, L), device=dev)

                def step():
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model(ids)
                        logits = logits.logits if hasattr(logits, "logits") else logits
                        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.view(-1))
                    loss.backward()
                    opt.step()
                    return loss

                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    for _ in range(warm):
                        loss = step()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(reps):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        step()
                        e1.record()
                        e1.synchronize()
                        times.append(e0.elapsed_time(e1) * 1e-3)
                except torch.cuda.OutOfMemoryError as e:
                    record(shape, "out of memory", 1, "(1 = OOM)")
                    print(f"  {shape}: OOM: {str(e).splitlines()[0]}", flush=True)
                    opt.zero_grad(set_to_none=True)
                    continue
                finally:
                    del ids, tgt
                t = sorted(times)[len(times) // 2]
                record(shape, "time", t * 1e3, "ms")
                # the spread of the timed steps: a round whose median moved (the LM step's did by 20 % between
                # rounds of one call) shows here whether every step moved or a few
                record(shape, "time min", min(times) * 1e3, "ms")
                record(shape, "time max", max(times) * 1e3, "ms")
                record(shape, "throughput", bsz * L / t / 1e3, "k tokens/s")
                record(shape, "model FLOP rate (6 N T)", 6 * nparam * bsz * L / t / 1e12, "TFLOP/s")
                record(shape, "MFU (6 N T over 989 TFLOP/s)", 100 * 6 * nparam * bsz * L / t / 989e12, "%")
                record(shape, "peak memory allocated", torch.cuda.max_memory_allocated() / 2 ** 30, "GiB")
                record(shape, "peak memory reserved", torch.cuda.max_memory_reserved() / 2 ** 30, "GiB")
                print(f"  {shape}: loss after warm-up {loss.item():.4f}; timed steps, in order, ms: "
                      + " ".join(f"{v * 1e3:.1f}" for v in times), flush=True)
            del opt

    if "lm" in want:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        import mamba_ssm.ops.triton.ssd_combined as ssd_combined

        try:
            import causal_conv1d_cuda
        except ImportError as e:
            causal_conv1d_cuda = None
            print(f"  causal_conv1d_cuda not importable: {e}", flush=True)
        fused = causal_conv1d_cuda is not None and ssd_combined.causal_conv1d_fwd_function is not None
        # pad_vocab_size_multiple 8 is mamba_ssm's default; 16 is a multiple of it, so the vocabulary stays 16.
        cfg = MambaConfig(d_model=768, d_intermediate=0, n_layer=24, vocab_size=16, pad_vocab_size_multiple=8,
                          ssm_cfg=dict(layer="Mamba2", d_state=128, headdim=64, expand=2, chunk_size=256,
                                       use_mem_eff_path=fused),
                          rms_norm=True, fused_add_norm=True, residual_in_fp32=True, tie_embeddings=True)
        torch.manual_seed(0)
        model = MambaLMHeadModel(cfg, device=dev, dtype=torch.float32)
        mixers = [b.mixer for b in model.backbone.layers]
        fused = fused and all(m.use_mem_eff_path for m in mixers)
        label = "mamba_ssm LM (fused path)" if fused else "mamba_ssm LM (UNFUSED: no causal_conv1d_cuda)"
        print(f"  fused path (mamba_split_conv1d_scan_combined + causal_conv1d_cuda): {fused}; "
              f"vocab {model.lm_head.weight.shape[0]}", flush=True)
        record(label, "fused path active", int(fused), "(1 = yes)")
        if fused:
            # Proof that the step calls the CUDA conv kernels: count the extension's calls over one step.
            calls = {"causal_conv1d_fwd": 0, "causal_conv1d_bwd": 0}
            orig = {k: getattr(causal_conv1d_cuda, k) for k in calls}

            def counting(k):
                def f(*a, **kw):
                    calls[k] += 1
                    return orig[k](*a, **kw)
                return f

            for k in calls:
                setattr(causal_conv1d_cuda, k, counting(k))
            ids = torch.randint(0, 16, (1, 1024), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(ids).logits.float().sum().backward()
            model.zero_grad(set_to_none=True)
            for k in calls:
                setattr(causal_conv1d_cuda, k, orig[k])
            print(f"  causal_conv1d_cuda calls in one forward+backward: {calls}", flush=True)
            record(label, "conv1d CUDA calls per step", sum(calls.values()), "(fwd+bwd)")
            # 24 layers: 24 forward calls, 24 more where the backward recomputes the conv, 24 backward calls.
            assert calls["causal_conv1d_fwd"] >= 24 and calls["causal_conv1d_bwd"] >= 24, calls
        train_steps(label, model, lm_shapes, 16)
        del model, mixers
        torch.cuda.empty_cache()

    if "tfm" in want:
        class Block(torch.nn.Module):
            def __init__(self, d, h):
                super().__init__()
                self.h = h
                self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
                self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
                self.o = torch.nn.Linear(d, d, bias=False)
                self.fc1 = torch.nn.Linear(d, 4 * d, bias=False)
                self.fc2 = torch.nn.Linear(4 * d, d, bias=False)

            def forward(self, x, cos, sin):
                B, L, D = x.shape
                q, k, v = self.qkv(self.n1(x)).view(B, L, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)

                def rope(t):
                    t1, t2 = t.chunk(2, dim=-1)
                    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1).to(v.dtype)

                a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
                x = x + self.o(a.transpose(1, 2).reshape(B, L, D))
                return x + self.fc2(F.gelu(self.fc1(self.n2(x)), approximate="tanh"))

        class Transformer(torch.nn.Module):
            def __init__(self, vocab, d, h, n):
                super().__init__()
                self.emb = torch.nn.Embedding(vocab, d)
                self.blocks = torch.nn.ModuleList(Block(d, h) for _ in range(n))
                self.norm = torch.nn.RMSNorm(d)
                self.hd = d // h

            def forward(self, ids):
                L = ids.shape[1]
                inv = 10000.0 ** (-torch.arange(0, self.hd // 2, device=ids.device) / (self.hd // 2))
                ang = torch.arange(L, device=ids.device)[:, None].float() * inv[None, :]
                cos, sin = ang.cos(), ang.sin()
                x = self.emb(ids)
                for b in self.blocks:
                    x = b(x, cos, sin)
                return F.linear(self.norm(x), self.emb.weight)  # tied output head

        torch.manual_seed(0)
        model = Transformer(16, 768, 12, 12).to(dev)
        train_steps("torch Transformer 12x768 SDPA", model, [(4, 8192)], 16)
        del model
        torch.cuda.empty_cache()

    with open(os.path.join(args.out, "peers.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "metric", "value", "unit"])
        w.writerows(rows)


if __name__ == "__main__":
    main()
