"""`maxsim pack`: build shards from Parquet / Arrow IPC tables, folders of them (Hugging Face datasets) or a
directory of .npy files."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors


@contextmanager
def stderr_bar(label: str, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A transient rich bar on stderr, drawn only when stderr is a terminal; yields `update(done, total)`."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        yield update


def register(app: typer.Typer) -> None:
    """Add the `pack` command to `app`."""

    @app.command("pack")
    @cli_errors
    def pack_command(
        sources: Annotated[
            list[str],
            typer.Argument(
                help="Parquet or Arrow IPC files with an id column and a token-embedding column; folders of "
                "them (a Hugging Face dataset's data/ folder, a save_to_disk folder); and/or directories of "
                ".npy files (one [num_tokens, dim] array per document, id = file stem).",
            ),
        ],
        output: str = typer.Option(
            ...,
            "--output",
            "-o",
            help="Output directory: new, or existing without shards in it (see --overwrite).",
        ),
        id_column: str = typer.Option(
            "id", "--id-column", help="Column of document ids (strings or integers)."
        ),
        embedding_column: str = typer.Option(
            "embedding",
            "--embedding-column",
            help="Column of token embeddings: list<list<float>>, list<fixed_size_list<float>> or their "
            "large_list variants.",
        ),
        mask_column: str | None = typer.Option(
            None,
            "--mask-column",
            help="Column of per-document masks (0/1 or true/false, one per token vector, e.g. an "
            "attention mask): token vectors marked 0 are padding and are left out.",
        ),
        dtype: str = typer.Option("float16", "--dtype", help="Stored dtype: float16, bfloat16 or float32."),
        shard_tokens: int = typer.Option(
            1 << 23,
            "--shard-tokens",
            help="Tokens per shard (a longer document gets a shard of its own).",
            min=1,
        ),
        normalize: bool = typer.Option(
            False, "--normalize", help="L2-normalise every token vector (in float32) before storing it."
        ),
        fmt: str = typer.Option("safetensors", "--format", help="Shard container: safetensors or arrow."),
        encoder: str | None = typer.Option(
            None, "--encoder", help="Name of the encoder that made the embeddings, recorded in each shard."
        ),
        patch_grid: str | None = typer.Option(
            None,
            "--patch-grid",
            help="Image pages (ColPali): the patch grid ROWSxCOLS, e.g. 32x32, recorded in each shard for "
            "maxsim explain --heatmap (docs/format.md).",
        ),
        patch_start: int = typer.Option(
            0, "--patch-start", min=0, help="With --patch-grid: the token of the first patch (default 0)."
        ),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="Replace the shards and index.json already in OUTDIR (other files stay); the old ones "
            "are removed only once the new ones are complete.",
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary line."),
    ) -> None:
        """Pack token embeddings into shards (shard-00000.safetensors, ...) plus an index.json manifest.

        Reads Parquet and Arrow by record batches and memory-maps .npy files, one file at a time, so memory
        stays bounded whatever the input size. Nothing is written to OUTDIR unless the whole run succeeds.
        Documents with all-zero token rows (padding stored without its mask) get a warning.

        Example: maxsim pack data/ --embedding-column colbert --mask-column attention_mask -o corpus/
        """
        from maxsim_cli.pack import pack
        from maxsim_cli.units import format_count, format_size

        with stderr_bar("packing", not quiet) as update:
            result = pack(
                sources,
                output,
                id_column=id_column,
                embedding_column=embedding_column,
                mask_column=mask_column,
                dtype=dtype,
                shard_tokens=shard_tokens,
                normalize=normalize,
                format=fmt,
                encoder=encoder,
                overwrite=overwrite,
                progress=update,
                patch_grid=patch_grid,
                patch_start=patch_start,
            )
        if result.zero_row_docs:  # a warning, not an error: the shards are valid, the scores may not be
            remedy = "pack with --mask-column NAME (the attention mask) to leave padding out"
            typer.echo(f"warning: {result.zero_row_warning(remedy)}", err=True)
        if not quiet:
            size = sum(os.path.getsize(s.path) for s in result.shards)
            typer.echo(
                f"packed {format_count(result.num_docs)} documents, {format_count(result.num_tokens)} tokens "
                f"(dim {result.dim}, "
                f"{result.dtype}{', normalised' if result.normalized else ''}) into {len(result.shards)} "
                f"shard(s), {format_size(size)}, in {result.outdir}",
                err=True,
            )
