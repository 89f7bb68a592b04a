"""Recall of the exact top-k in the compressed tier's top N (`maxsim score --exact-from`'s depth).

For each codec (`maxsim quantize --bits 8/4/2`) the compressed corpus is searched for every query's top
N, and the exact (float) top-k is looked for in it: recall@k(N) = |exact top-k within compressed top-N| / k,
averaged over the queries. The two-stage search returns exactly the exact top-k whenever that recall is 1.
Each (codec, k) also gets a row at the default depth (`maxsim_cli.scoring.request.default_depth`; one
beyond the corpus is cut to the corpus: every document then reaches the exact stage). With --qrels, the
nDCG@10, RR@10 and R@100 (`maxsim eval`'s) of the exact run and of each codec's compressed-only run.

    python benchmarks/two_stage_recall.py --corpus sample_data/corpus \
        --queries sample_data/queries.safetensors --qrels sample_data/qrels.txt --device cpu
    python benchmarks/two_stage_recall.py --random 10000 --device cpu
    python benchmarks/two_stage_recall.py --corpus WORKDIR/corpus --queries WORKDIR/queries.safetensors \
        --qrels WORKDIR/qrels.txt --device cpu --out benchmarks/results/codes/recall-realtext-cpu.json

(WORKDIR from benchmarks/make_real_text_set.py.) Prints one line per (codec, k, depth) and per codec's
nDCG; with --json, one JSON object per row on stdout; --out writes every row, the codebooks and the
command to one JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from maxsim_cli import open_corpus, read_queries, search
from maxsim_cli.codecs import BITS, CODECS_2BIT
from maxsim_cli.evaluate import evaluate_run
from maxsim_cli.quantize import quantize_corpus
from maxsim_cli.scoring.request import default_depth
from maxsim_cli.shards import write_shard

DEPTHS = (10, 20, 50, 100, 200, 300, 500, 1000, 2000, 5000, 10000)


def random_ragged(folder: str, num_docs: int, num_queries: int, dim: int, seed: int) -> tuple[str, str]:
    """A float16 corpus of random unit vectors, 20-300 tokens a document, and queries of 32 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 301, size=num_docs)
    values = torch.from_numpy(rng.standard_normal((int(lengths.sum()), dim), dtype=np.float32))
    values = torch.nn.functional.normalize(values, dim=1).half()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    docs = [values[offsets[i] : offsets[i + 1]] for i in range(num_docs)]
    corpus = os.path.join(folder, "corpus")
    os.makedirs(corpus)
    write_shard(os.path.join(corpus, "shard-0.safetensors"), [f"d{i}" for i in range(num_docs)], docs)
    q = torch.from_numpy(rng.standard_normal((num_queries * 32, dim), dtype=np.float32))
    q = torch.nn.functional.normalize(q, dim=1).half()
    queries = os.path.join(folder, "queries.safetensors")
    write_shard(queries, [f"q{i}" for i in range(num_queries)], list(q.split(32)))
    return corpus, queries


def recall_rows(
    exact: dict, compressed: dict, ks: list[int], depths: list[int]
) -> list[tuple[int, int, float, float]]:
    """(k, depth, mean recall, worst query's recall) for every k and depth."""
    rows = []
    for k in ks:
        for depth in depths:
            if depth < k:
                continue
            per_query = []
            for qid, ranked in exact.items():
                want = {d for d, _ in ranked[:k]}
                got = {d for d, _ in compressed.get(qid, [])[:depth]}
                per_query.append(len(want & got) / len(want))
            rows.append((k, depth, float(np.mean(per_query)), float(np.min(per_query))))
    return rows


def effectiveness(run, qrels: str, folder: str, name: str) -> dict[str, float]:  # noqa: ANN001
    """`maxsim eval`'s default measures of ``run`` (a `Run`) against ``qrels``."""
    path = os.path.join(folder, f"{name}.trec")
    run.to_trec(path)
    return evaluate_run(path, qrels).values


def quantization_of(bits: int, codec: str) -> str:
    """What `maxsim quantize --bits BITS --codec CODEC` writes."""
    return CODECS_2BIT[codec] if bits == 2 else BITS[bits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="float corpus folder (default: random ragged data)")
    parser.add_argument("--queries", help="query shard (with --corpus)")
    parser.add_argument("--qrels", help="TREC qrels of the queries: nDCG@10 of each compressed-only run")
    parser.add_argument("--random", type=int, default=20000, help="documents of the random corpus")
    parser.add_argument("--random-queries", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--bits", default="8,4,2")
    parser.add_argument("--codec", default="int2", help="the 2-bit codec (quantize --codec, its default)")
    parser.add_argument("--ks", default="10,100")
    parser.add_argument(
        "--depths", default=",".join(map(str, DEPTHS)), help="depths N (those past the corpus dropped)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random data and of quantize")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="write all rows and the setup to this JSON file")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    rows: list[dict] = []
    codebooks: dict[str, dict] = {}
    quality: dict[str, dict[str, float]] = {}

    def emit(row: dict) -> None:
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        elif "recall" in row:
            mark = "  (default depth)" if row["default"] else ""
            print(
                f"bits {row['bits']}  k {row['k']:4d}  depth {row['depth']:5d}  recall {row['recall']:.4f}  "
                f"worst query {row['worst']:.2f}{mark}",
                flush=True,
            )

    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus:
            corpus_path, queries_path = args.corpus, args.queries
        else:
            corpus_path, queries_path = random_ragged(
                tmp, args.random, args.random_queries, args.dim, args.seed
            )
        queries = read_queries(queries_path)
        with open_corpus(corpus_path) as corpus:
            num_docs, num_tokens, dim = len(corpus), corpus.num_tokens, corpus.dim
            depths = sorted({d for d in map(int, args.depths.split(",")) if d <= num_docs} or {num_docs})
            started = time.perf_counter()
            exact_run = search(queries, corpus, k=max(max(ks), 100), device=args.device)
            exact_s = time.perf_counter() - started
            exact = exact_run.to_dict()
        if args.qrels:
            quality["exact"] = effectiveness(exact_run, args.qrels, tmp, "exact")
            print(f"exact     {json.dumps(quality['exact'])}", flush=True)
        label = args.corpus or f"random ragged {args.random} docs x 20-300 tokens, dim {args.dim}"
        for bits in [int(b) for b in args.bits.split(",")]:
            out = os.path.join(tmp, f"bits{bits}")
            started = time.perf_counter()
            report = quantize_corpus(
                [corpus_path], out, bits=bits, device=args.device, sample_queries=0, seed=args.seed,
                codec=args.codec,
            )
            quantize_s = time.perf_counter() - started
            codebooks[str(bits)] = {
                "quantization": quantization_of(bits, args.codec),
                "num_centroids": report.num_centroids,
                "output_bytes": report.output_bytes,
                "codebook_bytes": os.path.getsize(os.path.join(out, "codebook.safetensors"))
                if bits == 2
                else 0,
                "quantize_s": round(quantize_s, 1),
            }
            started = time.perf_counter()
            with open_corpus(out) as compressed:
                approx_run = search(queries, compressed, k=max(depths + [100]), device=args.device)
            codebooks[str(bits)]["search_s"] = round(time.perf_counter() - started, 1)
            approx = approx_run.to_dict()
            if args.qrels:
                quality[str(bits)] = effectiveness(approx_run, args.qrels, tmp, f"bits{bits}")
                print(f"bits {bits}    {json.dumps(quality[str(bits)])} (compressed only)", flush=True)
            for k in ks:
                wanted = default_depth(quantization_of(bits, args.codec), k)
                at = sorted(set(depths) | {min(wanted, num_docs)})
                for k_, depth, mean, worst in recall_rows(exact, approx, [k], at):
                    default = depth == min(wanted, num_docs)
                    if depth in depths or default:
                        emit(dict(corpus=label, bits=bits, k=k_, depth=depth, recall=mean, worst=worst,
                                  default=default, default_depth=wanted))  # fmt: skip
    if args.out:
        result = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "device": args.device,
            "corpus": label,
            "documents": num_docs,
            "tokens": num_tokens,
            "dim": dim,
            "queries": len(exact),
            "exact_search_s": round(exact_s, 1),
            "codecs": codebooks,
            "effectiveness": quality,
            "rows": rows,
        }
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
