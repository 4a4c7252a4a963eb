#!/usr/bin/env python3
"""Compare the loss curves of training runs (their metrics.csv files) and draw them.

  scripts/compare_runs.py --run NAME=DIR/metrics.csv [--run ...] --baseline NAME --out PREFIX [--title T]

Writes PREFIX.csv (model, kind, step, bits_per_base: every train and eval row of every run) and PREFIX.svg (held-out
bits/base against step, one line per run, with the training curves drawn thin), and prints, for every run, the
first step at which its held-out bits/base reaches the baseline's final held-out value: the first evaluated step
at or below it, and the step found by linear interpolation between the two evaluations that bracket it.
Standard library only (no plotting package needed).
"""
import argparse
import csv
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def read_run(path):
    rows = []
    with open(path, newline="") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            try:
                rows.append((r["kind"], int(r["step"]), float(r["bits_per_base"])))
            except (KeyError, ValueError) as e:
                sys.exit(f"{path}:{i}: cannot read kind/step/bits_per_base ({e})")
    if not any(k == "eval" for k, _, _ in rows):
        sys.exit(f"{path}: no eval rows")
    return rows


def reach(evals, target):
    """First evaluated step with bits <= target, and the interpolated crossing step (None if never reached)."""
    prev = None
    for step, bits in evals:
        if bits <= target:
            if prev is None or prev[1] == bits:
                return step, float(step)
            s0, b0 = prev
            return step, s0 + (b0 - target) / (b0 - bits) * (step - s0)
        prev = (step, bits)
    return None, None


def svg(runs, title, path):
    W, H, ml, mr, mt, mb = 760, 460, 70, 170, 40, 50
    evals = {n: [(s, b) for k, s, b in rows if k == "eval" and s > 0] for n, rows in runs.items()}
    trains = {n: [(s, b) for k, s, b in rows if k == "train"] for n, rows in runs.items()}
    xs = [s for v in list(evals.values()) + list(trains.values()) for s, _ in v]
    ys = [b for v in evals.values() for _, b in v] + [b for v in trains.values() for _, b in v]
    x0, x1 = 0, max(xs)
    lo, hi = min(ys), sorted(ys)[int(0.97 * (len(ys) - 1))]  # keep the first steep steps from flattening the rest
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    X = lambda s: ml + (s - x0) / (x1 - x0) * (W - ml - mr)
    Y = lambda b: mt + (hi - min(max(b, lo), hi)) / (hi - lo) * (H - mt - mb)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{ml}" y1="{H - mb}" x2="{W - mr}" y2="{H - mb}" stroke="black"/>',
           f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{H - mb}" stroke="black"/>',
           f'<text x="{(ml + W - mr) / 2}" y="{H - 12}" text-anchor="middle">training step</text>',
           f'<text x="16" y="{(mt + H - mb) / 2}" text-anchor="middle" transform="rotate(-90 16 {(mt + H - mb) / 2})">'
           'bits per base</text>']
    for i in range(6):
        s = x0 + i * (x1 - x0) / 5
        out.append(f'<text x="{X(s):.1f}" y="{H - mb + 16}" text-anchor="middle">{s:.0f}</text>')
        b = lo + i * (hi - lo) / 5
        out.append(f'<text x="{ml - 6}" y="{Y(b) + 4:.1f}" text-anchor="end">{b:.3f}</text>')
        out.append(f'<line x1="{ml}" y1="{Y(b):.1f}" x2="{W - mr}" y2="{Y(b):.1f}" stroke="#ddd"/>')
    for i, name in enumerate(runs):
        c = COLOURS[i % len(COLOURS)]
        pts = " ".join(f"{X(s):.1f},{Y(b):.1f}" for s, b in trains[name])
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="0.8" stroke-opacity="0.45"/>')
        pts = " ".join(f"{X(s):.1f},{Y(b):.1f}" for s, b in evals[name])
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for s, b in evals[name]:
            out.append(f'<circle cx="{X(s):.1f}" cy="{Y(b):.1f}" r="3" fill="{c}"/>')
        y = mt + 20 + 36 * i
        out.append(f'<line x1="{W - mr + 12}" y1="{y}" x2="{W - mr + 36}" y2="{y}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - mr + 42}" y="{y + 4}">{name} held-out</text>')
        out.append(f'<text x="{W - mr + 42}" y="{y + 18}" fill="#666">(thin: train)</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=path/to/metrics.csv")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="held-out bits per base")
    a = ap.parse_args()
    runs = {}
    for spec in a.run:
        if "=" not in spec:
            sys.exit(f"--run {spec}: expected NAME=path")
        name, path = spec.split("=", 1)
        runs[name] = read_run(path)
    if a.baseline not in runs:
        sys.exit(f"--baseline {a.baseline}: not one of the runs ({', '.join(runs)})")
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "kind", "step", "bits_per_base"])
        for name, rows in runs.items():
            for k, s, b in rows:
                w.writerow([name, k, s, b])
    svg(runs, a.title, a.out + ".svg")
    base_evals = [(s, b) for k, s, b in runs[a.baseline] if k == "eval"]
    target = base_evals[-1][1]
    print(f"target: {a.baseline}'s final held-out {target:.4f} bits/base at step {base_evals[-1][0]}")
    for name, rows in runs.items():
        evals = [(s, b) for k, s, b in rows if k == "eval"]
        first, interp = reach(evals, target)
        final = evals[-1]
        if first is None:
            print(f"{name}: final {final[1]:.4f} at step {final[0]}; never reaches the target")
        else:
            print(f"{name}: final {final[1]:.4f} at step {final[0]}; reaches the target at evaluated step {first} "
                  f"(interpolated {interp:.0f})")


if __name__ == "__main__":
    main()
