"""Why a document scored what it did: for each query token, the document token it matched, their
similarity and its share of the score, exact.

    score(q, d) = sum_i max_j <q_i, d_j>      one term a query token: the similarity of its best match

`explain_hits` scores one query against some documents with the kernels and the inputs a run uses (the
query converted to the corpus's dtype and moved to the scoring device as the engine does it; each document
read alone from its shard) and asks them for each query token's term and winning token: the query's
tokens are scored as one-token queries, whose score is that term, and the argmax names the token (the
lowest index on ties). The terms are the float32 values the kernel adds up: ``Explanation.total`` adds
them in the kernel's order and ``Explanation.exact`` says whether that gives ``score`` bit for bit.

The kernel's order (``Explanation.order``):

- ``sequential``: the torch backend (the CPU) adds a query's terms one after another, from token 0;
- ``pairwise``: the Triton kernel (CUDA) adds them in a fixed pairwise tree (tokens 2i and 2i + 1, then
  the pairs of pairs, ...), by chunks of 128 tokens whose partial sums are then added in order.

Where the bits agree (docs/api.md, "Explanations"): the CPU for float16, bfloat16, float32 and int8
corpora, search and rerank alike (tests/test_explain.py); CUDA float corpora with queries of up to 128
tokens, as far as the Triton kernel's similarities do not depend on its tile shape (the one-token queries
take other tiles than the whole query). Elsewhere the int8 GPU kernels and the chunks of longer queries
add in an order of their own, and the total differs from the score by the rounding of a float32 sum of n
terms: at most about n * 2^-24 * sum_i |term_i|.

ColPali pages: a shard whose metadata holds ``patch_grid`` (and ``patch_start``) maps document tokens to
image patches (docs/format.md), and `Explanation.heatmap` draws a query token's similarities, or the
whole query's shares of the score, over the grid (matplotlib: ``pip install 'maxsim[explain]'``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.shards.format import PATCH_GRID_KEY, PATCH_START_KEY, show_id

if TYPE_CHECKING:
    import torch

    from maxsim_cli.queries import Queries
    from maxsim_cli.shards import Corpus

SEQUENTIAL = "sequential"
PAIRWISE = "pairwise"
# Query rows a program of the Triton kernel sums in one tree (`maxsim_forward`: ROWS is at most 128).
PAIRWISE_CHUNK = 128


class TokenMatch(NamedTuple):
    """One query token's term of the score: the document token it matched (its index within the
    document, the lowest on ties), their similarity (the float32 value the score adds; for int8 corpora
    ``s_q * (s_d * (q8 . d8))`` as the kernels compute it) and its share of the score (similarity /
    score: negative for a negative similarity, None when the score is 0). ``patch`` is the matched token's
    (row, column) in the image's patch grid, None when the shard has no grid or the token is no patch."""

    query_token: int
    doc_token: int
    similarity: float
    share: float | None
    patch: tuple[int, int] | None = None


@dataclass
class Explanation:
    """Why document ``docno`` scored ``score`` for query ``qid``: ``tokens``, one `TokenMatch` per query
    token, whose similarities added in the kernel's ``order`` give ``total``; ``exact`` when that is
    ``score`` bit for bit. ``doc_tokens`` is the document's length, ``shard`` the file that holds it, and
    ``patch_grid`` / ``patch_start`` its shard's patch grid (None without one)."""

    qid: str
    docno: str
    score: float
    tokens: list[TokenMatch]
    doc_tokens: int
    order: str
    total: float
    exact: bool
    shard: str
    patch_grid: tuple[int, int] | None = None
    patch_start: int = 0
    # the query's and the document's vectors as the kernel took them (for `similarity_map`); None when
    # they were not kept
    _vectors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = field(
        default=None, repr=False, compare=False
    )

    def to_dict(self) -> dict[str, Any]:
        """The explanation as JSON-ready types (what ``maxsim explain --format json`` prints and the
        server's ``explanation`` holds); ``patch`` appears only for a shard with a patch grid."""
        tokens = []
        for t in self.tokens:
            item: dict[str, Any] = {
                "query_token": t.query_token,
                "doc_token": t.doc_token,
                "similarity": t.similarity,
                "share": t.share,
            }
            if self.patch_grid is not None:
                item["patch"] = list(t.patch) if t.patch is not None else None
            tokens.append(item)
        out: dict[str, Any] = {
            "qid": self.qid,
            "docno": self.docno,
            "score": self.score,
            "total": self.total,
            "exact": self.exact,
            "order": self.order,
            "doc_tokens": self.doc_tokens,
            "tokens": tokens,
        }
        if self.patch_grid is not None:
            out["patch_grid"] = list(self.patch_grid)
            out["patch_start"] = self.patch_start
        return out

    # ---------------------------------------------------------------------------------- patch grids

    def _grid(self) -> tuple[int, int, int]:
        """(rows, cols, start) of the document's patch grid; `InputError` without one or when the
        document is too short for it."""
        if self.patch_grid is None:
            raise InputError(
                f"{self.shard}: no {PATCH_GRID_KEY} in the shard's metadata, so its tokens cannot be placed "
                "on an image; record the grid when writing the shard (write_shard(..., "
                f"{PATCH_GRID_KEY}=(rows, cols), {PATCH_START_KEY}=first patch token); docs/format.md)"
            )
        rows, cols = self.patch_grid
        need = self.patch_start + rows * cols
        if self.doc_tokens < need:
            raise InputError(
                f"{self.shard}: document {show_id(self.docno)} has {self.doc_tokens} tokens but its "
                f"{PATCH_GRID_KEY} {rows}x{cols} from token {self.patch_start} needs {need}; fix the shard's "
                "metadata"
            )
        return rows, cols, self.patch_start

    def _check_token(self, token: int) -> None:
        if not 0 <= token < len(self.tokens):
            raise UsageError(
                f"token {token}: query {show_id(self.qid)} has {len(self.tokens)} tokens (0 to "
                f"{len(self.tokens) - 1})"
            )

    def patch_map(self, token: int | None = None) -> np.ndarray:
        """A float32 ``[rows, cols]`` map over the document's patch grid: with ``token``, that query
        token's similarity with every patch; without, each patch's share of the score (the shares of the
        query tokens that matched it; tokens that matched no patch are left out)."""
        if token is not None:
            self._check_token(token)
        rows, cols, start = self._grid()
        if token is not None:
            return self.similarities()[token, start : start + rows * cols].reshape(rows, cols)
        shares = np.zeros(rows * cols, dtype=np.float64)
        for t in self.tokens:
            patch = t.doc_token - start
            if 0 <= patch < rows * cols and t.share is not None:
                shares[patch] += t.share
        return shares.astype(np.float32).reshape(rows, cols)

    def similarities(self) -> np.ndarray:
        """Every query token's similarity with every document token, float32 ``[query tokens, doc
        tokens]``, from the vectors as the kernel took them (computed here in float64, then rounded: for
        drawing; the exact terms are ``tokens``)."""
        if self._vectors is None:
            raise UsageError("this explanation kept no vectors; explain again with vectors=True")
        query, doc, query_scales, doc_scales = self._vectors
        q = _as_float64(query, query_scales)
        d = _as_float64(doc, doc_scales)
        return (q @ d.T).astype(np.float32)

    def heatmap(self, path: str | os.PathLike[str], token: int | None = None) -> None:
        """Write a PNG heatmap over the document's patch grid (`patch_map`): ``token``'s similarities
        with the patches (its match framed), or the whole query's shares of the score. Needs matplotlib
        (``pip install 'maxsim[explain]'``) and a shard with a patch grid; written atomically."""
        values = self.patch_map(token)
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Rectangle
        except ImportError:
            raise UsageError("heatmaps need matplotlib: pip install 'maxsim[explain]'") from None
        rows, cols = values.shape
        figure = Figure(figsize=(6.0, max(2.0, 6.0 * rows / cols)), dpi=100)
        axes = figure.add_subplot()
        image = axes.imshow(values, cmap="viridis", interpolation="nearest")
        if token is None:
            on_patches = float(values.sum(dtype=np.float64))
            title = f"{self.qid} / {self.docno}: share of the score by patch ({on_patches:.1%} on patches)"
            label = "share of the score"
        else:
            match = self.tokens[token]
            title = f"{self.qid} / {self.docno}: query token {token}, similarity with each patch"
            label = "similarity"
            if match.patch is not None:  # its best match, framed
                r, c = match.patch
                axes.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
        axes.set_title(title, fontsize=9)
        axes.set_xlabel("patch column")
        axes.set_ylabel("patch row")
        figure.colorbar(image, ax=axes, label=label, shrink=0.8)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        from maxsim_cli.shards.files import OutputFile

        with OutputFile(path) as out:
            out.write(buffer.getvalue())


def _as_float64(values: torch.Tensor, scales: torch.Tensor | None) -> np.ndarray:
    import torch

    out = values.detach().to("cpu", torch.float64)
    if scales is not None:
        out = out * scales.detach().to("cpu", torch.float64)[:, None]
    return out.numpy()


# --------------------------------------------------------------------------------------------------
# summation orders


def kernel_order(corpus: Corpus, device: torch.device, backend: str) -> str:
    """The order in which the kernel that scores ``corpus`` on ``device`` adds a query's terms (module
    doc): pairwise for the Triton kernel of float corpora, else sequential."""
    from maxsim_kernels import resolve_backend

    triton = resolve_backend(backend, device) == "triton"
    return PAIRWISE if triton and corpus.quantization == "none" else SEQUENTIAL


def add_in_order(terms: np.ndarray, order: str) -> np.float32:
    """A query's float32 ``terms`` added as the kernel adds them: one after another from 0.0
    (``sequential``), or by chunks of `PAIRWISE_CHUNK` summed in a pairwise tree, the chunks then added
    one after another (``pairwise``)."""
    values = np.asarray(terms, dtype=np.float32)
    if order == SEQUENTIAL:
        total = np.float32(0.0)
        for value in values:
            total = np.float32(total + value)
        return total
    total = np.float32(0.0)
    for first in range(0, len(values), PAIRWISE_CHUNK):
        level = values[first : first + PAIRWISE_CHUNK]
        width = 1 << max(0, len(level) - 1).bit_length()  # zeros up to a power of two change no sum
        level = np.concatenate([level, np.zeros(width - len(level), dtype=np.float32)])
        while len(level) > 1:
            level = level[0::2] + level[1::2]  # float32 + float32: one float32 rounding each
        total = np.float32(total + level[0]) if first else level[0]
    return np.float32(total)


def _same_bits(a: float, b: float) -> bool:
    return bool(np.float32(a).view(np.uint32) == np.float32(b).view(np.uint32))


# --------------------------------------------------------------------------------------------------
# explaining


def explain(
    queries: str | os.PathLike[str] | Queries | tuple[Sequence[str | int], Any],
    corpus: Corpus | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    qid: str,
    docno: str,
    *,
    device: str = "auto",
    backend: str = "auto",
) -> Explanation:
    """Why document ``docno`` scores what it does for query ``qid``: for each query token, the document
    token it matched, their similarity and its share of the score (an `Explanation`: ``.tokens``,
    ``.to_dict()``, ``.heatmap(path)``). ``queries`` and ``corpus`` as `maxsim_cli.search` takes them (a
    path is opened here and closed again); only that document is read. An unknown qid or docno is an
    `InputError`. `maxsim_cli.Run.explain` does the same for a row of a run.

    >>> e = explain("sample_data/queries.safetensors", "sample_data/corpus", "q003", "gcc", device="cpu")
    >>> e.exact, [t.doc_token for t in e.tokens]
    (True, [3, 4, 5])
    """
    from maxsim_cli.queries import Queries, read_queries
    from maxsim_cli.shards import Corpus, open_corpus

    if isinstance(queries, tuple) and len(queries) == 2:
        queries = Queries.from_embeddings(queries[0], queries[1])
    elif isinstance(queries, (str, os.PathLike)):
        queries = read_queries(queries)
    if not isinstance(queries, Queries):
        raise UsageError(
            f"queries: got {type(queries).__name__}; pass a query shard path, a Queries, or an "
            "(ids, embeddings) pair"
        )
    if isinstance(corpus, Corpus):
        return explain_hits(queries, corpus, str(qid), [str(docno)], device=device, backend=backend)[0]
    paths = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    with open_corpus(paths) as opened:
        return explain_hits(queries, opened, str(qid), [str(docno)], device=device, backend=backend)[0]


def explain_hits(
    queries: Queries,
    corpus: Corpus,
    qid: str,
    docnos: Sequence[str],
    *,
    device: str = "auto",
    backend: str = "auto",
    scores: Sequence[float | None] | None = None,
    vectors: bool = True,
) -> list[Explanation]:
    """An `Explanation` of each of ``docnos`` for query ``qid`` of ``queries``, scored against ``corpus``
    on ``device`` (``auto``: where the corpus is resident, else CUDA when there is one) with ``backend``
    (as `maxsim_cli.search` takes them). ``scores``: each document's score in a run (None: scored here),
    which the explanation's total is compared with. ``vectors=False`` keeps no vectors (no heatmaps).

    Only those documents are read, each alone from its shard. An unknown qid or docno is an `InputError`.
    """
    import torch

    from maxsim_cli.devices import check_backend_option
    from maxsim_cli.scoring.resources import device_queries, query_embeddings
    from maxsim_cli.shards import DocBatch, check_same_dim

    row = _query_index(queries, qid)
    if not docnos:
        return []
    check_same_dim(queries.batch, queries.name, corpus)
    located = corpus.candidate_index(docnos)
    missing = [d for d in docnos if d not in located]
    if missing:
        raise InputError(
            f"corpus ({_corpus_name(corpus)}): no document {show_id(missing[0])}"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; check the docno"
        )
    if scores is not None and len(scores) != len(docnos):
        raise ValueError("explain_hits: one score (or None) a docno")
    places = [located[d] for d in docnos]
    dev = _device(corpus, device, places)
    check_backend_option(backend, dev)
    order = kernel_order(corpus, dev, backend)

    a, b = int(queries.offsets[row]), int(queries.offsets[row + 1])
    scales = queries.scales[a:b] if queries.scales is not None else None
    one = DocBatch([qid], queries.embeddings[a:b], torch.tensor([0, b - a], dtype=torch.int64), scales)
    q_emb = query_embeddings(one, corpus.dtype, corpus.quantization)
    scaled = corpus.quantization != "none"
    q_dev, q_scales = device_queries(q_emb, dev, scaled)

    docs = [corpus.shards[s].read_docs(d, d + 1) for s, d in places]
    lengths = [doc.num_tokens for doc in docs]
    d_offsets = torch.zeros(len(docs) + 1, dtype=torch.int64)
    d_offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    d_emb = torch.cat([doc.embeddings for doc in docs]).to(dev)
    d_scales = torch.cat([doc.scales for doc in docs]).to(dev) if scaled else None  # type: ignore[misc]
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # Triton launches on the calling thread's device (as the engine)
    from maxsim_kernels import maxsim_varlen

    kwargs = {"backend": backend, "doc_scales": d_scales, "query_scales": q_scales}
    tq = b - a
    # each query token alone: a one-token query's score is its term (0.0 + term), its argmax its match
    terms, argmax = maxsim_varlen(
        q_dev, torch.arange(tq + 1, dtype=torch.int64), d_emb, d_offsets, return_argmax=True, **kwargs
    )
    whole = None
    if scores is None or any(score is None for score in scores):  # the scores no run gave: scored here
        whole = maxsim_varlen(q_dev, torch.tensor([0, tq], dtype=torch.int64), d_emb, d_offsets, **kwargs)
        whole = whole.to(torch.float32).cpu().numpy()[0]
    terms = terms.to(torch.float32).cpu().numpy()
    argmax = argmax.cpu().numpy()

    # the query's vectors as the kernel scored them, for `Explanation.similarities`: float queries
    # against an int8 corpus are quantized per token by the kernel, as here
    kept_query = (q_dev, q_scales)
    if vectors and scaled and q_scales is None:
        from maxsim_kernels.int8_host import quantize_per_token

        kept_query = quantize_per_token(q_dev, backend="torch")
    out = []
    for j, (docno, (s, _)) in enumerate(zip(docnos, places, strict=True)):
        info = corpus.shards[s].info
        given = scores[j] if scores is not None else None
        score = float(np.float32(whole[j] if given is None else given))  # type: ignore[index]
        total = add_in_order(terms[:, j], order)
        grid, start = info.patch_grid, info.patch_start
        matches = []
        for i in range(tq):
            term, winner = terms[i, j], int(argmax[i, j])
            matches.append(
                TokenMatch(
                    i,
                    winner,
                    float(term),
                    float(term) / score if score != 0 else None,
                    _patch(winner, grid, start),
                )
            )
        kept = None
        if vectors:
            t0, t1 = int(d_offsets[j]), int(d_offsets[j + 1])
            doc_scales = d_scales[t0:t1] if d_scales is not None else None
            kept = (kept_query[0], d_emb[t0:t1], kept_query[1], doc_scales)
        out.append(
            Explanation(
                qid=qid,
                docno=docno,
                score=score,
                tokens=matches,
                doc_tokens=lengths[j],
                order=order,
                total=float(total),
                exact=_same_bits(total, score),
                shard=info.path,
                patch_grid=grid,
                patch_start=start,
                _vectors=kept,
            )
        )
    return out


def _patch(token: int, grid: tuple[int, int] | None, start: int) -> tuple[int, int] | None:
    if grid is None:
        return None
    rows, cols = grid
    patch = token - start
    return divmod(patch, cols) if 0 <= patch < rows * cols else None


def _query_index(queries: Queries, qid: str) -> int:
    ids = queries.ids
    try:
        return ids.index(qid)
    except ValueError:
        example = f" (it has {len(ids)}, e.g. {show_id(ids[0])})" if ids else " (it has none)"
        raise InputError(f"{queries.name}: no query {show_id(qid)}{example}; check the qid") from None


def _corpus_name(corpus: Corpus) -> str:
    """The corpus as messages name it: its shard, or its first shard and how many more (an in-memory
    corpus: its name)."""
    return corpus.name


def _device(corpus: Corpus, device: str, places: Sequence[tuple[int, int]]) -> torch.device:
    """The scoring device: ``auto`` is where the corpus is resident (a corpus spread over several
    devices: the one holding the first document's shard), else `resolve_device`'s."""
    from maxsim_cli.devices import resolve_device

    if device == "auto":
        if corpus.residency is not None:
            return corpus.residency.device
        if corpus.placement and places:
            shard = places[0][0]
            for part in corpus.placement:
                if shard in part.shards:
                    return part.device
    return resolve_device(device)
