"""`maxsim quantize`: float shards -> int8 shards with per-token symmetric scales, and what it costs in
ranking quality.

Each token vector x (dim values) becomes int8 codes and one fp32 scale (`quantize_per_token`):

    scale = absmax(x) / 127   (1 for an all-zero token)      codes = clamp(round_half_even(x / scale), ±127)

so x ~= scale * codes with at most scale / 2 error per value, and a shard's bytes per token go from
dim * itemsize to dim + 4 (fp16, dim 128: 256 -> 132 bytes, ratio 1.94).

The conversion streams: one output shard per input shard, same file name and container, written batch
by batch (at most `batch_tokens` tokens in memory), into a temporary directory beside OUTDIR that is
renamed to OUTDIR only once every shard and the `index.json` manifest are complete; any failure removes
it. Ids, the normalized flag and the encoder name are kept.

Quality report: the same queries score the same sample of documents twice, in the source precision
(float kernel, fp32 accumulation) and in int8 (int8 x int8 kernel, queries quantized per token), and
the two rankings are compared per query with `maxsim_cli.agreement`: top-10 and top-100 overlap and
Kendall tau-b over all sampled documents. Without a query file the queries are pseudo-queries drawn from
the corpus itself: up to 32 token vectors of a randomly chosen document.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from maxsim_cli import codecs
from maxsim_cli.agreement import ranking_agreement
from maxsim_cli.devices import resolve_device
from maxsim_cli.errors import InputError, UsageError
from maxsim_cli.lifeline import commit_point
from maxsim_cli.queries import read_queries
from maxsim_cli.shards import (
    MANIFEST_NAME,
    SHARD_SUFFIXES,
    Corpus,
    DocBatch,
    ShardInfo,
    ShardWriter,
    check_kernel_dim,
    open_corpus,
    staging_dir,
    write_manifest,
)
from maxsim_cli.shards.files import OutputWriteError, check_output, swap_corpus_files, write_error
from maxsim_cli.shards.id_index import ID_INDEX_SUFFIX, index_names
from maxsim_cli.units import format_count, format_size

DEFAULT_BATCH_TOKENS = 1 << 18  # 262144 tokens: 128 MiB of fp32 at dim 128, the largest transient
PSEUDO_QUERY_TOKENS = 32  # the query length ColBERT models use
OVERLAP_DEPTHS = (10, 100)


@dataclass(frozen=True)
class QualityReport:
    """Ranking agreement of int8 with the source precision on a sample (means and minima over queries)."""

    queries: int
    docs: int
    pseudo_queries: bool
    seed: int
    top10_overlap_mean: float
    top10_overlap_min: float
    top100_overlap_mean: float
    top100_overlap_min: float
    kendall_tau_mean: float
    kendall_tau_min: float

    def summary(self) -> str:
        what = "pseudo-queries from the corpus" if self.pseudo_queries else "queries"
        return (
            f"quality vs source precision ({format_count(self.queries)} {what} x "
            f"{format_count(self.docs)} sampled docs, "
            f"seed {self.seed}): "
            f"top-10 overlap {self.top10_overlap_mean:.4f} (min {self.top10_overlap_min:.2f}), "
            f"top-100 overlap {self.top100_overlap_mean:.4f} (min {self.top100_overlap_min:.2f}), "
            f"Kendall tau-b {self.kendall_tau_mean:.4f} (min {self.kendall_tau_min:.4f})"
        )


@dataclass
class QuantizeReport:
    """What `quantize_corpus` wrote and measured."""

    output_dir: str
    shards: list[ShardInfo]
    num_docs: int
    num_tokens: int
    source_bytes: int  # bytes of the input shard files
    output_bytes: int  # bytes of the output shard files (manifest excluded)
    quality: QualityReport | None = None
    source_dtype: str = ""
    dim: int = 0
    quantization: str = "int8-per-token"
    num_centroids: int = 0  # --bits 2: centroids of the codebook

    @property
    def compression_ratio(self) -> float:
        return self.source_bytes / self.output_bytes if self.output_bytes else float("nan")

    def summary(self) -> str:
        return (
            f"quantized {format_count(self.num_docs)} documents ({format_count(self.num_tokens)} tokens, "
            f"dim {self.dim}) from "
            f"{self.source_dtype} to {_LABELS[self.quantization]} in {len(self.shards)} shard(s) -> "
            f"{self.output_dir}: "
            f"{format_size(self.source_bytes)} -> {format_size(self.output_bytes)}, "
            f"compression ratio {self.compression_ratio:.2f}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "output_dir": self.output_dir,
            "shards": [os.path.basename(s.path) for s in self.shards],
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
            "dim": self.dim,
            "source_dtype": self.source_dtype,
            "quantization": self.quantization,
            "num_centroids": self.num_centroids,
            "source_bytes": self.source_bytes,
            "output_bytes": self.output_bytes,
            "compression_ratio": self.compression_ratio,
            "quality": None if self.quality is None else asdict(self.quality),
        }


# --bits 2's codec by default: int2 ranks as well as residual2 or better at the same 36 bytes a token, needs
# no k-means (nor fastkmeans), and scans faster (docs/two-stage.md, "Two 2-bit codecs")
DEFAULT_CODEC = "int2"
_LABELS = {
    "int8-per-token": "int8",
    "int4-per-token": "4-bit codes",
    "residual2-kmeans": "2-bit residual codes",
    "int2-grid": "2-bit grid codes",
}
# host bytes a k-means sample token costs at most, per value: the fp32 sample, its residuals, the
# quantiles' sorted copy and the fastkmeans working set
_KMEANS_BYTES_PER_VALUE = 16


def _corpus_files(folder: str) -> list[str]:
    """The shard files, their id indexes, the manifest and a codebook in ``folder`` (the manifest
    first)."""
    names = [
        n
        for n in sorted(os.listdir(folder))
        if n in (MANIFEST_NAME, codecs.CODEBOOK_NAME)
        or n.endswith(ID_INDEX_SUFFIX)
        or os.path.splitext(n)[1].lower() in SHARD_SUFFIXES
    ]
    return sorted(names, key=lambda n: n != MANIFEST_NAME)


def _check_output_dir(output_dir: str, corpus: Corpus, overwrite: bool = False) -> list[str]:
    """Output shard names (input basenames); refuses clashing names, and an OUTDIR that exists and is not
    empty unless `overwrite`."""
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise UsageError(f"{output_dir}: exists and is not a directory; choose a new OUTDIR")
        if os.listdir(output_dir) and not overwrite:
            raise UsageError(
                f"{output_dir}: already exists and is not empty; choose a new OUTDIR, or pass --overwrite "
                "to replace the shards and index.json in it"
            )
    parent = os.path.dirname(os.path.abspath(output_dir))
    if not os.path.isdir(parent):
        raise UsageError(f"{output_dir}: parent directory {parent} does not exist")
    names: dict[str, str] = {}
    for shard in corpus.shards:
        name = os.path.basename(shard.path)
        if name in (MANIFEST_NAME, codecs.CODEBOOK_NAME) or name in names:
            raise UsageError(
                f"{shard.path}: its output name {name!r} clashes with {names.get(name, MANIFEST_NAME)}; "
                "quantize shards with the same file name into separate OUTDIRs"
            )
        names[name] = shard.path
    return list(names)


def _quantize_batch(batch: DocBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from maxsim_kernels.int8_host import quantize_per_token

    codes, scales = quantize_per_token(batch.embeddings.to(device, non_blocking=True))
    return codes.cpu(), scales.cpu()


def _encode_batch(
    batch: DocBatch, device: torch.device, quantization: str, codebook: codecs.Codebook | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes below 8 bits of a batch (`codecs.encode`), on the host."""
    codes, scales = codecs.encode(quantization, batch.embeddings.to(device, non_blocking=True), codebook)
    return codes.cpu(), None if scales is None else scales.cpu()


def _kmeans_sample(corpus: Corpus, tokens: int, rng: np.random.Generator) -> torch.Tensor:
    """About ``tokens`` token vectors (fp32) of documents drawn at random (all of them if fewer)."""
    lengths = np.concatenate([np.diff(np.asarray(s.offsets, dtype=np.int64)) for s in corpus.shards])
    order = rng.permutation(corpus.num_docs)
    count = int(np.searchsorted(np.cumsum(lengths[order]), tokens, side="left")) + 1
    docs, _ = _sample_docs_at(corpus, np.sort(order[: min(count, corpus.num_docs)]))
    return docs.float()


def _pack(batches: Sequence[DocBatch]) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed (embeddings, offsets) pair from several batches."""
    embeddings = torch.cat([b.embeddings for b in batches])
    lengths = torch.cat([b.lengths() for b in batches])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return embeddings, offsets


def _sample_docs(corpus: Corpus, count: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` documents drawn without replacement (all of them if fewer), packed, in corpus order."""
    chosen = np.sort(rng.choice(corpus.num_docs, size=min(count, corpus.num_docs), replace=False))
    return _sample_docs_at(corpus, chosen)


def _sample_docs_at(corpus: Corpus, chosen: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents of sorted corpus ordinals ``chosen``, packed."""
    shard_of = np.searchsorted(corpus.doc_starts, chosen, side="right") - 1
    batches = []
    for s in np.unique(shard_of):
        local = chosen[shard_of == s] - corpus.doc_starts[s]
        batches.append(corpus.shards[int(s)].read_doc_indices(local.tolist()))
    return _pack(batches)


def _pseudo_queries(
    corpus: Corpus, count: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` pseudo-queries: up to PSEUDO_QUERY_TOKENS token vectors (in order) of random documents."""
    picks = rng.integers(0, corpus.num_docs, size=count)
    parts = []
    for doc in picks.tolist():
        s = int(np.searchsorted(corpus.doc_starts, doc, side="right")) - 1
        batch = corpus.shards[s].read_docs(
            doc - int(corpus.doc_starts[s]), doc - int(corpus.doc_starts[s]) + 1
        )
        n = batch.num_tokens
        keep = np.sort(rng.choice(n, size=min(n, PSEUDO_QUERY_TOKENS), replace=False))
        parts.append(batch.embeddings[torch.from_numpy(keep)])
    lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
    offsets = torch.zeros(count + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return torch.cat(parts), offsets


def _file_queries(
    path: str, corpus: Corpus, count: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `count` queries of a query file (a seeded sample if it holds more), as float."""
    batch = read_queries(path).batch  # a query shard or a folder of them
    if batch.embeddings.shape[1] != corpus.dim:
        raise InputError(
            f"{path}: queries have dim {batch.embeddings.shape[1]} but the corpus has dim {corpus.dim}; "
            "encode both with the same model"
        )
    embeddings = batch.embeddings
    if embeddings.dtype == torch.int8:
        if batch.scales is None:
            raise InputError(
                f"{path}: int8 queries without per-token scales; re-create the file with `maxsim pack`"
            )
        embeddings = embeddings.float() * batch.scales[:, None]
    keep = np.arange(batch.num_docs)
    if batch.num_docs > count:
        keep = np.sort(rng.choice(batch.num_docs, size=count, replace=False))
    offs = batch.offsets.numpy()
    rows = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in keep])
    lengths = torch.from_numpy(offs[keep + 1] - offs[keep])
    offsets = torch.zeros(keep.size + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return embeddings[torch.from_numpy(rows)], offsets


def measure_quality(
    corpus: Corpus,
    *,
    sample_queries: int,
    sample_docs: int,
    seed: int,
    queries_path: str | None = None,
    device: torch.device | None = None,
    quantization: str = "int8-per-token",
    codebook: codecs.Codebook | None = None,
) -> QualityReport:
    """Score a seeded sample of the (float) corpus in its own precision and quantized (int8 or codes:
    `quantization`, with the residual2 `codebook`); compare the rankings."""
    from maxsim_kernels import maxsim_varlen
    from maxsim_kernels.int8_host import maxsim_varlen_int8, quantize_per_token

    device = device or torch.device("cpu")
    rng = np.random.default_rng(seed)
    docs, doc_offsets = _sample_docs(corpus, sample_docs, rng)
    if queries_path is None:
        queries, query_offsets = _pseudo_queries(corpus, sample_queries, rng)
    else:
        queries, query_offsets = _file_queries(queries_path, corpus, sample_queries, rng)
    docs, doc_offsets = docs.to(device), doc_offsets.to(device)
    query_offsets = query_offsets.to(device)
    float_scores = maxsim_varlen(queries.to(device, docs.dtype), query_offsets, docs, doc_offsets)
    if quantization == "int8-per-token":
        codes, scales = quantize_per_token(docs)
        int8_scores = maxsim_varlen_int8(
            queries.to(device), query_offsets, codes, doc_offsets, doc_scales=scales
        )
    else:
        codes, scales = codecs.encode(quantization, docs, codebook)
        book = codebook.for_kernels(device) if codebook is not None else None
        int8_scores = maxsim_varlen(
            queries.to(device), query_offsets, codes, doc_offsets, doc_scales=scales, codebook=book
        )
    stats = ranking_agreement(
        list(int8_scores.cpu()), list(float_scores.cpu()), OVERLAP_DEPTHS, tau_depth=int(docs.shape[0])
    )
    top10, top100 = stats.overlap[10], stats.overlap[100]
    return QualityReport(
        queries=int(query_offsets.numel() - 1),
        docs=int(doc_offsets.numel() - 1),
        pseudo_queries=queries_path is None,
        seed=seed,
        top10_overlap_mean=top10.mean,
        top10_overlap_min=top10.min,
        top100_overlap_mean=top100.mean,
        top100_overlap_min=top100.min,
        kendall_tau_mean=stats.kendall_tau.mean,
        kendall_tau_min=stats.kendall_tau.min,
    )


def quantize_corpus(
    paths: Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    sample_queries: int = 64,
    sample_docs: int = 2000,
    seed: int = 0,
    queries_path: str | None = None,
    device: str = "auto",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    bits: int = 8,
    num_centroids: int | None = None,
    kmeans_sample_tokens: int = codecs.DEFAULT_SAMPLE_TOKENS,
    max_host_memory: int | None = None,
    codec: str | None = None,
) -> QuantizeReport:
    """Quantize a float corpus (files and/or directories) into int8 shards under `output_dir`, or into
    codes below 8 bits: `bits` 4 (per-token int4) or 2, `codec` "int2" (the default: a per-dimension grid
    of four values and a scale a token) or "residual2" (residual over k-means centroids; `num_centroids`
    of them, by default ColBERTv2's rule), either fitted on about `kmeans_sample_tokens` tokens drawn
    from the corpus, its codebook written beside the shards. docs/format.md, "Codes below 8 bits".

    Streams `batch_tokens` tokens at a time; writes into a temporary directory renamed to `output_dir`
    at the end (nothing is left behind on failure). An existing, non-empty `output_dir` is refused
    unless `overwrite`: then its shards and manifest are replaced once the new ones are complete (the
    manifest last, so a reader never sees a mixed corpus as whole), and its other files stay.
    `progress(tokens_done, tokens_total)` is called after each batch. With `sample_queries > 0` the
    report carries the ranking quality on a seeded sample.
    """
    output_dir = os.fspath(output_dir)
    if batch_tokens < 1:
        raise UsageError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    if sample_queries < 0 or sample_docs < 1:
        raise UsageError("--sample-queries must be >= 0 and --sample-docs >= 1")
    if bits not in codecs.BITS:
        raise UsageError(f"--bits must be 8, 4 or 2, got {bits}")
    if num_centroids is not None and not 1 <= num_centroids <= codecs.MAX_CENTROIDS:
        raise UsageError(f"--centroids must be from 1 to {codecs.MAX_CENTROIDS}, got {num_centroids}")
    if kmeans_sample_tokens < 1:
        raise UsageError(f"--kmeans-sample-tokens must be >= 1, got {kmeans_sample_tokens}")
    if codec is not None and codec not in codecs.CODECS_2BIT:
        raise UsageError(f"--codec must be one of {', '.join(codecs.CODECS_2BIT)}, got {codec!r}")
    if codec is not None and bits != 2:
        raise UsageError(f"--codec {codec} is a --bits 2 codec; give --bits 2 with it")
    codec = codec or DEFAULT_CODEC
    if bits == 2 and codec == "int2" and num_centroids is not None:
        raise UsageError("--centroids sets residual2's k-means; --codec int2 has no centroids: leave it out")
    quantization = codecs.CODECS_2BIT[codec] if bits == 2 else codecs.BITS[bits]
    if max_host_memory is not None and max_host_memory < 1:
        raise UsageError(f"--max-host-memory must be positive, got {max_host_memory}")
    check_output(output_dir, [*paths, queries_path], folder=True)  # not an input folder, and writable
    torch_device = resolve_device(device)
    with open_corpus(paths) as corpus:
        if corpus.dtype in ("int8", "uint8"):
            raise InputError(
                f"{corpus.shards[0].path}: already {corpus.dtype} (quantization {corpus.quantization}); "
                "quantize the float shards it came from"
            )
        if corpus.num_deleted:  # its deleted rows would come back as documents of the compressed tier
            raise InputError(
                f"{corpus.name}: generation {corpus.generation} has {corpus.num_deleted:,} deleted "
                f"documents; drop them first (maxsim compact {' '.join(corpus.folders) or 'CORPUS'} "
                "--threshold 0), then quantize"
            )
        check_kernel_dim(corpus)
        problem = codecs.dim_problem(quantization, corpus.dim)
        if problem is not None:
            raise InputError(f"{corpus.shards[0].path}: {problem}")
        if max_host_memory is not None:  # the k-means sample is what --bits 2 holds beyond a batch
            per_token = _KMEANS_BYTES_PER_VALUE * corpus.dim
            kmeans_sample_tokens = max(1, min(kmeans_sample_tokens, max_host_memory // per_token))
        names = _check_output_dir(output_dir, corpus, overwrite)
        parent = os.path.dirname(os.path.abspath(output_dir))
        written: list[ShardInfo] = []
        try:
            staging = staging_dir(parent, f".{os.path.basename(os.path.abspath(output_dir))}.")
        except OutputWriteError as exc:
            raise exc.naming(output_dir) from None
        try:
            codebook, extra_files = None, []
            # every quantized shard names its source corpus: `maxsim score --exact-from` checks it
            code_meta = codecs.source_metadata(corpus)
            if quantization != "int8-per-token":
                code_meta[codecs.CODES_VERSION_KEY] = codecs.CODES_VERSION
            if quantization in ("residual2-kmeans", "int2-grid"):
                sample = _kmeans_sample(corpus, kmeans_sample_tokens, np.random.default_rng(seed))
                if quantization == "int2-grid":
                    trained = codecs.Int2Grid(*codecs.fit_int2_levels(sample.to(torch_device)))
                else:
                    wanted = num_centroids or codecs.default_centroids(corpus.num_tokens)
                    trained = codecs.train_codebook(sample, wanted, seed=seed, device=torch_device)
                del sample
                codebook = codecs.write_codebook(staging, trained)
                code_meta.update({
                    codecs.CODEBOOK_KEY: codecs.CODEBOOK_NAME,
                    codecs.CODEBOOK_SHA256_KEY: codebook.sha256,
                })  # fmt: skip
                if quantization == "residual2-kmeans":
                    code_meta[codecs.NUM_CENTROIDS_KEY] = str(codebook.num_centroids)
                extra_files = [codecs.CODEBOOK_NAME]
                codebook = codebook.to(torch_device)  # once, not once a batch
            done = 0
            for shard, name in zip(corpus.shards, names, strict=True):
                info = shard.info
                with ShardWriter(
                    os.path.join(staging, name),
                    info.dim,
                    "int8" if quantization == "int8-per-token" else codecs.CODES_DTYPE,
                    normalized=info.normalized,
                    encoder=info.encoder,
                    format=info.format,
                    patch_grid=info.patch_grid,
                    patch_start=info.patch_start,
                    quantization=quantization,
                    code_metadata=code_meta,
                ) as writer:
                    for batch in shard.iter_batches(batch_tokens):
                        if quantization == "int8-per-token":
                            codes, scales = _quantize_batch(batch, torch_device)
                        else:
                            codes, scales = _encode_batch(batch, torch_device, quantization, codebook)
                        writer.add(batch.ids, codes, offsets=batch.offsets, scales=scales)
                        done += batch.num_tokens
                        if progress is not None:
                            progress(done, corpus.num_tokens)
                    written.append(writer.close())
            write_manifest(staging, names)
            quality = None
            if sample_queries > 0:
                quality = measure_quality(
                    corpus,
                    sample_queries=sample_queries,
                    sample_docs=sample_docs,
                    seed=seed,
                    queries_path=queries_path,
                    device=torch_device,
                    quantization=quantization,
                    codebook=codebook,
                )
            if os.path.isdir(output_dir) and os.listdir(output_dir):  # --overwrite (checked above)
                new_files = [*extra_files, *names, *index_names(names), MANIFEST_NAME]
                swap_corpus_files(staging, output_dir, new_files, _corpus_files(output_dir))
                os.rmdir(staging)
            else:
                try:
                    # an empty directory there is replaced by the one rename (POSIX): no moment without
                    # it, should a signal come between an rmdir and the rename; the command's commit point
                    with commit_point():
                        os.rename(staging, output_dir)
                except OSError as exc:
                    raise write_error(output_dir, exc) from None
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OutputWriteError):  # a shard of the staging folder: name OUTDIR
                raise exc.naming(output_dir) from None
            raise
        shards = [replace(s, path=os.path.join(output_dir, os.path.basename(s.path))) for s in written]
        return QuantizeReport(
            output_dir=output_dir,
            shards=shards,
            num_docs=corpus.num_docs,
            num_tokens=corpus.num_tokens,
            source_bytes=sum(os.path.getsize(p) for p in corpus.paths),
            output_bytes=sum(os.path.getsize(s.path) for s in shards),
            quality=quality,
            source_dtype=corpus.dtype,
            dim=corpus.dim,
            quantization=quantization,
            num_centroids=0 if codebook is None else codebook.num_centroids,
        )
