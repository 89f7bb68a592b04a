"""`maxsim delete`: delete documents from a corpus folder, one committed generation."""

from __future__ import annotations

import typer

from maxsim_cli.commands import cli_errors
from maxsim_cli.commands.changes import log, summary


def register(app: typer.Typer) -> None:
    """Add the `delete` command to `app`."""

    @app.command("delete")
    @cli_errors
    def delete_command(
        corpus: str = typer.Argument(..., help="The corpus folder to delete from."),
        ids: str = typer.Option(..., "--ids", help="File of document ids, one a line; '-' reads stdin."),
        strict: bool = typer.Option(
            False, "--strict", help="Ids the corpus does not hold are an error (default: a warning)."
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary line on stderr."),
    ) -> None:
        """Delete documents from a corpus folder in one commit (a new generation).

        Deleted documents disappear from every search, rerank (they are missing) and count at once;
        their rows stay in the shards until `maxsim compact` rewrites them.

        Example: maxsim delete corpus/ --ids gone.txt
        """
        from maxsim_cli.shards.edit import delete_ids
        from maxsim_cli.shards.format import read_id_file
        from maxsim_cli.units import format_count as n

        wanted = read_id_file(ids)
        change = delete_ids(corpus, wanted, strict=strict, source="<stdin>" if ids == "-" else ids, log=log)
        summary(quiet, f"deleted {n(change.deleted)} documents", change)
