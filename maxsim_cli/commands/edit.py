"""`maxsim add`, `maxsim delete`, `maxsim compact`: change a corpus folder, one committed generation each."""

from __future__ import annotations

import sys

import typer

from maxsim_cli.commands import cli_errors


def _summary(quiet: bool, what: str, change: object) -> None:
    if quiet:
        return
    from maxsim_cli.units import format_count as n

    generation = change.generation
    where = f"generation {generation}" if generation is not None else "nothing committed"
    typer.echo(
        f"maxsim: {what}; {where}: {n(change.num_docs)} documents, "
        f"{n(change.num_deleted)} deleted rows kept in shards",
        err=True,
    )


def _log(line: str) -> None:
    typer.echo(f"maxsim: {line}", err=True)


def register(app: typer.Typer) -> None:
    """Add the `add`, `delete` and `compact` commands to `app`."""

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

        change = add_shards(corpus, sources, replace=replace, log=_log)
        replaced = f" ({n(change.deleted)} replaced)" if change.deleted else ""
        _summary(quiet, f"added {n(change.added)} documents{replaced}", change)

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
        from maxsim_cli.shards.edit import delete_ids, read_id_lines
        from maxsim_cli.units import format_count as n

        if ids == "-":
            wanted = read_id_lines("<stdin>", sys.stdin.buffer)
        else:
            try:
                with open(ids, "rb") as fh:
                    wanted = read_id_lines(ids, fh)
            except OSError as exc:
                from maxsim_cli.errors import InputError

                reason = exc.strerror or type(exc).__name__
                raise InputError(
                    f"{ids}: cannot read it ({reason}); give a file of ids, one a line, or '-' for stdin"
                ) from None
        change = delete_ids(corpus, wanted, strict=strict, source="<stdin>" if ids == "-" else ids, log=_log)
        _summary(quiet, f"deleted {n(change.deleted)} documents", change)

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

        change = compact(corpus, threshold)
        _summary(quiet, f"compacted {change.compacted} shards", change)
