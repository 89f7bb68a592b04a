"""What a corpus holds, per shard and in total, after validating it (and, by default, every value).

Token-length statistics are over documents: min, mean, median, 99th percentile (linear interpolation
between order statistics, numpy's default) and max of `offsets[i+1] - offsets[i]`.

The value check streams: `CHECK_BATCH_TOKENS` tokens at a time, read into memory and dropped (never
through a map of the file, whose pages would stay resident), so its memory does not grow with the corpus.
It also counts the documents that carry an all-zero token row: no encoder outputs one, but padding kept
without its mask does (a padded batch of colpali-engine or a HF model saved as it is), and such rows take
part in every max.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from maxsim_cli.shards import Shard, open_corpus
from maxsim_cli.units import format_count

# Tokens read per batch while checking values: 2^16 tokens x 128 dims x 2 B = 16 MiB in float16 (the
# check's working set is a few times that), with a per-batch overhead (about a millisecond) far below
# the batch's read time. A longer document is read alone.
CHECK_BATCH_TOKENS = 1 << 16


@dataclass
class LengthStats:
    """Tokens per document."""

    min: int
    mean: float
    median: float
    p99: float
    max: int

    @staticmethod
    def of(lengths: np.ndarray) -> LengthStats:
        if lengths.size == 0:
            return LengthStats(0, 0.0, 0.0, 0.0, 0)
        return LengthStats(
            int(lengths.min()),
            float(lengths.mean()),
            float(np.median(lengths)),
            float(np.percentile(lengths, 99)),
            int(lengths.max()),
        )


@dataclass
class ShardReport:
    path: str
    format: str
    num_docs: int
    num_tokens: int
    dim: int
    dtype: str
    quantization: str
    normalized: bool
    encoder: str | None
    bytes: int
    token_lengths: LengthStats
    zero_row_docs: int | None = None  # documents with an all-zero token row (None: values not checked)
    first_zero_row_doc: str | None = None
    deleted_docs: int = 0  # rows deleted in the corpus's generation (not counted in num_docs)


@dataclass
class InspectReport:
    """The corpus in total (top level) and per shard."""

    num_docs: int
    num_tokens: int
    dim: int
    dtype: str
    quantization: str
    normalized: bool
    encoder: str | None
    bytes: int
    token_lengths: LengthStats
    values_checked: bool
    shards: list[ShardReport]
    zero_row_docs: int | None = None  # documents with an all-zero token row (None: values not checked)
    first_zero_row_doc: str | None = None
    generation: int = 0  # the committed generation opened (0: a folder without generations)
    deleted_docs: int = 0  # rows deleted in that generation, kept in the shards until compacted

    def to_dict(self) -> dict:
        return asdict(self)

    def zero_row_warning(self) -> str | None:
        """One line about the documents carrying all-zero token rows, or None when there are none."""
        from maxsim_cli.shards.inputs import zero_row_warning

        first = next((r for r in self.shards if r.zero_row_docs), None)
        if not self.zero_row_docs or first is None or first.first_zero_row_doc is None:
            return None
        where = first.path if len(self.shards) > 1 else ""
        return zero_row_warning(
            first.path if len(self.shards) == 1 else "the corpus",
            self.zero_row_docs,
            first.first_zero_row_doc,
            "re-create the shards with the mask (maxsim pack --mask-column), or drop the zero rows",
            where=where,
        )


def _shard_report(shard: Shard) -> ShardReport:
    info = shard.info
    deleted = len(getattr(shard, "deleted_rows", ()))
    return ShardReport(
        deleted_docs=deleted,
        path=shard.path,
        format=info.format,
        num_docs=info.num_docs - deleted,
        num_tokens=info.num_tokens,
        dim=info.dim,
        dtype=info.dtype,
        quantization=info.quantization,
        normalized=info.normalized,
        encoder=info.encoder,
        bytes=os.path.getsize(shard.path),
        token_lengths=LengthStats.of(np.diff(shard.offsets)),
    )


def inspect_paths(
    paths: Sequence[str],
    *,
    check_values: bool = True,
    verify_checksums: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> InspectReport:
    """Open `paths` as one corpus (all validation of `open_corpus`) and describe it.

    With `check_values`, every value is read, in batches of CHECK_BATCH_TOKENS tokens, and NaN/Inf
    (or a bad int8 scale) is an error naming the document; documents with an all-zero token row are
    counted (`zero_row_docs`, `InspectReport.zero_row_warning`). `progress(tokens_done, total_tokens)`
    is called after each batch.
    """
    with open_corpus(paths, verify_checksums=verify_checksums) as corpus:
        reports = [_shard_report(s) for s in corpus.shards]
        zero_docs: int | None = None
        if check_values:
            done = zero_docs = 0
            for shard, report in zip(corpus.shards, reports, strict=True):
                report.zero_row_docs = 0
                for batch in shard.iter_batches(CHECK_BATCH_TOKENS):
                    docs = _zero_row_docs(batch.embeddings, batch.offsets.numpy())
                    if docs.size:
                        report.zero_row_docs += int(docs.size)
                        if report.first_zero_row_doc is None:
                            report.first_zero_row_doc = batch.ids[int(docs[0])]
                    done += batch.num_tokens
                    del batch  # before the next read: one batch in memory at a time
                    if progress is not None:
                        progress(done, corpus.num_tokens)
                zero_docs += report.zero_row_docs
        first_zero = next((r.first_zero_row_doc for r in reports if r.first_zero_row_doc), None)
        lengths = np.concatenate([np.diff(s.offsets) for s in corpus.shards])
        return InspectReport(
            generation=corpus.generation,
            deleted_docs=corpus.num_deleted,
            num_docs=corpus.num_live,
            num_tokens=corpus.num_tokens,
            dim=corpus.dim,
            dtype=corpus.dtype,
            quantization=corpus.quantization,
            normalized=corpus.normalized,
            encoder=corpus.encoder,
            bytes=sum(r.bytes for r in reports),
            token_lengths=LengthStats.of(lengths),
            values_checked=check_values,
            shards=reports,
            zero_row_docs=zero_docs,
            first_zero_row_doc=first_zero,
        )


def _zero_row_docs(embeddings, offsets: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a torch tensor
    """Indices (in the batch) of the documents with at least one all-zero token row."""
    zero = ~embeddings.ne(0).any(dim=1)
    if not bool(zero.any()):
        return np.zeros(0, dtype=np.int64)
    rows = zero.nonzero()[:, 0].numpy()
    return np.unique(np.searchsorted(offsets, rows, side="right") - 1)


def format_report(report: InspectReport) -> str:
    """A plain-text table: one line per shard and a total line, then the corpus-wide properties."""
    from maxsim_cli.units import format_size

    header = ("shard", "docs", "tokens", "len min", "mean", "median", "p99", "max", "bytes", "normalised")
    rows = []
    for r in report.shards:
        rows.append(
            _row(r.path, r.num_docs, r.num_tokens, r.token_lengths, r.bytes, r.normalized, format_size)
        )
    if len(report.shards) > 1:
        rows.append(
            _row(
                "total",
                report.num_docs,
                report.num_tokens,
                report.token_lengths,
                report.bytes,
                report.normalized,
                format_size,
            )
        )
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append(
        f"dim {report.dim}  dtype {report.dtype}  quantization {report.quantization}  "
        f"normalised {'yes' if report.normalized else 'no'}  encoder {report.encoder or '-'}  "
        f"values {'checked' if report.values_checked else 'not checked'}"
    )
    if report.generation or report.deleted_docs:
        lines.append(
            f"generation {report.generation}  deleted {format_count(report.deleted_docs)} "
            "(left out of docs; their tokens stay in the shards until maxsim compact)"
        )
    return "\n".join(lines)


def _row(
    name: str, docs: int, tokens: int, st: LengthStats, size: int, normalized: bool, fmt: Callable[[int], str]
) -> list[str]:
    return [
        name,
        format_count(docs),
        format_count(tokens),
        format_count(st.min),
        f"{st.mean:.1f}",
        f"{st.median:g}",
        f"{st.p99:.1f}",
        format_count(st.max),
        fmt(size),
        "yes" if normalized else "no",
    ]
