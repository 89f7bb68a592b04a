"""The 2-bit codecs' quality on a collection, through the scan kernels' own scores: int2 (a per-dimension
grid and a scale a token, `maxsim_kernels.code_packing`, grid fitted by `maxsim_cli.codecs.fit_int2_levels`)
beside residual2 (`maxsim quantize --bits 2`'s k-means codebook) and int4, at the same sample.

``int2_unscaled`` is int2's codes scored with every token's scale 1: what the scale a token is worth (a
scan without it would fold integer maxima). For each codec: the squared error of the decoded tokens (mean
over tokens of |x - decoded x|^2), the compressed-only run's nDCG@10, RR@10 and R@100 against the qrels
(`maxsim eval`'s), and the recall of the exact top-k in the codec's top N (benchmarks/two_stage_recall.py's
measure) for k = 10, 100. The exact run is the fp32 scan of the float corpus. Scores come from
`maxsim_varlen` on the codes (the CPU path here).

    python benchmarks/int2_quality.py --corpus sample_data/corpus \
        --queries sample_data/queries.safetensors --qrels sample_data/qrels.txt \
        --out benchmarks/results/codes/int2-quality-sample-data-cpu.json
    python benchmarks/int2_quality.py --corpus /tmp/realtext/corpus \
        --queries /tmp/realtext/queries.safetensors --qrels /tmp/realtext/qrels.txt \
        --out benchmarks/results/codes/int2-quality-realtext-cpu.json
    python benchmarks/int2_quality.py --random 3000 \
        --out benchmarks/results/codes/int2-quality-random-cpu.json

(the real-text collection from benchmarks/make_real_text_set.py; --random: documents of 20-300 random unit
vectors, dim 128, 64 queries of 32 tokens, no qrels).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import numpy as np
import torch
from common import meta, write_json
from maxsim_kernels import maxsim_varlen
from maxsim_kernels.code_packing import Int2Levels, decode_int2, decode_int4, decode_residual2, encode_int2
from safetensors.torch import load_file

from maxsim_cli.codecs import default_centroids, encode, fit_int2_levels, train_codebook
from maxsim_cli.evaluate import evaluate_run

RECALL_AT = ((10, 10), (10, 20), (10, 50), (10, 100), (100, 100), (100, 200), (100, 300), (100, 500),
             (100, 1000))  # fmt: skip
SAMPLE_TOKENS = 1 << 16


def _shard(path: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    t = load_file(path)
    raw, at = bytes(t["ids"].numpy()).decode(), t["id_offsets"].tolist()
    return t["embeddings"].float(), t["offsets"].long(), [raw[at[i] : at[i + 1]] for i in range(len(at) - 1)]


def load(args: argparse.Namespace) -> tuple:
    """(documents fp32 [T, d], offsets, doc ids, queries fp32, query offsets, query ids)."""
    if args.random:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(20, 301, (args.random,), generator=gen)
        docs = torch.nn.functional.normalize(torch.randn(int(lengths.sum()), 128, generator=gen), dim=1)
        queries = torch.nn.functional.normalize(torch.randn(64 * 32, 128, generator=gen), dim=1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return (docs.half().float(), offsets, [f"d{i}" for i in range(args.random)], queries.half().float(),
                torch.arange(0, 64 * 32 + 1, 32), [f"q{i}" for i in range(64)])  # fmt: skip
    parts, ids, offsets = [], [], [0]
    for path in sorted(glob.glob(os.path.join(args.corpus, "*.safetensors"))):
        emb, off, names = _shard(path)
        parts.append(emb)
        ids += names
        offsets += (off[1:] + offsets[-1]).tolist()
    queries, q_off, q_ids = _shard(args.queries)
    return torch.cat(parts), torch.tensor(offsets), ids, queries, q_off, q_ids


def scores_of(queries, q_off, docs, offsets, block: int = 64, **kw) -> torch.Tensor:  # noqa: ANN001
    """[nq, nd] scores, a block of queries at a time."""
    out = []
    for a in range(0, q_off.numel() - 1, block):
        b = min(a + block, q_off.numel() - 1)
        rows = slice(int(q_off[a]), int(q_off[b]))
        out.append(maxsim_varlen(queries[rows], q_off[a : b + 1] - q_off[a], docs, offsets, **kw))
    return torch.cat(out)


def run_quality(scores: torch.Tensor, doc_ids: list[str], q_ids: list[str], qrels: str, folder: str) -> dict:
    path = os.path.join(folder, "run.trec")
    top = torch.topk(scores, min(100, scores.shape[1]), dim=1)
    with open(path, "w") as f:
        for i, q in enumerate(q_ids):
            for r, (s, d) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist(), strict=True)):
                f.write(f"{q} Q0 {doc_ids[d]} {r + 1} {s:.6f} int2_quality\n")
    return evaluate_run(path, qrels).values


def recall(scores: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    out = {}
    for k, n in RECALL_AT:
        if n > scores.shape[1]:
            continue
        a, b = torch.topk(exact, k, dim=1).indices, torch.topk(scores, n, dim=1).indices
        out[f"recall@{k}({n})"] = float(np.mean([len(set(a[i].tolist()) & set(b[i].tolist())) / k
                                                 for i in range(a.shape[0])]))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="float corpus folder")
    parser.add_argument("--queries", help="query shard")
    parser.add_argument("--qrels", help="TREC qrels of the queries")
    parser.add_argument("--random", type=int, default=0, help="a random ragged corpus of this many documents")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    docs, offsets, doc_ids, queries, q_off, q_ids = load(args)
    gen = torch.Generator().manual_seed(1)
    sample = docs[torch.randperm(docs.shape[0], generator=gen)[:SAMPLE_TOKENS]]
    record = {"meta": meta(), "tokens": docs.shape[0], "documents": offsets.numel() - 1, "dim": docs.shape[1],
              "queries": q_off.numel() - 1, "sample_tokens": sample.shape[0], "codecs": {}}  # fmt: skip
    exact = scores_of(queries, q_off, docs, offsets)
    with tempfile.TemporaryDirectory() as tmp:
        if args.qrels:
            record["exact"] = run_quality(exact, doc_ids, q_ids, args.qrels, tmp)
            print(f"exact      {record['exact']}", flush=True)
        started = time.perf_counter()
        levels = Int2Levels(*fit_int2_levels(sample))
        codes, scales = encode_int2(docs, levels)
        fitted = {"int2": (time.perf_counter() - started, codes, {"doc_scales": scales, "codebook": levels},
                           decode_int2(codes, scales, levels))}  # fmt: skip
        ones = torch.ones_like(scales)  # the same codes without their scales: what the scale is worth
        fitted["int2_unscaled"] = (0.0, codes, {"doc_scales": ones, "codebook": levels},
                                   decode_int2(codes, ones, levels))  # fmt: skip
        started = time.perf_counter()
        num_centroids = default_centroids(docs.shape[0])
        book = train_codebook(sample, num_centroids)
        codes, _ = encode("residual2-kmeans", docs, book)
        kernels_book = book.for_kernels()
        fitted["residual2"] = (time.perf_counter() - started, codes, {"codebook": kernels_book},
                               decode_residual2(codes, kernels_book))  # fmt: skip
        codes, scales = encode("int4-per-token", docs, None)
        fitted["int4"] = (0.0, codes, {"doc_scales": scales}, decode_int4(codes).float() * scales[:, None])
        for name, (fit_s, codes, kw, decoded) in fitted.items():
            width = codes.shape[1] + (4 if "doc_scales" in kw else 0)
            row = {"fit_encode_s": round(fit_s, 2), "bytes_a_token": width,
                   "mse": float(((decoded.float() - docs) ** 2).sum(dim=1).mean())}  # fmt: skip
            if name == "residual2":
                row["num_centroids"] = num_centroids
            scores = scores_of(queries, q_off, codes, offsets, **kw)
            if args.qrels:
                row.update(run_quality(scores, doc_ids, q_ids, args.qrels, tmp))
            row.update(recall(scores, exact))
            record["codecs"][name] = row
            print(f"{name:10s} {row}", flush=True)
    if args.out:
        write_json(args.out, record)


if __name__ == "__main__":
    main()
