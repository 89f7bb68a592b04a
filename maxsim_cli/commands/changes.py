"""What `maxsim add`, `delete` and `compact` share: their summary line and warnings on stderr."""

from __future__ import annotations

import typer


def summary(quiet: bool, what: str, change: object) -> None:
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


def log(line: str) -> None:
    typer.echo(f"maxsim: {line}", err=True)
