"""`maxsim compact`: rewrite the shards of a corpus folder that hold many deleted documents."""

from __future__ import annotations

import typer

from maxsim_cli.commands import cli_errors
from maxsim_cli.commands.changes import log, summary


def register(app: typer.Typer) -> None:
    """Add the `compact` command to `app`."""

    @app.command("compact")
    @cli_errors
    def compact_command(
        corpus: str = typer.Argument(..., help="The corpus folder to compact."),
        threshold: float = typer.Option(
            0.2,
            "--threshold",
            help="Rewrite the shards whose deleted share is at least this (0 to 1; 0: every shard with "
            "a deleted document).",
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line on stderr."),
    ) -> None:
        """Rewrite the shards that hold many deleted documents without them, in one commit.

        Reads and writes a bounded batch at a time. The files of old generations are removed once no
        reader of this machine has them open.

        Example: maxsim compact corpus/ --threshold 0.2
        """
        from maxsim_cli.shards.edit import compact

        change = compact(corpus, threshold, log=log)
        summary(quiet, f"compacted {change.compacted} shards", change)
