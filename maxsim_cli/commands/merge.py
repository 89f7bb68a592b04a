"""`maxsim merge`: merge runs scored on disjoint parts of a corpus into one top-k run."""

from __future__ import annotations

import typer

from maxsim_cli.commands import cli_errors


def register(app: typer.Typer) -> None:
    """Add the `merge` command to `app`."""

    @app.command("merge")
    @cli_errors
    def merge_command(
        runs: list[str] = typer.Argument(  # noqa: B008 - Typer declares arguments in defaults
            ...,
            metavar="RUN",
            help="Runs to merge (TREC, MS MARCO or ColBERT TSV, optionally .gz); '-' reads one from stdin.",
        ),
        top_k: int = typer.Option(1000, "--top-k", "-k", min=1, help="Documents kept per query."),
        output: str = typer.Option(
            "-", "--output", "-o", help="Run file to write (atomically; '.gz' compresses); '-' is stdout."
        ),
        run_tag: str = typer.Option("maxsim", "--run-tag", help="Tag written in the run's last column."),
        tag: str | None = typer.Option(None, "--tag", hidden=True, help="Former name of --run-tag."),
        fmt: str = typer.Option("trec", "--format", help="trec (six columns) or jsonl (one query a line)."),
        queries: str | None = typer.Option(
            None,
            "--queries",
            help="Query embeddings file (safetensors, Arrow, Parquet): write the queries in its order, as "
            "`maxsim score` does (default: first appearance across the runs).",
        ),
        by_rank: bool = typer.Option(
            False,
            "--by-rank",
            help="Merge by rank, not score: each run's documents get 1/position in that run (1, 0.5, "
            "0.33, ...) as their score. Needed to merge a run without scores (MS MARCO "
            "'qid<TAB>pid<TAB>rank') with scored runs.",
        ),
        strict: bool = typer.Option(
            False, "--strict", help="Runs that hold different queries are an error (default: a warning)."
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line on stderr."),
    ) -> None:
        """Merge runs scored on disjoint parts of one corpus into one run, top-k per query.

        Queries keep their first-appearance order (or the order of --queries); documents are ordered by
        score, ties by docno descending. A document found for one query in two inputs is kept once if the
        scores agree (as float32) and is an error otherwise. A run without scores cannot be merged with
        scored runs except --by-rank. Runs that hold different queries are merged with a warning
        (--strict: an error, nothing written).

        Example: maxsim merge part-0.trec part-1.trec -k 100 -o run.trec
        """
        from maxsim_cli.errors import UsageError
        from maxsim_cli.merge import merge_runs
        from maxsim_cli.units import format_count as n

        if tag is not None:
            if run_tag not in ("maxsim", tag):
                raise UsageError(f"--tag {tag} and --run-tag {run_tag} disagree; give --run-tag only")
            run_tag = tag

        def warn(message: str) -> None:
            typer.echo(f"maxsim: warning: {message}", err=True)

        stats = merge_runs(
            runs,
            top_k,
            output,
            tag=run_tag,
            fmt=fmt,
            queries=queries,
            by_rank=by_rank,
            strict=strict,
            warn=warn,
        )
        if not quiet:
            how = " by rank" if stats.by_rank else ""
            note = (
                f"merged {stats.inputs} runs{how}: {n(stats.queries)} queries, {n(stats.rows_read)} rows "
                f"read, {n(stats.rows_written)} written (top {top_k})"
            )
            if stats.duplicates and stats.by_rank:
                note += f"; {stats.duplicates} rows found in two inputs, kept at their best rank"
            elif stats.duplicates:
                note += f"; {stats.duplicates} rows found in two inputs with equal scores, kept once"
            typer.echo(note, err=True)
