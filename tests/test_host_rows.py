"""A rerank on a GPU against a corpus resident in host memory (`maxsim_cli.scoring.host_rows`): only the
candidates' rows are gathered, staged and scored. On the CPU the gather and the launch over the gathered
rows are checked against the launch on the resident corpus in place, bit for bit; on a GPU (marked) the
library's calls: a two-stage search whose exact tier is resident on the host, and a rerank."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from tierlib import quantize

from maxsim_cli import open_corpus, rerank, search
from maxsim_cli.queries import read_queries
from maxsim_cli.scoring import direct, host_rows
from maxsim_cli.scoring.pipeline import BatchPlan, BatchStream
from maxsim_cli.scoring.request import ScoreRequest
from maxsim_cli.scoring.staging import gathered_offsets
from maxsim_cli.scoring.two_stage import exact_on_scan_device
from maxsim_cli.shards import write_shard
from maxsim_cli.shards.readers import SafetensorsShard

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "sample_data")
QUERIES = os.path.join(SAMPLE, "queries.safetensors")
CORPUS = os.path.join(SAMPLE, "corpus")


@pytest.fixture(scope="module")
def int8_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("int8") / "int8")
    quantize(CORPUS, folder, 8)
    return folder


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """float32 documents of 1-30 tokens in 3 shards, and 4 queries of 1-6 tokens."""
    root = tmp_path_factory.mktemp("ragged")
    gen = torch.Generator().manual_seed(11)
    for s in range(3):
        lengths = torch.randint(1, 31, (25,), generator=gen).tolist()
        docs = [torch.randn(n, 24, generator=gen) for n in lengths]
        write_shard(str(root / f"s{s}.safetensors"), [f"s{s}d{i}" for i in range(25)], docs)
    queries = str(root / "queries.safetensors")
    lengths = [1, 6, 3, 5]
    write_shard(queries, [f"q{i}" for i in range(4)], [torch.randn(n, 24, generator=gen) for n in lengths])
    return queries, str(root)


def _candidates(num_queries: int, num_docs: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query's candidates, in no order, some documents shared between queries."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, min(num_docs, 40), num_queries)
    docs = np.concatenate([rng.choice(num_docs, int(c), replace=False) for c in counts]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return offsets, docs


@pytest.mark.parametrize("which", ["fp16", "int8", "ragged"])
def test_gathered_rows_score_as_the_resident_corpus_in_place(which, int8_corpus, ragged, monkeypatch):
    """The candidates' rows gathered in small pieces (many `PIECE_BYTES` pieces, documents whole) and
    scored in one launch over the gathered rows: the scores of the launch on the resident corpus in
    place, bit for bit; the bytes staged are the candidates' rows."""
    queries_path, corpus_path = {
        "fp16": (QUERIES, CORPUS),
        "int8": (QUERIES, int8_corpus),
        "ragged": ragged,
    }[which]
    monkeypatch.setattr(host_rows, "PIECE_BYTES", 3000)
    queries = read_queries(queries_path).batch
    with open_corpus(corpus_path) as corpus:
        corpus.to("cpu")
        residency = corpus.residency
        assert host_rows.supported(corpus, residency)
        offsets, docs = _candidates(len(queries.ids), len(corpus), seed=len(which))
        in_place = direct.candidate_scores(corpus, residency, queries, offsets, docs)
        staged, nbytes = host_rows.candidate_scores(
            corpus, residency, queries, offsets, docs, torch.device("cpu")
        )
        assert in_place is not None
        assert (
            staged.dtype == np.float32
            and staged.view(np.uint32).tolist() == in_place.view(np.uint32).tolist()
        )
        unique = np.unique(docs)
        lengths = residency.host_offsets[unique + 1] - residency.host_offsets[unique]
        per_token = residency.embeddings.shape[1] * residency.embeddings.element_size()
        per_token += 4 if residency.scales is not None else 0
        assert nbytes == int(lengths.sum()) * per_token == host_rows.staged_bytes(residency, unique)


def test_gather_rows_in_pieces_keeps_documents_whole(monkeypatch):
    """Pieces of whole documents, gathered by the gathering threads and handed over in order."""
    host_offsets = np.array([0, 3, 3, 10, 11, 20, 26], dtype=np.int64)
    embeddings = torch.arange(26 * 4, dtype=torch.float32).view(26, 4)
    residency = type(
        "R", (), {"embeddings": embeddings, "scales": torch.arange(26.0), "host_offsets": host_offsets}
    )
    docs = np.array([4, 0, 1, 2, 5], dtype=np.int64)
    starts, offsets = gathered_offsets(host_offsets, docs)
    assert offsets.tolist() == [0, 9, 12, 12, 19, 25]
    monkeypatch.setattr(host_rows, "PIECE_BYTES", 20 * 5)  # 5 rows of 20 bytes (4 float32 + a scale)
    monkeypatch.setattr(host_rows, "GATHER_THREADS", 2)
    pieces = []
    out, out_scales = torch.zeros(25, 4), torch.zeros(25)
    host_rows.stage_rows(residency, starts, offsets, out, out_scales, lambda t0, t1: pieces.append((t0, t1)))
    rows = torch.cat([torch.arange(host_offsets[d], host_offsets[d + 1]) for d in docs])
    assert torch.equal(out, embeddings[rows]) and torch.equal(out_scales, rows.to(torch.float32))
    assert pieces[0][0] == 0 and pieces[-1][1] == 25
    assert all(a[1] == b[0] for a, b in zip(pieces[:-1], pieces[1:], strict=True))
    assert {t for piece in pieces for t in piece} <= set(offsets.tolist()) and len(pieces) > 1


@pytest.mark.parametrize("which", ["fp16", "int8"])
def test_a_batch_stream_gathers_from_the_host_residency_what_it_reads_from_the_files(which, int8_corpus):
    """The engine's streamed batches of a corpus resident on the host (``host_residency``, which the engine
    passes on CUDA) are gathered from it: the rows, scales, offsets and side data the files give."""
    path = CORPUS if which == "fp16" else int8_corpus
    with open_corpus(path) as corpus:
        sizes = [s.num_docs for s in corpus.shards]
        plans = [
            BatchPlan(0, [(0, 2, 9)], 7, 0, side=np.arange(5, dtype=np.int64), side_len=5),
            BatchPlan(
                1, [(0, np.array([40, 3, 17], dtype=np.int64)), (len(sizes) - 1, np.array([1, 0]))], 5, 0
            ),
        ]
        for plan in plans:
            plan.num_tokens = sum(
                int(
                    np.diff(corpus.shards[p[0]].offsets)[np.arange(p[1], p[2]) if len(p) == 3 else p[1]].sum()
                )
                for p in plan.parts
            )

        def batches(host_residency):
            info = corpus.shards[0].info
            stream = BatchStream(
                corpus.shards,
                plans,
                dim=info.width,
                dtype=getattr(torch, info.dtype),
                scaled=info.scaled,
                device=torch.device("cpu"),
                reader_threads=1,
                host_residency=host_residency,
            )
            out = []
            for b in stream:  # a batch's tensors are its slot's, refilled later: cloned
                scales = None if b.scales is None else b.scales.clone()
                side = None if b.side is None else b.side.tolist()
                out.append((b.embeddings.clone(), scales, b.host_offsets.tolist(), side))
            return out

        from_files = batches(None)
        corpus.to("cpu")
        gathered = batches(corpus.residency)
    for (emb, scales, offsets, side), (emb2, scales2, offsets2, side2) in zip(
        from_files, gathered, strict=True
    ):
        assert torch.equal(emb, emb2) and offsets == offsets2 and side == side2
        assert (scales is None and scales2 is None) or torch.equal(scales, scales2)


def test_rows_past_the_staging_limit_are_left_to_the_engine(monkeypatch):
    queries = read_queries(QUERIES).batch
    with open_corpus(CORPUS) as corpus:
        corpus.to("cpu")
        offsets, docs = _candidates(len(queries.ids), len(corpus), seed=3)
        monkeypatch.setattr(host_rows, "MAX_STAGED_BYTES", 1000)
        staged = host_rows.candidate_scores(
            corpus, corpus.residency, queries, offsets, docs, torch.device("cpu")
        )
        assert staged is None


def test_the_exact_stage_of_a_host_tier_goes_to_the_scan_gpu():
    """With device auto, an exact tier resident on the host is scored on the GPU the scan ran on; an
    exact tier elsewhere, a device named, or a scan on the CPU keep the request as it is."""
    request = ScoreRequest(queries="q", corpus=(CORPUS,), candidates="the top 10 of c")
    with open_corpus(CORPUS) as exact:
        assert exact_on_scan_device(request, exact, "cuda:0") is request  # not resident
        exact.to("cpu")
        assert exact_on_scan_device(request, exact, "cuda:1").device == "cuda:1"
        assert exact_on_scan_device(request, exact, "cpu") is request
        named = ScoreRequest(queries="q", corpus=(CORPUS,), device="cpu")
        assert exact_on_scan_device(named, exact, "cuda:0") is named


# --------------------------------------------------------------------------------------------------
# on a GPU


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tier4(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("tier4") / "bits4")
    quantize(CORPUS, folder, 4, device="cuda" if torch.cuda.is_available() else "cpu")
    return folder


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_two_stage_with_the_exact_tier_on_the_host_gives_the_exact_scores(tier4, device):
    """The exact tier resident on the host, the compressed one on the GPU: the exact stage stages the
    candidates' rows on the GPU (with device auto too) and returns the scores of the exact search."""
    expected = search(QUERIES, tier4, k=10, exact_from=CORPUS, depth=50, device="cuda")
    full = {q: dict(rows) for q, rows in search(QUERIES, CORPUS, k=400, device="cuda").to_dict().items()}
    with open_corpus(tier4) as compressed, open_corpus(CORPUS) as exact:
        compressed.to("cuda")
        exact.to("cpu")
        run = search(QUERIES, compressed, k=10, exact_from=exact, depth=50, device=device)
    assert run.to_dict() == expected.to_dict()
    for qid, rows in run.to_dict().items():
        assert all(score == full[qid][docno] for docno, score in rows)  # bit for bit
    assert run.stats.device.startswith("cuda") and run.stats.extra.get("host_rows") is True
    assert run.stats.extra["two_stage"]["exact_bytes_read"] > 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "staged"])
@pytest.mark.parametrize("corpus_kind", ["fp16", "int8"])
def test_a_gpu_rerank_of_a_host_resident_corpus_gives_the_streamed_run(
    corpus_kind, mapped, int8_corpus, monkeypatch
):
    """The library's rerank on CUDA of a corpus resident on the host: the run of the streamed corpus, read
    by the GPU from the mapped rows (the mapping made once, released with the residency) or, with
    ``MAXSIM_MAP_HOST=0``, through the page-locked staging buffer, kept and reused; past
    `MAX_STAGED_BYTES` the engine gives the same run."""
    monkeypatch.setenv("MAXSIM_MAP_HOST", "1" if mapped else "0")
    path = CORPUS if corpus_kind == "fp16" else int8_corpus
    first = search(QUERIES, path, k=60, device="cuda").to_dict()
    candidates = {q: [(d, 0.0) for d, _ in rows[::-1]] for q, rows in first.items()}
    streamed = rerank(QUERIES, path, candidates, device="cuda").to_dict()
    with open_corpus(path) as corpus:
        corpus.to("cpu")
        run = rerank(QUERIES, corpus, candidates, device="cuda")
        assert run.to_dict() == streamed and run.stats.extra.get("host_rows") is True
        staging = corpus.residency.staging
        assert staging is not None and (staging.mapping is not None) == mapped
        assert corpus.residency.embeddings.is_pinned() == mapped
        assert staging.buffer.is_pinned() != mapped  # the buffer only where the rows are not mapped
        kept = staging.mapping or staging.buffer.data_ptr()
        assert rerank(QUERIES, corpus, candidates, device="cuda").to_dict() == streamed
        assert (staging.mapping or staging.buffer.data_ptr()) == kept  # reused, not made again
        # too many rows to stage, or a memory budget: the engine, which gathers its batches from the host
        # copy too (the corpus's files are not read; the queries are read before)
        queries = read_queries(QUERIES)
        monkeypatch.setattr(host_rows, "MAX_STAGED_BYTES", 1000)

        def no_reads(*args, **kwargs):
            raise AssertionError("read from the files")

        for name in ("read_rows_into", "read_docs_into", "read_doc_indices", "read_docs"):
            monkeypatch.setattr(SafetensorsShard, name, no_reads)
        run = rerank(queries, corpus, candidates, device="cuda")
        assert run.to_dict() == streamed and "host_rows" not in run.stats.extra
        run = rerank(queries, corpus, candidates, device="cuda", max_memory="1GiB")
        assert run.to_dict() == streamed and run.stats.bytes_read > 0


@pytest.mark.gpu
@needs_gpu
def test_the_mapping_goes_with_the_residency(monkeypatch):
    """A corpus's host residency dropped (made resident elsewhere): its memory is unlocked."""
    monkeypatch.setenv("MAXSIM_MAP_HOST", "1")
    queries = read_queries(QUERIES).batch
    with open_corpus(CORPUS) as corpus:
        corpus.to("cpu")
        offsets, docs = _candidates(len(queries.ids), len(corpus), seed=5)
        host_rows.candidate_scores(corpus, corpus.residency, queries, offsets, docs, torch.device("cuda:0"))
        embeddings = corpus.residency.embeddings
        assert embeddings.is_pinned()
        corpus.to("cuda")
        import gc

        gc.collect()
        assert not embeddings.is_pinned()


# --------------------------------------------------------------------------------------------------
# the gathering kernel: under the interpreter on the CPU, on the device on a GPU


def _kernel_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.parametrize(
    "dtype,width,scaled",
    [(torch.float16, 128, False), (torch.float32, 24, False), (torch.int8, 8, True), (torch.uint8, 3, False)],
)
def test_gather_rows_kernel_copies_each_documents_rows(dtype, width, scaled):
    """Each document's rows (and scales) land at its place in the packed output, whatever their count
    against the kernel's block of rows (none, one, a block's edge, several blocks), in any order, with
    rows as 32-bit words or, where a row's bytes are not a multiple of 4, as bytes; rows past the last
    document are not written."""
    from maxsim_kernels.gather_rows import BLOCK_ROWS, gather_rows

    device = _kernel_device()
    gen = torch.Generator().manual_seed(width)
    lengths = [0, 1, BLOCK_ROWS - 1, BLOCK_ROWS, BLOCK_ROWS + 1, 2 * BLOCK_ROWS + 5, 3, 0, 7]
    host_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(host_offsets[-1])
    if dtype.is_floating_point:
        src = torch.randn(total, width, generator=gen).to(dtype)
    else:
        src = torch.randint(-128 if dtype == torch.int8 else 0, 128, (total, width), generator=gen).to(dtype)
    src_scales = torch.rand(total, generator=gen) if scaled else None
    docs = np.array([5, 0, 2, 8, 1, 4, 3, 7], dtype=np.int64)
    starts, offsets = gathered_offsets(host_offsets, docs)
    rows = int(offsets[-1])
    out = torch.full((rows + 3, width), 7, dtype=dtype, device=device)
    out_scales = torch.full((rows + 3,), -1.0, device=device) if scaled else None
    index = torch.from_numpy(np.concatenate([starts, offsets])).to(device)
    src_dev = src.to(device)
    scales_dev = src_scales.to(device) if src_scales is not None else None
    gather_rows(
        src_dev, index[: len(docs)], index[len(docs) :], out, scales_dev, out_scales, max_rows=max(lengths)
    )
    picked = torch.cat([torch.arange(host_offsets[d], host_offsets[d + 1]) for d in docs])
    assert torch.equal(out[:rows].cpu(), src[picked]) and bool((out[rows:] == 7).all())
    if scaled:
        assert torch.equal(out_scales[:rows].cpu(), src_scales[picked])
        assert bool((out_scales[rows:] == -1).all())


def test_host_chunks_cover_the_range_and_share_no_page():
    from maxsim_kernels.gather_rows import _PAGE, _chunks

    cases = [(4096 * 3 + 100, 10 * 4096 + 7, 3 * 4096), (8192, 4096, 1 << 20), (5, 3, 4096)]
    for address, nbytes, chunk in cases:
        pieces = _chunks(address, nbytes, chunk)
        assert pieces[0][0] == address and sum(size for _, size in pieces) == nbytes
        assert all(a + size == b for (a, size), (b, _) in zip(pieces[:-1], pieces[1:], strict=True))
        assert all(a % _PAGE == 0 for a, _ in pieces[1:])
        assert all(size <= chunk + _PAGE for _, size in pieces)


@pytest.mark.gpu
@needs_gpu
def test_the_gpu_reads_mapped_host_rows_past_2_31_words():
    """Rows of a host tensor mapped for the GPU (`map_host`), read by the kernel in place: documents at the
    start and past 2^31 32-bit words (8.6 GB of fp16 rows of dim 128); the memory is unlocked on release."""
    from maxsim_kernels.gather_rows import gather_rows, map_host

    width = 128
    total = (1 << 25) + 4096  # rows of 64 words: the last 4096 start past 2^31 words
    src = torch.empty((total, width), dtype=torch.float16)
    gen = torch.Generator().manual_seed(3)
    ends = [0, 40, 41, 41 + 300, total - 4000, total - 3900, total - 5, total]
    host_offsets = np.array(ends, dtype=np.int64)
    for a, b in zip(host_offsets[:-1], host_offsets[1:], strict=True):
        if b - a <= 4000:
            src[a:b] = torch.randn(int(b - a), width, generator=gen).to(torch.float16)
    mapping = map_host([src])
    assert mapping is not None and src.is_pinned()
    try:
        docs = np.array([6, 0, 4, 1, 2], dtype=np.int64)
        starts, offsets = gathered_offsets(host_offsets, docs)
        index = torch.from_numpy(np.concatenate([starts, offsets])).cuda()
        out = torch.empty((int(offsets[-1]), width), dtype=torch.float16, device="cuda")
        longest = int(np.diff(offsets).max())
        gather_rows(src, index[: len(docs)], index[len(docs) :], out, max_rows=longest)
        picked = torch.cat([torch.arange(host_offsets[d], host_offsets[d + 1]) for d in docs])
        assert torch.equal(out.cpu(), src[picked])
    finally:
        mapping.release()
    assert not src.is_pinned()


def test_gather_rows_kernel_builds_for_sm90_with_16_byte_accesses(sm90_build):
    """The kernel compiles for Hopper in each variant, and an fp16 row of dim 128 (64 words) moves in
    16-byte loads and stores (the interpreter takes code the compiler refuses, and says nothing of width)."""
    built = sm90_build(
        """
from maxsim_kernels import gather_rows as m
out = {}
for words, scaled in ((64, False), (2, True), (3, False)):
    word = "*i32" if words != 3 else "*u8"
    sig = {"src": word, "src_scales": "*fp32" if scaled else word, "out": word,
           "out_scales": "*fp32" if scaled else word, "starts": "*i64", "offsets": "*i64",
           "WORDS": "constexpr", "WORDS_P2": "constexpr", "BLOCK_ROWS": "constexpr", "SCALED": "constexpr"}
    const = dict(WORDS=words, WORDS_P2=triton.next_power_of_2(words), BLOCK_ROWS=m.BLOCK_ROWS, SCALED=scaled)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    k = triton.compile(ASTSource(m._gather_rows_kernel, sig, const, attrs=aligned), target=SM90,
                       options={"num_warps": m.NUM_WARPS})
    ptx = k.asm["ptx"]
    out[f"{words} {scaled}"] = [ptx.count("ld.global.v4"), ptx.count("st.global.v4"), resource_usage(k)]
print(json.dumps(out))
"""
    )
    assert len(built) == 3
    loads, stores, _usage = built["64 False"]
    assert loads > 0 and stores > 0, built
    assert all(not usage or "LOCAL:0" in usage for _, _, usage in built.values()), built


def test_gather_rows_refuses_rows_of_another_shape_or_dtype():
    """The gathering launcher's arguments are checked before any launch: one-line ValueErrors."""
    from maxsim_kernels.gather_rows import gather_rows, map_host
    from maxsim_kernels.maxsim_codes import int4_to_int8

    index = torch.zeros(2, dtype=torch.int64)
    src = torch.zeros(4, 8, dtype=torch.float16)
    for out in (torch.zeros(4, 8, dtype=torch.float32), torch.zeros(4, 6, dtype=torch.float16)):
        with pytest.raises(ValueError, match="one width and dtype"):
            gather_rows(src, index[:1], index, out, max_rows=1)
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(torch.zeros(8, 4, dtype=torch.float16).t(), index[:1], index, src, max_rows=1)
    with pytest.raises(ValueError, match="both, or neither"):
        gather_rows(src, index[:1], index, src.clone(), torch.ones(4), max_rows=1)
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        map_host([src.t()])
    with pytest.raises(ValueError, match="out must be int8"):
        int4_to_int8(torch.zeros(3, 4, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.int16))
