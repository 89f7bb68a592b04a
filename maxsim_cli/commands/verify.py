"""`maxsim verify`: the fused kernel against an independent float64 reference, with a verdict."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Annotated

import typer

from maxsim_cli.commands import cli_errors, echo_data
from maxsim_cli.units import format_count

if TYPE_CHECKING:
    from maxsim_cli.agreement import ErrorStats, RankingStats
    from maxsim_cli.verify import VerifyReport
    from maxsim_cli.verify.tiers import TierReport

# `maxsim_cli.verify.DEFAULT_BATCH_TOKENS`, repeated here so that `--help` does not import the scoring
# stack (torch) to show it; tests/test_imports.py checks that the two agree.
DEFAULT_BATCH_TOKENS = 1 << 19


def _num(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _fraction(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.4f}"


def _error_rows(label: str, stats: ErrorStats) -> list[str]:
    absolute = f"{_num(stats.max_abs):>11}{_num(stats.p99_abs):>11}{_num(stats.mean_abs):>11}"
    relative = f"{_num(stats.max_rel):>11}{_num(stats.p99_rel):>11}{_num(stats.mean_rel):>11}"
    return [f"  {label:<22}{'absolute':<10}{absolute}", f"  {'':<22}{'relative':<10}{relative}"]


def _error_header(title: str) -> list[str]:
    return [title, f"  {'':<32}{'max':>11}{'p99':>11}{'mean':>11}"]


def _ranking_rows(ranking: RankingStats, within: bool) -> list[str]:
    rows = [f"  {'':<34}{'mean':>9}{'min':>9}"]
    for k, s in ranking.overlap.items():
        rows.append(f"  {f'top-{k} overlap':<34}{s.mean:>9.4f}{s.min:>9.4f}")
    if within and ranking.overlap_within is not None:
        for k, s in ranking.overlap_within.items():
            rows.append(f"  {f'top-{k} overlap within tolerance':<34}{s.mean:>9.4f}{s.min:>9.4f}")
    tau = ranking.kendall_tau
    label = f"Kendall tau-b (top {ranking.tau_depth})"
    undefined = f"  ({tau.undefined} undefined)" if tau.undefined else ""
    rows.append(f"  {label:<34}{_fraction(tau.mean):>9}{_fraction(tau.min):>9}{undefined}")
    return rows


def render(report: VerifyReport) -> str:
    """The human-readable report (what stdout shows without --json)."""
    s = report.setup
    where = {"all": "all documents", "sample": f"a sample, seed {s['seed']}", "candidates": s["candidates"]}
    lines = [
        f"maxsim verify: {format_count(s['num_queries'])} queries x {format_count(s['num_docs'])} documents "
        f"({where[s['mode']]}), {format_count(s['pairs'])} scores",
        f"  {s['dtype']}, dim {s['dim']}, device {s['device_name']}, backend {s['backend']}"
        f"{', TF32' if s['allow_tf32'] else ''}, torch {s['torch']}",
    ]
    if s["mode"] == "candidates" and (s["queries_without_candidates"] or s["candidates_not_in_corpus"]):
        lines.append(
            f"  left out: {s['queries_without_candidates']} queries without candidates, "
            f"{s['candidates_not_in_corpus']} candidates not in the corpus"
        )
    reference = "int8 integer math in float64" if s["dtype"] == "int8" else "float64"
    lines += ["", *_error_header(f"score error vs the {reference} reference")]
    lines += _error_rows("kernel", report.kernel_errors)
    if report.float32_errors is not None:
        lines += _error_rows("float32 reference", report.float32_errors)
    lines.append(f"  tolerance: {report.tolerance_rule}")
    lines.append(f"  largest allowed error: {_num(report.max_allowed)}")
    if report.worst is not None and report.tolerance.violations:
        w = report.worst
        lines.append(
            f"  worst: query {w['qid']} document {w['docno']}: kernel {w['kernel']!r}, reference "
            f"{w['reference']!r}, |error| {_num(w['abs_error'])} > {_num(w['allowed'])}"
        )
    a = report.argmax
    lines += [
        "",
        "argmax per (query token, document)",
        f"  kernel             {100 * a.agreement:.4f}% of {a.compared:,} pairs agree "
        f"({a.mismatches:,} differ, {a.near_ties:,} near-ties excluded)",
    ]
    if report.float32_argmax is not None:
        f = report.float32_argmax
        lines.append(f"  float32 reference  {100 * f.agreement:.4f}% of {f.compared:,} pairs agree")
    lines.append(f"  near-tie margin: {report.near_tie_margin}")
    if report.first_argmax_mismatch is not None:
        m = report.first_argmax_mismatch
        lines.append(
            f"  first mismatch: query {m['qid']} token {m['query_token']}, document {m['docno']}: "
            f"kernel token {m['kernel_argmax']}, reference token {m['reference_argmax']}"
        )
    lines += ["", f"ranking per query, kernel vs reference ({report.ranking.kendall_tau.queries} queries)"]
    lines += _ranking_rows(report.ranking, within=True)
    k, r = report.nonfinite_kernel, report.nonfinite_reference
    lines += ["", f"non-finite scores: kernel NaN {k.nan}, Inf {k.inf}; reference NaN {r.nan}, Inf {r.inf}"]
    if report.quantization is not None:
        q = report.quantization
        lines += [
            "",
            *_error_header(
                f"quantization impact: {s['dtype']} kernel vs exact float64 scores of the "
                f"{q.reference_dtype} reference corpus"
            ),
        ]
        lines += _error_rows("error (not judged)", q.errors)
        lines += _ranking_rows(q.ranking, within=False)
    if report.grad is not None:
        g = report.grad
        dd = "n/a" if g["dd_rel_error"] is None else _num(g["dd_rel_error"])
        repeatable = "yes" if g["bitwise_repeatable"] else "no"
        lines += [
            "",
            f"gradients ({g['queries']} queries x {g['docs']} documents, seed {g['seed']}): "
            f"relative error dQ {_num(g['dq_rel_error'])}, dD {dd}; argmax agreement "
            f"{100 * g['argmax_agreement']:.4f}%; bitwise repeatable {repeatable}",
        ]
    lines += ["", "checks"]
    for c in report.checks:
        lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<13}{c.detail}")
    t = report.timings
    lines += [
        "",
        f"verdict: {'PASS' if report.passed else 'FAIL'}   (kernel {t['kernel']:.2f} s, reference "
        f"{t['reference']:.2f} s, total {t['total']:.2f} s)",
    ]
    return "\n".join(lines)


def render_tier(report: TierReport) -> str:
    """The human-readable report of a compressed tier (``--exact-from``)."""
    s = report.setup
    lines = [
        f"maxsim verify: {format_count(s['num_queries'])} queries x {format_count(s['num_docs'])} documents, "
        f"compressed tier {s['compressed']} ({s['quantization']}) against the exact scores of "
        f"{s['exact_from']} ({s['exact_dtype']})",
        f"  dim {s['dim']}, device {s['device']}",
        "",
        "recall of the exact top k in the compressed top depth (mean, worst query)",
    ]
    for k, default in report.default_depths.items():
        cells = "  ".join(
            f"{r.depth}{'*' if r.depth == default else ''}: {r.mean:.4f} ({r.min:.2f})"
            for r in report.recall
            if r.k == k
        )
        lines.append(f"  recall@{k:<5}{cells}")
    lines.append("  * the default depth of maxsim score --exact-from (capped at the corpus's size)")
    lines += ["", *_error_header("compressed score error vs the exact scores (not judged)")]
    lines += _error_rows("compressed tier", report.errors)
    lines.append("  relative: to the query's score scale, its largest exact score in absolute value")
    lines += ["", "checks"]
    for c in report.checks:
        lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<13}{c.detail}")
    t = report.timings
    lines += [
        "",
        f"verdict: {'PASS' if report.passed else 'FAIL'}   (exact {t['exact']:.2f} s, compressed "
        f"{t['compressed']:.2f} s, total {t['total']:.2f} s)",
    ]
    return "\n".join(lines)


def _json_safe(value: object) -> object:
    """NaN and infinities become null: the output stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def register(app: typer.Typer) -> None:
    """Add the `verify` command to `app`."""

    @app.command("verify")
    @cli_errors
    def verify_command(
        queries: Annotated[
            str,
            typer.Argument(help="Query embeddings: a shard file, or '-' for an Arrow IPC stream on stdin."),
        ],
        corpus: Annotated[
            list[str],
            typer.Argument(help="Corpus shards: files and/or directories (with an optional index.json)."),
        ],
        sample_docs: int | None = typer.Option(
            None, "--sample-docs", help="Verify on this many documents drawn at random (see --seed).", min=1
        ),
        seed: int = typer.Option(
            0, "--seed", help="Seed of the document sample and of the --grad sample (same seed, same report)."
        ),
        candidates: str | None = typer.Option(
            None,
            "--candidates",
            help="Verify the (query, candidate) pairs of this first-stage run (TREC, MS MARCO or ColBERT "
            "TSV, optionally .gz, or irds:<dataset-id>) with the reranking kernel.",
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        backend: str = typer.Option(
            "auto",
            "--backend",
            help="Kernel backend: auto (Triton on CUDA, torch on the CPU), triton (on the CPU only with "
            "TRITON_INTERPRET=1) or torch.",
        ),
        allow_tf32: bool = typer.Option(
            False, "--allow-tf32", help="Let the kernel use TF32 for float32 shards (looser default bound)."
        ),
        atol: float | None = typer.Option(
            None,
            "--atol",
            help="Absolute score tolerance; with --rtol it replaces the derived per-score bound "
            "(docs/verify.md).",
        ),
        rtol: float | None = typer.Option(
            None, "--rtol", help="Relative score tolerance (|kernel - ref| <= atol + rtol |ref|)."
        ),
        min_overlap: float | None = typer.Option(
            None,
            "--min-overlap",
            help="Least top-k overlap: for the kernel, every query's tolerance-aware overlap (default 1.0); "
            "with --reference-corpus, the mean overlap with the float scores (default 0.9).",
        ),
        min_argmax_agreement: float = typer.Option(
            1.0,
            "--min-argmax-agreement",
            help="Least share of (query token, document) pairs, near-ties excluded, whose argmax agrees.",
        ),
        reference_corpus: list[str] | None = typer.Option(  # noqa: B008 (Typer's option declaration)
            None,
            "--reference-corpus",
            help="The float shards an int8 corpus was quantized from: also report the quantization impact. "
            "Repeat for several paths.",
        ),
        grad: bool = typer.Option(
            False, "--grad", help="Also check gradients (query and document) on a seeded sample."
        ),
        batch_tokens: int = typer.Option(
            DEFAULT_BATCH_TOKENS, "--batch-tokens", help="Document tokens scored per batch.", min=1
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
        exact_from: list[str] | None = typer.Option(  # noqa: B008 (Typer's option declaration)
            None,
            "--exact-from",
            help="CORPUS is a compressed tier (maxsim quantize): report the recall of the exact top-10 "
            "and top-100 in its top depth, and its score error, against these float shards, the corpus "
            "it was quantized from. Repeat for several paths.",
        ),
        min_recall: float | None = typer.Option(
            None,
            "--min-recall",
            help="With --exact-from: least mean recall@10 and recall@100 at the default depth (0.99).",
        ),
    ) -> None:
        """Check the fused kernel against an independent float64 reference and give a verdict.

        Scores every document (or --sample-docs N, or the --candidates of a run) with the kernel and
        again with a reference that materialises the similarities in float32 and float64, then reports
        per-score absolute and relative error (max, p99, mean), argmax agreement per (query token,
        document) with near-ties excluded, top-10/100/1000 overlap and Kendall tau-b per query, and
        NaN/Inf counts. int8 shards are checked against the same integer math; --reference-corpus adds
        their quantization impact. Exit 0: everything within tolerance; 3: something is not; 1: error.

        Example: maxsim verify sample_data/queries.safetensors sample_data/corpus --device cpu
        """
        from maxsim_cli.lifeline import commit_point
        from maxsim_cli.progress import progress_bar
        from maxsim_cli.verify import EXIT_FAILED, Tolerances, verify

        if exact_from:
            from maxsim_cli.errors import UsageError
            from maxsim_cli.verify.tiers import MIN_RECALL, verify_tier

            given = {
                "--sample-docs": sample_docs is not None, "--candidates": candidates is not None,
                "--reference-corpus": bool(reference_corpus), "--grad": grad, "--atol": atol is not None,
                "--rtol": rtol is not None, "--min-overlap": min_overlap is not None,
                "--allow-tf32": allow_tf32,
            }  # fmt: skip
            for name, used in given.items():
                if used:
                    raise UsageError(
                        f"{name} does not apply with --exact-from: a compressed tier is verified by the "
                        "recall and score error of every query against every document"
                    )
            tier = verify_tier(
                queries, corpus, exact_from, device=device, backend=backend,
                min_recall=MIN_RECALL if min_recall is None else min_recall,
            )  # fmt: skip
            text = json.dumps(_json_safe(tier.to_dict()), indent=1) if as_json else render_tier(tier)
            with commit_point():
                echo_data(text)
            if not tier.passed:
                raise typer.Exit(EXIT_FAILED)
            return
        if min_recall is not None:
            from maxsim_cli.errors import UsageError

            raise UsageError("--min-recall goes with --exact-from (the recall of a compressed tier)")

        with progress_bar("verifying", not quiet, "pairs") as update:
            report = verify(
                queries,
                corpus,
                sample_docs=sample_docs,
                seed=seed,
                candidates=candidates,
                device=device,
                backend=backend,
                allow_tf32=allow_tf32,
                tolerances=Tolerances(
                    atol=atol, rtol=rtol, min_overlap=min_overlap, min_argmax_agreement=min_argmax_agreement
                ),
                reference_corpus=reference_corpus or None,
                grad=grad,
                max_tokens=batch_tokens,
                progress=update,
            )
        text = json.dumps(_json_safe(report.to_dict()), indent=1) if as_json else render(report)
        with commit_point():  # the report out whole: the command's output (its exit code is 0 or 3)
            echo_data(text)
        if not report.passed:
            raise typer.Exit(EXIT_FAILED)
