"""`maxsim score`: exhaustive top-k or reranking of a corpus of shards, TREC run out."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data


def register(app: typer.Typer) -> None:
    """Add the `score` command to `app`."""

    @app.command("score")
    @cli_errors
    def score_command(
        queries: Annotated[
            str,
            typer.Argument(
                help="Query embeddings: a shard file (safetensors, Arrow, Parquet) or '-' for an Arrow IPC "
                "stream on stdin."
            ),
        ],
        corpus: Annotated[
            list[str],
            typer.Argument(
                help="Corpus shards: files and/or directories (with an optional index.json manifest)."
            ),
        ],
        output: str = typer.Option(
            "-", "--output", "-o", help="Run file to write (atomically; '.gz' compresses); '-' is stdout."
        ),
        top_k: int = typer.Option(1000, "--top-k", "-k", help="Documents kept per query.", min=1),
        candidates: str | None = typer.Option(
            None,
            "--candidates",
            help="Rerank the candidates of this first-stage run (TREC, MS MARCO or ColBERT TSV, optionally "
            ".gz; '-' is stdin; irds:<dataset-id> reads an ir_datasets dataset's scoreddocs) instead of "
            "scoring every document.",
        ),
        strict: bool = typer.Option(
            False,
            "--strict",
            help="Make the warnings errors (exit 1, nothing written): candidates missing from the corpus, "
            "corpus shards with no documents, a query file with no queries, queries from another encoder "
            "or L2 normalisation than the corpus (shard metadata), filter ids not in the corpus, a filter "
            "that allows no document.",
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        backend: str = typer.Option(
            "auto",
            "--backend",
            help="auto (Triton on CUDA, torch on the CPU), triton (on the CPU only with TRITON_INTERPRET=1) "
            "or torch.",
        ),
        max_memory: str | None = typer.Option(
            None,
            "--max-memory",
            help="Memory budget of the scoring device, e.g. 2GiB: the GPU memory the run allocates (default: "
            "90% of the free memory), or with --device cpu the planned working set (batches, scores, top-k), "
            "within --max-host-memory.",
        ),
        max_host_memory: str | None = typer.Option(
            None,
            "--max-host-memory",
            help="Host memory the run may add to the process, e.g. 4GiB: peak RSS (mapped file pages "
            "included) minus RSS at the start, after Python and torch are loaded (default: 4GiB or a quarter "
            "of RAM, whichever is smaller). Batches are sized to it; a run over it warns; one below its "
            "minimum (about 64MiB on the CPU) is refused, naming the minimum.",
        ),
        run_tag: str = typer.Option("maxsim", "--run-tag", help="Tag written in the run's last column."),
        fmt: str = typer.Option("trec", "--format", help="trec (six columns) or jsonl (one query a line)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary line."),
        stats_json: str | None = typer.Option(
            None,
            "--stats-json",
            help="Write counts, times (reading, copying, scoring) and peaks as JSON ('-': stdout, with -o).",
        ),
        batch_queries: int | None = typer.Option(
            None, "--batch-queries", help="Queries per pass over the corpus (default: as many as fit).", min=1
        ),
        devices: str | None = typer.Option(
            None,
            "--devices",
            help="Score on several devices of this machine, shards shared out by tokens: GPU indices "
            "0,1,... or all (a thread per GPU in this process), or cpu:N (N worker processes). Under "
            "torchrun leave it out (each rank takes cuda:LOCAL_RANK). The run is the same.",
        ),
        exact_from: Annotated[
            list[str] | None,
            typer.Option(
                "--exact-from",
                help="CORPUS is a compressed tier (maxsim quantize): scan it for each query's top --depth, "
                "then score those candidates exactly from these shards, the corpus it was quantized from "
                "(only the candidates' rows are read). Repeat for several files or folders.",
            ),
        ] = None,
        depth: int | None = typer.Option(
            None,
            "--depth",
            help="With --exact-from: candidates a query taken from the compressed tier, at least --top-k "
            "(default: the larger of 1000 and 5 x --top-k; for 2-bit codes of 2000 and 20 x --top-k).",
        ),
        include_ids: str | None = typer.Option(
            None,
            "--include-ids",
            help="Return only these documents: a file of ids, one a line ('-' is stdin). A search gives "
            "the top-k among them; a rerank drops the other candidates.",
        ),
        exclude_ids: str | None = typer.Option(
            None,
            "--exclude-ids",
            help="Never return these documents: a file of ids, one a line ('-' is stdin). With "
            "--include-ids: those minus these.",
        ),
        where: str | None = typer.Option(
            None,
            "--where",
            help="Return only the documents for which this condition on the metadata columns of Arrow or "
            "Parquet shards holds, in pyarrow's expression syntax: 'lang == \"en\" and year >= 2020', "
            '\'tag in ["a", "b"]\', \'starts_with(title, "The")\' (docs/api.md, Filters). With the id '
            "filters: documents allowed by all of them.",
        ),
    ) -> None:
        """Score queries against a corpus of shards with exact MaxSim and write a TREC run.

        Every document is scored (top-k per query), or with --candidates only the candidates of a
        first-stage run. Results are ordered by score, ties by docno descending; the same inputs give
        the same bytes whatever the memory budget, batch sizes or shard order. The run goes to stdout
        (or -o), the progress bar and a summary line to stderr. With --devices, or under torchrun, the
        shards are shared among ranks and rank 0 writes the same run (docs/scaling.md). A corpus of
        4-bit or 2-bit codes gives approximate scores; with --exact-from the top of it is scored exactly.

        Example: maxsim score sample_data/queries.safetensors sample_data/corpus -k 100 -o run.trec
        """
        from maxsim_cli import timeline, tuning

        timeline.mark("command")  # the arguments are parsed (MAXSIM_TIMELINE: docs/benchmarks.md)
        tuning.pause_until_pass()  # a one-shot process's imports and set-up: no full scans
        from maxsim_cli import cuda_early

        cuda_early.start(device, devices)  # the GPU's context made while torch is imported
        from maxsim_cli.progress import progress_enabled
        from maxsim_cli.scoring.entry import score
        from maxsim_cli.units import parse_size

        timeline.mark("imports")

        _check_outputs(
            output, stats_json, [queries, *corpus, candidates, *(exact_from or []), include_ids, exclude_ids]
        )
        stats = score(
            queries,
            corpus,
            output=output,
            top_k=top_k,
            candidates=candidates,
            strict=strict,
            device=device,
            backend=backend,
            max_memory=parse_size(max_memory, option="--max-memory") if max_memory is not None else None,
            max_host_memory=(
                parse_size(max_host_memory, option="--max-host-memory")
                if max_host_memory is not None
                else None
            ),
            run_tag=run_tag,
            fmt=fmt,
            batch_queries=batch_queries,
            show_progress=progress_enabled(quiet),
            devices=devices,
            exact_from=exact_from,
            depth=depth,
            include_ids=include_ids,
            exclude_ids=exclude_ids,
            where=where,
        )
        if stats.extra.get("rank", 0):  # a torchrun rank other than 0: rank 0 reports for the job
            return
        if stats_json == "-":
            echo_data(json.dumps(stats.as_dict(), indent=2, sort_keys=True))
        elif stats_json is not None:
            stats.write_json(stats_json)
        if not quiet:
            typer.echo(f"maxsim: {stats.summary()}", err=True)


def _check_outputs(output: str, stats_json: str | None, inputs: list[str | None]) -> None:
    """Both outputs, before any work: not an input, not each other, and writable (`check_output`)."""
    from maxsim_cli.errors import UsageError
    from maxsim_cli.shards.files import check_output, is_stream

    check_output(output, inputs, option="-o")
    if stats_json is None:
        return
    check_output(stats_json, inputs, option="--stats-json")
    if "-" in (stats_json, output):
        same = stats_json == output
    else:  # one regular file for both (a FIFO or /dev/null can take both)
        same = not is_stream(output) and os.path.realpath(stats_json) == os.path.realpath(output)
    if same:
        raise UsageError(
            f"--stats-json {stats_json}: is also where the run goes (-o {output}); give another file"
        )
