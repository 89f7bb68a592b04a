"""Plot a kernel benchmark (`bench_kernels.py` JSON): per workload, each method's fraction of the bound.

The bound is the ceiling measured in the same run: the fp16 matmul rate for the tensor-core workloads
(exhaustive, ColPali), the device-copy rate for the HBM-bound ones (one query, rerank). Needs matplotlib
(not a dependency of maxsim: `pip install matplotlib`).

    python benchmarks/plot_kernels.py benchmarks/results/kernels/kernels-h200.json docs/kernels-h200.svg
"""

from __future__ import annotations

import argparse
import json

METHODS = {  # JSON name -> legend label, in drawing order
    "maxsim": "maxsim (this project)",
    "flash_maxsim": "flash-maxsim 0.3.0",
    "lik": "late-interaction-kernels 0.4.5",
    "naive_fp16": "PyTorch einsum, fp16",
    "naive_fp32": "PyTorch einsum, fp32",
}
WORKLOADS = {
    "exhaustive": "exhaustive\n512 q x 50K docs\n(tensor cores)",
    "colpali": "ColPali\n1 q x 1000 docs x 1024\n(tensor cores)",
    "one_query": "one query\n1 q x 100K docs\n(HBM)",
    "rerank": "rerank\n64 q x own 1000 cands\n(HBM)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="bench_kernels.py --out JSON")
    parser.add_argument("out", help="image to write (.svg or .png)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "maxsim"  # the same file from the same results
    import matplotlib.pyplot as plt

    with open(args.results, encoding="utf-8") as fh:
        data = json.load(fh)
    best = {}  # fastest row per (workload, method): flash-maxsim's split-K variant counts as flash-maxsim
    for row in data["rows"]:
        method = "flash_maxsim" if row["method"].startswith("flash_maxsim") else row["method"]
        key = (row["workload"], method)
        if method in METHODS and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = row
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(METHODS)
    for m, (method, label) in enumerate(METHODS.items()):
        xs, ys, texts = [], [], []
        for w, workload in enumerate(WORKLOADS):
            row = best.get((workload, method))
            if row is None:
                continue
            xs.append(w + (m - (len(METHODS) - 1) / 2) * width)
            ys.append(row["fraction_of_bound"])
            texts.append(f"{row['ms']:.3g}" if row["ms"] < 1000 else f"{row['ms']:.0f}")
        bars = ax.bar(xs, ys, width, label=label)
        for bar, text in zip(bars, texts, strict=True):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, text, ha="center",
                    va="bottom", fontsize=6.5, rotation=90)  # fmt: skip
    ax.set_xticks(range(len(WORKLOADS)), list(WORKLOADS.values()), fontsize=8)
    ax.set_ylabel("fraction of the bound measured in the same run")
    ax.set_ylim(0, 1.25)
    ceilings = data.get("ceilings", {})
    matmul, copy = ceilings.get("fp16_matmul_tflops", 0.0), ceilings.get("copy_tbps", 0.0)
    ax.set_title(
        f"MaxSim forward on {data['meta'].get('device', 'GPU')}, fp16, d = 128 (labels: ms); "
        f"bounds: matmul {matmul:.0f} TFLOP/s, copy {copy:.2f} TB/s",
        fontsize=9,
    )
    ax.legend(fontsize=7.5, loc="upper left", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, metadata={"Date": None} if args.out.endswith(".svg") else None)


if __name__ == "__main__":
    main()
