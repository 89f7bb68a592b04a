"""`maxsim verify`: the reference pass, the verdict, and the CLI (driven with typer's CliRunner).

Tolerances: the reference pass is compared with `maxsim_kernels.maxsim_reference` (float64, materialised)
to 1e-12 relative: both sum the same exact float64 products, in different orders, so they differ only by
float64 rounding (~1e-16 per term over at most a few hundred terms). Everything else is a verdict the
command computes itself; the tests check that it passes on honest kernels and fails on perturbed ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import maxsim_kernels
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maxsim_cli.cli import app
from maxsim_cli.shards import write_shard
from maxsim_cli.verify import (
    EXIT_FAILED,
    FULL_FLOAT64_WIDTH,
    float_reference,
    sample_documents,
    similarity_error,
    verify,
)

runner = CliRunner()
HONEST_VARLEN = maxsim_kernels.maxsim_varlen


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _packed(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _write_data(
    root: Path, dtype: str = "float16", n_docs: int = 40, n_queries: int = 6, seed: int = 0
) -> None:
    """Two shards of Gaussian token vectors (lengths 1-40) and a query file; dim 32."""
    gen = torch.Generator().manual_seed(seed)
    dim = 32
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for s, (lo, hi) in enumerate(((0, n_docs // 2), (n_docs // 2, n_docs))):
        docs = [
            torch.randn(int(torch.randint(1, 41, (1,), generator=gen)), dim, generator=gen)
            for _ in range(lo, hi)
        ]
        write_shard(corpus / f"shard-{s}.safetensors", [f"d{i}" for i in range(lo, hi)], docs, dtype=dtype)
    queries = [
        torch.randn(int(torch.randint(2, 9, (1,), generator=gen)), dim, generator=gen)
        for _ in range(n_queries)
    ]
    write_shard(root / "queries.safetensors", [f"q{i}" for i in range(n_queries)], queries, dtype="float32")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    _write_data(root)
    return root


# ------------------------------------------------------------------------------------------------------
# the reference pass
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("long_docs", [False, True], ids=["plain-float64", "certified"])
def test_float_reference_equals_materialised_float64(dtype, long_docs) -> None:
    gen = torch.Generator().manual_seed(1)
    dim = 24
    q_lens = [3, 1, 7, 5]
    low = FULL_FLOAT64_WIDTH + 1 if long_docs else 1
    d_lens = [int(x) for x in torch.randint(low, low + 40, (30,), generator=gen)]
    queries = torch.randn(sum(q_lens), dim, generator=gen).to(dtype)
    docs = (-torch.rand(sum(d_lens), dim, generator=gen)).to(dtype)  # all-negative similarities exist too
    docs[: sum(d_lens) // 2] *= -1
    q_off, d_off = _packed(q_lens), _packed(d_lens)
    docs[d_off[2] : d_off[3]] = docs[d_off[2]]  # a document of identical tokens: exact ties everywhere
    docs[d_off[5] + 1] = docs[d_off[5]]  # one duplicated token
    ref = float_reference(queries, q_off, docs, d_off, sim_error=similarity_error("float16", dim, False))
    s64, a64 = maxsim_kernels.maxsim_reference(
        queries, torch.from_numpy(q_off), docs, torch.from_numpy(d_off), return_argmax=True
    )
    s32 = maxsim_kernels.maxsim_reference(
        queries, torch.from_numpy(q_off), docs, torch.from_numpy(d_off), dtype=torch.float32
    )
    torch.testing.assert_close(ref.score64, s64, rtol=1e-12, atol=1e-12)
    # Both float32 references round each similarity once and sum in float32; the orders may differ.
    torch.testing.assert_close(ref.score32.double(), s32.double(), rtol=1e-5, atol=1e-5)
    judged = ~ref.near_tie
    assert torch.equal(ref.argmax64[judged], a64[judged])
    # every pair of the all-equal document is an exact tie, hence a near-tie
    assert bool(ref.near_tie[:, 2].all())
    if long_docs:
        assert ref.recomputed >= int(ref.near_tie.sum())


def test_sample_documents_is_seeded_sorted_and_distinct() -> None:
    a = sample_documents(1000, 50, seed=7)
    assert np.array_equal(a, sample_documents(1000, 50, seed=7))
    assert not np.array_equal(a, sample_documents(1000, 50, seed=8))
    assert np.array_equal(a, np.unique(a)) and a.size == 50
    assert np.array_equal(sample_documents(10, 50, seed=0), np.arange(10))


# ------------------------------------------------------------------------------------------------------
# the verdict through the CLI
# ------------------------------------------------------------------------------------------------------


def test_happy_path_passes_with_json_keys(data) -> None:
    result = invoke(
        "verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu", "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in (
        "passed",
        "max_abs_error",
        "max_rel_error",
        "argmax_agreement",
        "topk_overlap",
        "kendall_tau",
    ):
        assert key in report
    assert report["passed"] is True
    assert report["argmax_agreement"] == 1.0
    assert report["topk_overlap"] == {"10": 1.0}
    assert report["details"]["setup"]["pairs"] == 6 * 40
    assert {c["name"] for c in report["checks"]} == {"scores", "yardstick", "argmax", "ranking", "non-finite"}


def test_table_is_the_default_output(data) -> None:
    result = invoke("verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.stdout
    assert "Kendall tau-b" in result.stdout


def _perturbed(monkeypatch, *, nudge_score: bool = False, move_argmax: bool = False) -> None:
    """Replace the fused kernel by the honest one with one score nudged and/or one argmax moved (in the
    first batch of documents only)."""
    honest = HONEST_VARLEN
    calls = []

    def perturbed(queries, query_offsets, docs, doc_offsets, **kwargs):
        scores, argmax = honest(queries, query_offsets, docs, doc_offsets, **kwargs)
        calls.append(1)
        if len(calls) > 1:
            return scores, argmax
        scores, argmax = scores.clone(), argmax.clone()
        if nudge_score:
            scores[0, 0] += 1e-3 * (1.0 + scores[0, 0].abs())
        if move_argmax:
            lengths = (doc_offsets[1:] - doc_offsets[:-1]).tolist()
            doc = next(d for d, n in enumerate(lengths) if n >= 2)
            argmax[0, doc] = (argmax[0, doc] + 1) % lengths[doc]
        return scores, argmax

    monkeypatch.setattr(maxsim_kernels, "maxsim_varlen", perturbed)


@pytest.mark.parametrize(
    "nudge_score, move_argmax, failing",
    [(True, False, {"scores", "yardstick"}), (False, True, {"argmax"})],
    ids=["one-score-nudged", "one-argmax-moved"],
)
def test_perturbed_kernel_is_caught_with_exit_3(data, monkeypatch, nudge_score, move_argmax, failing) -> None:
    _perturbed(monkeypatch, nudge_score=nudge_score, move_argmax=move_argmax)
    args = ("verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu")
    result = invoke(*args, "--json")
    assert result.exit_code == EXIT_FAILED == 3, result.output
    report = json.loads(result.stdout)
    assert report["passed"] is False
    assert {c["name"] for c in report["checks"] if not c["passed"]} == failing
    if move_argmax:
        assert report["details"]["argmax"]["mismatches"] == 1
        assert report["details"]["first_argmax_mismatch"]["qid"] == "q0"
    else:
        assert report["details"]["tolerance"]["violations"] == 1
        assert report["details"]["worst_score"]["qid"] == "q0"
    _perturbed(monkeypatch, nudge_score=nudge_score, move_argmax=move_argmax)
    table = invoke(*args)
    assert table.exit_code == 3 and "verdict: FAIL" in table.stdout


def test_user_tolerance_overrides_the_derived_bound(data, monkeypatch) -> None:
    _perturbed(monkeypatch, nudge_score=True)
    args = ("verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu", "--json")
    loose = invoke(*args, "--atol", "0.1")
    assert loose.exit_code == 0, loose.output
    assert "yardstick" not in {c["name"] for c in json.loads(loose.stdout)["checks"]}
    _perturbed(monkeypatch, nudge_score=True)
    tight = invoke(*args, "--atol", "1e-4")
    assert tight.exit_code == 3
    assert [c["name"] for c in json.loads(tight.stdout)["checks"] if not c["passed"]] == ["scores"]


def test_sample_is_deterministic_for_a_seed(data) -> None:
    args = ("verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu", "--json")
    first = json.loads(invoke(*args, "--sample-docs", "9", "--seed", "3").stdout)
    again = json.loads(invoke(*args, "--sample-docs", "9", "--seed", "3").stdout)
    for report in (first, again):
        del report["details"]["timings_s"]
    assert first == again
    setup = first["details"]["setup"]
    assert (setup["mode"], setup["num_docs"], setup["pairs"]) == ("sample", 9, 6 * 9)


def test_candidates_mode_scores_the_run_pairs(data, tmp_path, monkeypatch) -> None:
    run = tmp_path / "run.trec"
    lines = [
        f"q{q} Q0 d{d} {r} {10 - r} bm25" for q in (0, 2, 3) for r, d in enumerate((q, q + 5, q + 20, 39))
    ]
    lines.append("q3 Q0 missing-doc 5 1 bm25")
    run.write_text("\n".join(lines) + "\n")
    args = ("verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu")
    result = invoke(*args, "--candidates", str(run), "--json")
    assert result.exit_code == 0, result.output
    setup = json.loads(result.stdout)["details"]["setup"]
    assert (setup["mode"], setup["pairs"], setup["num_queries"]) == ("candidates", 12, 3)
    assert (setup["queries_without_candidates"], setup["candidates_not_in_corpus"]) == (3, 1)

    honest = maxsim_kernels.maxsim_candidates

    def nudged(*a, **k):
        scores, argmax = honest(*a, **k)
        scores = scores.clone()
        scores[-1] -= 0.5
        return scores, argmax

    monkeypatch.setattr(maxsim_kernels, "maxsim_candidates", nudged)
    assert invoke(*args, "--candidates", str(run)).exit_code == 3


def test_usage_and_input_errors(data, tmp_path) -> None:
    q, c = str(data / "queries.safetensors"), str(data / "corpus")
    both = runner.invoke(app, ["verify", q, c, "--sample-docs", "3", "--candidates", "run.trec"])
    assert both.exit_code == 2 and "exclude each other" in both.stderr
    write_shard(tmp_path / "q16.safetensors", ["x"], [torch.randn(2, 16)])
    wrong_dim = runner.invoke(app, ["verify", str(tmp_path / "q16.safetensors"), c, "--device", "cpu"])
    assert wrong_dim.exit_code == 1
    assert "q16.safetensors" in wrong_dim.stderr and "dim 16" in wrong_dim.stderr
    assert len(wrong_dim.stderr.strip().splitlines()) == 1
    bad_overlap = runner.invoke(app, ["verify", q, c, "--min-overlap", "1.5"])
    assert bad_overlap.exit_code == 2
    two_stdins = runner.invoke(app, ["verify", "-", c, "--candidates", "-"])
    assert two_stdins.exit_code == 2 and "stdin" in two_stdins.stderr


def test_grad_reports_gradient_agreement(data) -> None:
    result = invoke(
        "verify",
        str(data / "queries.safetensors"),
        str(data / "corpus"),
        "--device",
        "cpu",
        "--grad",
        "--json",
    )
    report = json.loads(result.stdout)
    grad = report["details"]["grad"]
    assert grad["dq_rel_error"] < 1e-3 and grad["dd_rel_error"] < 1e-3  # fp16 inputs: issue 6's bound
    assert "gradients" in {c["name"] for c in report["checks"]}


# ------------------------------------------------------------------------------------------------------
# int8: exactness against the integer math, and the quantization impact
# ------------------------------------------------------------------------------------------------------


def _near_tied_int8(root: Path) -> None:
    """Float shards where int8 quantization swaps two documents across query q0's top-10 boundary.

    dim 16. q0 is e0 and q1 is e3 (both exact in int8: one code of 127). Document k's tokens are
    [x_k, 1, 0, ...] (scale 1/127: x_k is rounded to the grid k/127) or, for document B, [x_B, .5, ...]
    (its largest value is x_B itself, which int8 stores exactly). Nine documents sit far above; document
    A has x = 100.4/127 (int8: 100/127 = 0.7874), B has x = 0.789: float ranks A tenth, int8 ranks B
    tenth. For q1 every document's component 3 is well separated, so nothing swaps: the mean top-10
    overlap is (0.9 + 1.0) / 2 = 0.95.
    """
    dim = 16
    docs, ids = [], []
    for k in range(14):
        token = torch.zeros(1, dim)
        token[0, 1] = 1.0
        token[0, 0] = (120 - 2 * k) / 127 if k < 9 else 0.5 - 0.01 * k
        token[0, 3] = 0.9 - 0.05 * k
        docs.append(token)
        ids.append(f"d{k}")
    docs[9][0, 0] = 100.4 / 127  # A
    docs[10][0, 1] = 0.5  # B: its own max, stored exactly
    docs[10][0, 0] = 0.789
    corpus = root / "float"
    corpus.mkdir()
    write_shard(corpus / "docs.safetensors", ids, docs, dtype="float32")
    codes, scales = [], []
    from maxsim_kernels.int8_host import quantize_per_token

    for token in docs:
        c, s = quantize_per_token(token, backend="torch")
        codes.append(c)
        scales.append(s)
    int8 = root / "int8"
    int8.mkdir()
    write_shard(
        int8 / "docs.safetensors",
        ids,
        torch.cat(codes),
        offsets=torch.arange(15),
        scales=torch.cat(scales),
        dtype="int8",
    )
    queries = [torch.eye(dim)[0:1], torch.eye(dim)[3:4]]
    write_shard(root / "queries.safetensors", ["q0", "q1"], queries, dtype="float32")


def test_int8_near_ties_fail_min_overlap_1_and_pass_the_defaults(tmp_path) -> None:
    _near_tied_int8(tmp_path)
    args = (
        "verify",
        str(tmp_path / "queries.safetensors"),
        str(tmp_path / "int8"),
        "--reference-corpus",
        str(tmp_path / "float"),
        "--device",
        "cpu",
        "--json",
    )
    default = invoke(*args)
    assert default.exit_code == 0, default.output
    report = json.loads(default.stdout)
    quant = report["details"]["quantization"]
    assert quant["ranking"]["overlap"]["10"]["mean"] == pytest.approx(0.95)
    assert quant["ranking"]["overlap"]["10"]["min"] == pytest.approx(0.9)
    assert report["details"]["setup"]["dtype"] == "int8"
    assert report["argmax_agreement"] == 1.0

    strict = invoke(*args, "--min-overlap", "1.0")
    assert strict.exit_code == 3, strict.output
    failed = {c["name"] for c in json.loads(strict.stdout)["checks"] if not c["passed"]}
    assert failed == {"quantization"}  # the kernel itself stays exact

    # the same through the reranking kernel: a run listing every document for both queries
    run = tmp_path / "all.trec"
    run.write_text("".join(f"q{q} Q0 d{d} {d + 1} {20 - d} bm25\n" for q in (0, 1) for d in range(14)))
    rerank = invoke(*args, "--candidates", str(run))
    assert rerank.exit_code == 0, rerank.output
    quant = json.loads(rerank.stdout)["details"]["quantization"]
    assert quant["ranking"]["overlap"]["10"]["mean"] == pytest.approx(0.95)
    assert invoke(*args, "--candidates", str(run), "--min-overlap", "1").exit_code == 3


def test_int8_kernel_exactness_catches_a_moved_argmax(tmp_path, monkeypatch) -> None:
    _write_data(tmp_path / "f", dtype="float32", n_docs=12, n_queries=3)
    from maxsim_kernels.int8_host import quantize_per_token

    from maxsim_cli.shards import open_corpus

    int8 = tmp_path / "int8"
    int8.mkdir()
    for shard in open_corpus([str(tmp_path / "f" / "corpus")]).shards:
        batch = shard.read_docs(0, shard.num_docs)
        codes, scales = quantize_per_token(batch.embeddings, backend="torch")
        write_shard(
            int8 / Path(shard.path).name, batch.ids, codes, offsets=batch.offsets, scales=scales, dtype="int8"
        )
    args = ("verify", str(tmp_path / "f" / "queries.safetensors"), str(int8), "--device", "cpu")
    assert invoke(*args).exit_code == 0
    _perturbed(monkeypatch, move_argmax=True)
    result = invoke(*args, "--json")
    assert result.exit_code == 3
    assert {c["name"] for c in json.loads(result.stdout)["checks"] if not c["passed"]} == {"argmax"}


# ------------------------------------------------------------------------------------------------------
# the Triton kernel under the interpreter (tiny shapes), and the GPU
# ------------------------------------------------------------------------------------------------------


def test_triton_backend_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("maxsim_kernels.maxsim_forward")
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 on a machine without CUDA")
    _write_data(tmp_path, n_docs=6, n_queries=2)
    result = invoke(
        "verify", str(tmp_path / "queries.safetensors"), str(tmp_path / "corpus"), "--backend", "triton",
        "--device", "cuda" if torch.cuda.is_available() else "cpu",
    )  # fmt: skip
    assert result.exit_code == 0, result.output


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_kernel_passes(tmp_path, dtype) -> None:
    _write_data(tmp_path, dtype=dtype, n_docs=200, n_queries=16)
    result = invoke(
        "verify",
        str(tmp_path / "queries.safetensors"),
        str(tmp_path / "corpus"),
        "--device",
        "cuda",
        "--json",
    )
    assert result.exit_code == 0, result.output


def test_report_can_be_built_from_the_library(data) -> None:
    report = verify(str(data / "queries.safetensors"), [str(data / "corpus")], device="cpu", sample_docs=5)
    assert report.passed
    assert report.to_dict()["details"]["setup"]["mode"] == "sample"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_low_precision_baseline_rounds_similarities_to_the_input_dtype(dtype) -> None:
    """The yardstick's GPU baseline: torch.mm in the input dtype, maxima summed in float32."""
    gen = torch.Generator().manual_seed(3)
    q_lens, d_lens = [4, 1, 6], [5, 1, 9, 3]
    queries = torch.nn.functional.normalize(torch.randn(sum(q_lens), 40, generator=gen), dim=1).to(dtype)
    docs = torch.nn.functional.normalize(torch.randn(sum(d_lens), 40, generator=gen), dim=1).to(dtype)
    q_off, d_off = _packed(q_lens), _packed(d_lens)
    ref = float_reference(queries, q_off, docs, d_off, sim_error=0.0, plain_dtype=dtype)
    sims = (queries @ docs.T).float()  # similarities rounded to `dtype`, as plain PyTorch makes them
    expected = torch.stack(
        [
            torch.stack(
                [sims[q_off[i] : q_off[i + 1], d_off[j] : d_off[j + 1]].amax(1).sum() for j in range(4)]
            )
            for i in range(3)
        ]
    )
    assert ref.score_plain is not None
    torch.testing.assert_close(ref.score_plain, expected, rtol=0, atol=1e-6)
    assert float((ref.score_plain.double() - ref.score64).abs().max()) > 1e-5  # coarser than float32


def test_progress_counts_the_pairs_and_quiet_draws_nothing(data, tmp_path) -> None:
    from maxsim_cli.verify import verify

    seen: list[tuple[int, int]] = []
    report = verify(
        str(data / "queries.safetensors"),
        [str(data / "corpus")],
        device="cpu",
        max_tokens=64,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert len(seen) > 1 and seen[-1] == (report.setup["pairs"], report.setup["pairs"])
    result = invoke(
        "verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu", "-q"
    )
    assert result.exit_code == 0 and result.stderr == ""


def test_a_query_folder_is_accepted(data, tmp_path) -> None:
    folder = tmp_path / "queries"
    folder.mkdir()
    (folder / "shard-00000.safetensors").write_bytes((data / "queries.safetensors").read_bytes())
    by_folder = invoke("verify", str(folder), str(data / "corpus"), "--device", "cpu", "--json")
    by_file = invoke(
        "verify", str(data / "queries.safetensors"), str(data / "corpus"), "--device", "cpu", "--json"
    )
    assert by_folder.exit_code == 0, by_folder.output
    assert json.loads(by_folder.stdout)["details"]["setup"]["pairs"] == 6 * 40
    assert json.loads(by_folder.stdout)["max_abs_error"] == json.loads(by_file.stdout)["max_abs_error"]
