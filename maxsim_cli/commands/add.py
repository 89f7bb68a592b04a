"""`maxsim add`: add shards to a corpus folder, one committed generation."""

from __future__ import annotations

import typer

from maxsim_cli.commands import cli_errors
from maxsim_cli.commands.changes import log, summary


def register(app: typer.Typer) -> None:
    """Add the `add` command to `app`."""

    @app.command("add")
    @cli_errors
    def add_command(
        corpus: str = typer.Argument(..., help="The corpus folder to add to."),
        sources: list[str] = typer.Argument(  # noqa: B008 - Typer declares arguments in defaults
            ..., metavar="SHARD_OR_FOLDER...", help="Shard files and/or folders of shards to add."
        ),
        replace: bool = typer.Option(
            False,
            "--replace",
            help="Ids already in the corpus replace its documents (delete and add in one commit); "
            "without it they are an error.",
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line on stderr."),
    ) -> None:
        """Add shards to a corpus folder in one commit (a new generation).

        The shards' ids must be new to the corpus (--replace: their documents are replaced), their dim,
        dtype, quantization and encoder the corpus's; all is checked before anything is written. The
        shards are hard-linked into the folder (copied across file systems). Readers that have the corpus
        open keep the generation they opened. One writer at a time: a second is refused.

        Example: maxsim add corpus/ new-shards/
        """
        from maxsim_cli.shards.edit import add_shards
        from maxsim_cli.units import format_count as n

        change = add_shards(corpus, sources, replace=replace, log=log)
        replaced = f" ({n(change.deleted)} replaced)" if change.deleted else ""
        summary(quiet, f"added {n(change.added)} documents{replaced}", change)
