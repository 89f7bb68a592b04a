"""`maxsim explain`: why a document scores what it does for a query, token by token."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data

if TYPE_CHECKING:
    from maxsim_cli.explain import Explanation

FORMATS = ("table", "json")
# How the table's summary line says the kernel's order of addition (`maxsim_cli.explain`).
ORDERS = {"sequential": "one after another", "pairwise": "in the Triton kernel's pairwise tree"}


def register(app: typer.Typer) -> None:
    """Add the `explain` command to `app`."""

    @app.command("explain")
    @cli_errors
    def explain_command(
        queries: Annotated[
            str,
            typer.Argument(
                help="Query embeddings: a shard file (safetensors, Arrow, Parquet), a folder of them, or '-' "
                "for an Arrow IPC stream on stdin."
            ),
        ],
        corpus: Annotated[
            list[str],
            typer.Argument(
                help="Corpus shards: files and/or directories (with an optional index.json manifest)."
            ),
        ],
        qid: str = typer.Option(..., "--qid", help="The query to explain (its id in the query file)."),
        docno: str = typer.Option(..., "--docno", help="The document to explain (its id in the corpus)."),
        fmt: str = typer.Option(
            "table", "--format", help="table (one line a query token) or json (the explanation as an object)."
        ),
        heatmap: str | None = typer.Option(
            None,
            "--heatmap",
            help="Also write a PNG heatmap over the document's image patches (ColPali): needs the shard's "
            "patch_grid metadata (docs/format.md) and matplotlib (pip install 'maxsim\\[explain]').",
        ),
        token: int | None = typer.Option(
            None,
            "--token",
            min=0,
            help="With --heatmap: draw this query token's similarity with every patch (tokens count from "
            "0), its match framed; without it the heatmap shows each patch's share of the whole score.",
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        backend: str = typer.Option(
            "auto",
            "--backend",
            help="auto (Triton on CUDA, torch on the CPU), triton (on the CPU only with TRITON_INTERPRET=1) "
            "or torch: the kernel whose terms and order of addition are explained.",
        ),
    ) -> None:
        """Explain a document's MaxSim score for a query, token by token.

        For each query token: the document token it matched (its index in the document, the lowest on
        ties), their similarity and its share of the score. The similarities are the float32 terms the
        kernel adds; the first line says whether, added in the kernel's order, they give the score bit
        for bit (the score `maxsim score` writes for this pair). Only that document is read.

        Example: maxsim explain sample_data/queries.safetensors sample_data/corpus --qid q003 --docno gcc
        """
        from maxsim_cli.errors import UsageError

        if fmt not in FORMATS:
            raise UsageError(f"--format {fmt}: use table or json")
        if token is not None and heatmap is None:
            raise UsageError("--token draws a heatmap: give --heatmap out.png too")
        if heatmap is not None:
            from maxsim_cli.shards.files import check_output

            check_output(heatmap, [queries, *corpus], option="--heatmap")
        from maxsim_cli.explain import explain

        explanation = explain(queries, corpus, qid, docno, device=device, backend=backend)
        if heatmap is not None:  # before anything is printed: a heatmap that cannot be drawn prints nothing
            explanation.heatmap(heatmap, token=token)
        if fmt == "json":
            echo_data(json.dumps(explanation.to_dict(), indent=2))
        else:
            echo_data(format_table(explanation))


def format_table(e: Explanation) -> str:
    """The explanation as lines for a terminal: a summary, then one row per query token."""
    added = f"the {len(e.tokens)} similarities, added {ORDERS.get(e.order, e.order)},"
    if e.exact:
        verdict = f"{added} give the score bit for bit"
    else:
        verdict = f'{added} give {e.total:.9g}, not the score bit for bit (docs/api.md, "Explanations")'

    lines = [
        f"query {e.qid}, document {e.docno} ({e.doc_tokens} tokens): score {e.score:.9g}",
        verdict,
        "",
    ]
    grid = e.patch_grid is not None
    header = f"{'query_token':>11}  {'doc_token':>9}  {'similarity':>15}  {'share':>8}"
    lines.append(header + (f"  {'patch (row, col)':>16}" if grid else ""))
    for t in e.tokens:
        share = f"{t.share:.2%}" if t.share is not None else "-"
        row = f"{t.query_token:>11}  {t.doc_token:>9}  {t.similarity:>15.9g}  {share:>8}"
        if grid:
            patch = f"({t.patch[0]}, {t.patch[1]})" if t.patch is not None else "-"
            row += f"  {patch:>16}"
        lines.append(row)
    return "\n".join(lines)
