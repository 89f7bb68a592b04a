"""What `maxsim score --max-host-memory` bounds, measured: a corpus several times each budget, one fresh
`maxsim score --device cpu` process per budget.

The corpus: `--corpus-size` of fp16 shards (d = 128, documents of 20-300 tokens, L2-normalised random
vectors; `common.build_corpus`) in a temp folder, `--queries` queries of 32 tokens. For each budget the
child's figures:

- ``peak_rss``: its peak resident set (its own ``VmHWM`` at exit: anonymous memory, mapped file pages
  and shared libraries alike);
- ``null_peak_rss``: the same of the same command over a corpus of one 300-token document: Python, torch
  and the libraries, i.e. the fixed cost no budget bounds;
- ``growth`` = ``peak_rss - null_peak_rss``: what the run added, measured from outside;
- ``reported_growth``: the run's own ``peak_host_bytes`` (peak RSS over RSS at the start of the run,
  `maxsim_cli.memory`), and whether it warned;
- ``wall_s``, batches and query batches, from its ``--stats-json``.

A budget below what the run needs is refused (exit 1, the minimum named): the table says so.

    python benchmarks/bench_host_memory.py --corpus-size 1GiB --budgets 64MiB,96MiB,128MiB,256MiB \\
        --out benchmarks/results/memory/host-memory-cpu.json --doc docs/reliability.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from common import build_corpus, build_queries, meta, write_json

from maxsim_cli.units import format_size, parse_size

SECTION = "## Memory bounds"


# The child records its own VmHWM at exit: `wait4`'s ru_maxrss would also count the RSS of this
# process at the fork (Linux keeps the larger across exec), ~1 GB here once the corpus is written.
_CHILD = (
    "import atexit, os, sys\n"
    "def hwm():\n"
    "    with open('/proc/self/status') as fh, open(os.environ['MAXSIM_HWM_OUT'], 'w') as out:\n"
    "        out.write(next(line for line in fh if line.startswith('VmHWM')).split()[1])\n"
    "atexit.register(hwm)\n"
    "from maxsim_cli.cli import main\n"
    "main(sys.argv[1:])\n"
)


def run_child(args: list[str], stats_path: str) -> dict:
    """`maxsim score ARGS --stats-json STATS` in a fresh process: its peak RSS, stderr and stats."""
    hwm_path = stats_path + ".hwm"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, "score", *args, "--stats-json", stats_path, "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MAXSIM_HWM_OUT": hwm_path},
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()}
    with open(stats_path, encoding="utf-8") as fh:
        stats = json.load(fh)
    with open(hwm_path, encoding="ascii") as fh:
        peak = int(fh.read()) * 1024
    return {"peak_rss": peak, "stderr": proc.stderr.strip(), "stats": stats}


def table(rows: list[dict], corpus_bytes: int, queries: int) -> str:
    lines = [
        f"`maxsim score --device cpu`, {queries} queries x 32 tokens against {format_size(corpus_bytes)} of "
        "fp16 shards (d = 128), one fresh process per budget:",
        "",
        "| --max-host-memory | peak RSS | fixed cost (1-document corpus) | growth (from outside) "
        "| growth (reported) | within budget | batches | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {format_size(r['budget'])} | refused: {r['error'].split('; ')[-1]} |||||||")
            continue
        lines.append(
            f"| {format_size(r['budget'])} | {format_size(r['peak_rss'])} "
            f"| {format_size(r['null_peak_rss'])} "
            f"| {format_size(r['growth'])} | {format_size(r['reported_growth'])} "
            f"| {'yes' if r['reported_growth'] <= r['budget'] else 'no'} | {r['doc_batches']} "
            f"| {r['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


def write_doc(path: str, text: str, command: str) -> None:
    """Put the table under `SECTION` of `path`: the section's body replaced (created with just that section
    when the file does not exist), the rest of the file untouched."""
    body = (
        f"{text}\n\nMeasured with `{command}`; figures in `benchmarks/results/memory/host-memory-cpu.json`.\n"
    )
    if not os.path.exists(path):
        content = f"# Reliability\n\n{SECTION}\n\n{body}"
    else:
        with open(path, encoding="utf-8") as fh:
            content = fh.read()
        if SECTION not in content:
            content = content.rstrip("\n") + f"\n\n{SECTION}\n\n{body}"
        else:
            start = content.index(SECTION) + len(SECTION)
            nxt = content.find("\n## ", start)
            marker = "<!-- bench_host_memory -->"
            section = content[start : len(content) if nxt < 0 else nxt]
            if marker in section:  # a section with prose: only the measured part between the markers
                a = section.index(marker) + len(marker)
                b = section.index(marker, a)
                section = f"{section[:a]}\n{body}{section[b:]}"
            else:
                section = f"\n\n{body}"
            content = content[:start] + section + ("" if nxt < 0 else content[nxt:])
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-size", default="1GiB")
    parser.add_argument("--budgets", default="64MiB,96MiB,128MiB,256MiB")
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--workdir", default=None, help="Keep the corpus here (default: a temp folder).")
    parser.add_argument("--out", default=None)
    parser.add_argument("--doc", default=None, help="Write the table into this file's memory section.")
    args = parser.parse_args()
    corpus_bytes = parse_size(args.corpus_size, option="--corpus-size")
    budgets = [parse_size(b, option="--budgets") for b in args.budgets.split(",")]
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="maxsim-mem-") as tmp:
        work = args.workdir or tmp
        corpus = os.path.join(work, f"corpus-{corpus_bytes}")
        build_corpus(corpus, corpus_bytes, 128 << 20, cpu)
        queries = os.path.join(work, f"queries-{args.queries}.safetensors")
        build_queries(queries, args.queries, cpu)
        tiny = os.path.join(work, "one-doc")
        os.makedirs(tiny, exist_ok=True)
        from maxsim_cli.shards import write_shard

        write_shard(os.path.join(tiny, "one.safetensors"), ["d0"], [torch.randn(300, 128)], dtype="float16")
        run_path = os.path.join(work, "run.trec")
        stats_path = os.path.join(work, "stats.json")
        rows = []
        for budget in budgets:
            common = ["-k", "10", "--max-host-memory", str(budget), "-o", run_path]
            null = run_child([queries, tiny, "--device", "cpu", *common], stats_path)
            full = run_child([queries, corpus, "--device", "cpu", *common], stats_path)
            if "error" in full or "error" in null:
                rows.append({"budget": budget, "error": full.get("error") or null["error"]})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                continue
            s = full["stats"]
            row = {
                "budget": budget,
                "peak_rss": full["peak_rss"],
                "null_peak_rss": null["peak_rss"],
                "growth": full["peak_rss"] - null["peak_rss"],
                "reported_growth": s["peak_host_bytes"],
                "host_base_bytes": s["host_base_bytes"],
                "host_reserved_bytes": s.get("host_reserved_bytes"),
                "planned_device_bytes": s["planned_device_bytes"],
                "max_batch_tokens": s["max_batch_tokens"],
                "doc_batches": s["doc_batches"],
                "query_batches": s["query_batches"],
                "wall_s": s["wall_s"],
                "warned": "warning" in full["stderr"],
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    text = table(rows, corpus_bytes, args.queries)
    print(text)
    command = " ".join(["python", "benchmarks/bench_host_memory.py", *sys.argv[1:]])
    write_json(args.out, {"meta": meta(corpus_bytes=corpus_bytes, queries=args.queries), "rows": rows})
    if args.doc:
        write_doc(args.doc, text, command)


if __name__ == "__main__":
    main()
