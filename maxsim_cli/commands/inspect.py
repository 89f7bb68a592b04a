"""`maxsim inspect`: validate shards and print what they hold."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data
from maxsim_cli.commands.pack import stderr_bar


def register(app: typer.Typer) -> None:
    """Add the `inspect` command to `app`."""

    @app.command("inspect")
    @cli_errors
    def inspect_command(
        paths: Annotated[
            list[str],
            typer.Argument(help="Shard files and/or corpus directories (read together as one corpus)."),
        ],
        as_json: bool = typer.Option(
            False, "--json", help="Print one JSON object (num_docs, num_tokens, dim, dtype, ..., shards)."
        ),
        check_values: bool = typer.Option(
            True,
            "--check-values/--no-check-values",
            help="Read every value to check for NaN/Inf and count documents with all-zero token rows "
            "(unmasked padding), streamed 65536 tokens at a time; off: structure only.",
        ),
        verify_checksums: bool = typer.Option(
            False, "--verify-checksums", help="Check each shard's sha256 against the index.json manifest."
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    ) -> None:
        """Validate shards and print documents, tokens, dim, dtype and token-length statistics.

        Prints a table (or with --json one object) on stdout: per shard and in total, documents, tokens,
        dim, dtype, quantization, whether vectors are L2-normalised, token lengths min / mean / median /
        p99 / max and bytes. Any invalid input is an error naming the file and the document. Documents
        carrying all-zero token rows (padding kept without its mask) get a warning on stderr, and are
        counted in the JSON (zero_row_docs, first_zero_row_doc).

        Example: maxsim inspect sample_data/corpus --json
        """
        from maxsim_cli.inspect_shards import format_report, inspect_paths

        with stderr_bar("checking values", not quiet and check_values) as update:
            report = inspect_paths(
                paths, check_values=check_values, verify_checksums=verify_checksums, progress=update
            )
        warning = report.zero_row_warning()
        if warning is not None:
            typer.echo(f"maxsim: warning: {warning}", err=True)
        if as_json:
            echo_data(json.dumps(report.to_dict(), indent=2))
        else:
            echo_data(format_report(report))
