"""`maxsim quantize`: float shards -> int8 shards with per-token scales, with a ranking-quality report."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data

# `maxsim_cli.quantize.DEFAULT_BATCH_TOKENS`, repeated here so that `--help` does not import the scoring
# stack (torch) to show it; tests/test_imports.py checks that the two agree.
DEFAULT_BATCH_TOKENS = 1 << 18
DEFAULT_KMEANS_SAMPLE_TOKENS = 1 << 18  # maxsim_cli.codecs.DEFAULT_SAMPLE_TOKENS


def register(app: typer.Typer) -> None:
    """Add the `quantize` command to `app`."""

    @app.command("quantize")
    @cli_errors
    def quantize_command(
        corpus: Annotated[
            list[str],
            typer.Argument(
                help="Float corpus shards: files and/or directories (with an optional index.json)."
            ),
        ],
        output_dir: str = typer.Option(
            ...,
            "--output",
            "-o",
            help="Directory for the int8 shards: new or empty (see --overwrite).",
        ),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="Replace the shards and index.json already in OUTDIR (other files stay); the old ones "
            "are removed only once the new ones are complete.",
        ),
        batch_tokens: int = typer.Option(
            DEFAULT_BATCH_TOKENS,
            "--batch-tokens",
            min=1,
            help="Tokens read, quantized and written at a time.",
        ),
        sample_queries: int = typer.Option(
            64, "--sample-queries", min=0, help="Queries of the quality check (0 skips the check)."
        ),
        sample_docs: int = typer.Option(
            2000, "--sample-docs", min=1, help="Documents sampled from the corpus for the quality check."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the quality check's sampling."),
        queries: str | None = typer.Option(
            None,
            "--queries",
            help="Query shard for the quality check (default: pseudo-queries drawn from the corpus).",
        ),
        device: str = typer.Option(
            "auto", "--device", help="auto, cpu, cuda or cuda:N (quantizing and check)."
        ),
        bits: int = typer.Option(
            8,
            "--bits",
            help="8: int8 with per-token scales (132 B/token at dim 128); 4: two 4-bit values a byte and a "
            "per-token scale (68 B/token); 2: 2 bits a dimension and 4 more bytes a token (36 B/token, "
            "plus a codebook.safetensors beside the shards; see --codec). Scores of 4 and 2 bits are "
            "approximate; exact scores come from the full-precision corpus.",
        ),
        codec: str | None = typer.Option(
            None,
            "--codec",
            help="--bits 2: int2 (the default; 2 bits a dimension on a per-dimension grid of four values, "
            "and a scale a token: no k-means, and a scan with no per-token centroid lookup) or residual2 "
            "(the ColBERTv2 residual codec: a k-means centroid id and 2 bits a dimension; --centroids; "
            "needs maxsim[codes]). docs/two-stage.md compares them.",
        ),
        centroids: int | None = typer.Option(
            None,
            "--centroids",
            min=1,
            help="--codec residual2: k-means centroids (default: the power of two nearest 16 * "
            "sqrt(tokens)).",
        ),
        kmeans_sample_tokens: int = typer.Option(
            DEFAULT_KMEANS_SAMPLE_TOKENS,
            "--kmeans-sample-tokens",
            min=1,
            help="--bits 2: tokens drawn from the corpus to fit the grid (int2) or train the centroids and "
            "bucket values (residual2) on.",
        ),
        max_host_memory: str | None = typer.Option(
            None,
            "--max-host-memory",
            help="--bits 2: bounds the k-means sample's host memory (e.g. 2G); a smaller sample if needed.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object on stdout."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary lines."),
    ) -> None:
        """Quantize float shards to int8 with per-token scales and report the ranking quality kept.

        Each token becomes int8 codes and one fp32 scale (absmax / 127), one output shard per input
        shard with the same name, plus an index.json manifest; the output directory appears only when
        everything is written. The compression ratio and a quality summary (top-10/top-100 overlap and
        Kendall tau-b of int8 against the source precision, on a seeded sample) go to stderr.

        --bits 4 and --bits 2 write smaller codes (docs/format.md, "Codes below 8 bits") that `maxsim
        score` scans as they are; their scores are approximate.

        Example: maxsim quantize sample_data/corpus -o corpus-int8 --overwrite
        """
        from maxsim_cli.progress import progress_bar
        from maxsim_cli.quantize import quantize_corpus
        from maxsim_cli.units import parse_size

        host_limit = (
            None if max_host_memory is None else parse_size(max_host_memory, option="--max-host-memory")
        )

        with progress_bar("quantizing", not quiet, "tokens") as update:
            report = quantize_corpus(
                corpus,
                output_dir,
                batch_tokens=batch_tokens,
                sample_queries=sample_queries,
                sample_docs=sample_docs,
                seed=seed,
                queries_path=queries,
                device=device,
                overwrite=overwrite,
                progress=update,
                bits=bits,
                num_centroids=centroids,
                kmeans_sample_tokens=kmeans_sample_tokens,
                max_host_memory=host_limit,
                codec=codec,
            )
        if not quiet:
            typer.echo(report.summary(), err=True)
            if report.quality is not None:
                typer.echo(report.quality.summary(), err=True)
        if as_json:
            echo_data(json.dumps(report.as_dict()))
