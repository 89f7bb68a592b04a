"""`maxsim eval`: score a run against qrels with ir_measures."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data
from maxsim_cli.evaluate import DEFAULT_MEASURES, evaluate_run
from maxsim_cli.units import format_count

_MEASURE_HELP = (
    "Measure in ir_measures syntax, e.g. nDCG@10, RR@10, R@100, P@5, AP (repeatable). "
    f"Default: {', '.join(DEFAULT_MEASURES)}."
)


def register(app: typer.Typer) -> None:
    """Add the `eval` command to `app`."""

    @app.command("eval")
    @cli_errors
    def eval_command(
        run: str = typer.Argument(
            ...,
            metavar="RUN",
            help="Run to evaluate: TREC 6 columns, MS MARCO or ColBERT TSV, optionally .gz; '-' reads stdin; "
            "irds:<dataset-id> evaluates an ir_datasets dataset's own run (its scoreddocs).",
        ),
        qrels: str = typer.Argument(
            ...,
            metavar="QRELS",
            help="TREC qrels 'qid 0 docno relevance', optionally .gz, or irds:<dataset-id> for the qrels of "
            "an ir_datasets dataset (pip install 'maxsim\\[irds]').",
        ),
        measure: Annotated[list[str] | None, typer.Option("--measure", "-m", help=_MEASURE_HELP)] = None,
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object {measure: value}."),
    ) -> None:
        """Evaluate a run against qrels (nDCG@10, RR@10, R@100 by default) with ir_measures.

        Each value is a mean over the queries of the qrels (one missing from the run counts as 0).
        The table (or JSON) goes to stdout, the query counts to stderr.

        Example: maxsim eval sample_data/candidates.trec sample_data/qrels.txt -m nDCG@10 -m RR@10

        Example: maxsim eval run.trec irds:msmarco-passage/dev/small -m RR@10
        """
        result = evaluate_run(run, qrels, measure or None)
        if as_json:
            echo_data(json.dumps(result.values))
        else:
            width = max(len(name) for name in result.values)
            for name, value in result.values.items():
                echo_data(f"{name:<{width}}  {value:.4f}")
        n = format_count
        note = f"{n(result.judged_queries)} judged queries, {n(result.run_queries)} in the run"
        if result.missing_queries:
            note += f"; {n(result.missing_queries)} judged queries absent from the run count as 0"
        if result.unjudged_queries:
            note += f"; {n(result.unjudged_queries)} run queries without judgements ignored"
        typer.echo(note, err=True)
