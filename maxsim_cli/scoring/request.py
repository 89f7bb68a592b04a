"""`ScoreRequest`: every option of a scoring run, built once (by `maxsim_cli.scoring.entry.score`, the API or
a job) and passed down unchanged; a rank of a job gets ``dataclasses.replace(request, ...)`` with its
share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from maxsim_cli.devices import check_backend_option, resolve_device
from maxsim_cli.errors import (
    BATCH_QUERIES,
    DEPTH,
    EXACT_FROM,
    MAX_HOST_MEMORY,
    MAX_MEMORY,
    TOP_K,
    UsageError,
)

# The compressed tier's candidates a query that `exact_from` scores exactly, by default: (floor, factor)
# -> max(floor, factor * top_k), by the tier's quantization. Chosen from the recall of the exact top-10
# and top-100 in the compressed top N (benchmarks/two_stage_recall.py, docs/two-stage.md): >= 0.99 on
# sample_data, 30K Python docstrings (real text: N = 2k was enough for every codec) and 10K random ragged
# documents. 2-bit residual codes of random vectors (no clusters for the centroids to find) needed
# N = 2000 for the top 100; int8 and 4-bit 500 at most. 2-bit grid codes (int2) have the residual codes'
# recall at every depth on the three collections (benchmarks/int2_quality.py): the same depths.
DEFAULT_DEPTH = (1000, 5)
DEFAULT_DEPTHS = {"residual2-kmeans": (2000, 20), "int2-grid": (2000, 20)}


def default_depth(quantization: str, top_k: int) -> int:
    """The default ``depth`` of a two-stage search whose compressed tier has this quantization."""
    floor, factor = DEFAULT_DEPTHS.get(quantization, DEFAULT_DEPTH)
    return max(floor, factor * top_k)


@dataclass(frozen=True)
class ScoreRequest:
    """The options of `maxsim_cli.scoring.entry.score` (see there), paths as strings and the corpus as a
    tuple."""

    queries: str
    corpus: tuple[str, ...]
    output: str = "-"
    top_k: int = 1000
    candidates: str | None = None
    strict: bool = False
    device: str = "auto"
    backend: str = "auto"
    max_memory: int | None = None
    max_host_memory: int | None = None
    run_tag: str = "maxsim"
    fmt: str = "trec"
    batch_queries: int | None = None
    reader_threads: int | None = None
    show_progress: bool = False
    devices: str | None = None
    # two-stage search: ``corpus`` is a compressed tier, scanned for each query's top ``depth``; those
    # candidates are scored exactly from the shards ``exact_from`` (the corpus it was quantized from)
    exact_from: tuple[str, ...] | None = None
    depth: int | None = None
    # filters (`maxsim_cli.scoring.filters`): files of ids, one a line ('-': stdin), the documents a
    # search may return (include) and may not (exclude); a condition on the shards' metadata columns,
    # as text (`maxsim_cli.scoring.where.parse_where`)
    include_ids: str | None = None
    exclude_ids: str | None = None
    where: str | None = None

    def __post_init__(self) -> None:
        # paths may come as os.PathLike, the corpus as any sequence (a list from JSON)
        corpus: Sequence[str] = self.corpus or ()
        object.__setattr__(self, "queries", str(self.queries))
        object.__setattr__(self, "corpus", tuple(str(p) for p in corpus))
        object.__setattr__(self, "output", str(self.output))
        if self.candidates is not None:
            object.__setattr__(self, "candidates", str(self.candidates))
        for name in ("include_ids", "exclude_ids"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        if self.exact_from is not None:
            exact: Sequence[str] = self.exact_from
            object.__setattr__(self, "exact_from", tuple(str(p) for p in exact))

    @property
    def two_stage(self) -> bool:
        """Whether the corpus is a compressed tier whose candidates are scored exactly (``exact_from``)."""
        return self.exact_from is not None

    def search_depth(self, quantization: str) -> int:
        """The compressed tier's candidates a query in a two-stage search (the tier quantized so):
        ``depth``, or `default_depth`."""
        return self.depth if self.depth is not None else default_depth(quantization, self.top_k)

    @property
    def mode(self) -> str:
        """``rerank`` with candidates, else ``exhaustive``."""
        return "rerank" if self.candidates is not None else "exhaustive"

    @property
    def query_name(self) -> str:
        """The query input as messages name it."""
        return "<stdin>" if self.queries == "-" else self.queries

    @property
    def candidates_name(self) -> str:
        """The candidates' run as messages name it."""
        return "<stdin>" if self.candidates == "-" else str(self.candidates)

    def check(self) -> torch.device:
        """Raise the `UsageError` of the first bad option value (in the order `score` has always checked
        them); return the torch device that ``device`` names."""
        from maxsim_cli.run_files import RunWriter

        if self.top_k < 1:
            raise UsageError(f"{TOP_K.given(self.top_k)}: must be at least 1")
        if self.batch_queries is not None and self.batch_queries < 1:
            raise UsageError(f"{BATCH_QUERIES.given(self.batch_queries)}: must be at least 1")
        if not self.corpus:
            raise UsageError("no corpus given: pass one or more shard files or directories after QUERIES")
        if any(p == "-" for p in self.corpus):
            raise UsageError("the corpus cannot be read from stdin ('-'); pass shard files or directories")
        if self.queries == "-" and self.candidates == "-":
            raise UsageError("QUERIES and --candidates are both '-': at most one input can be stdin")
        if self.fmt not in ("trec", "jsonl"):
            raise UsageError(f"--format {self.fmt}: use trec or jsonl")
        device = resolve_device(self.device)
        check_backend_option(self.backend, device)
        if self.max_memory is not None and self.max_memory <= 0:
            raise UsageError(f"{MAX_MEMORY} must be positive")
        if self.max_host_memory is not None and self.max_host_memory <= 0:
            raise UsageError(f"{MAX_HOST_MEMORY} must be positive")
        RunWriter(self.output, tag=self.run_tag, fmt=self.fmt)  # checks the tag; opens nothing
        self._check_two_stage()
        self.check_filters()
        return device

    @property
    def filtered(self) -> bool:
        """Whether the run has a filter (``include_ids`` / ``exclude_ids`` / ``where``)."""
        return self.include_ids is not None or self.exclude_ids is not None or self.where is not None

    def check_filters(self) -> None:
        """The `UsageError` of a filter that cannot be read: two inputs on stdin, a ``where`` that is not
        a condition (`maxsim_cli.scoring.where.parse_where`)."""
        if not self.filtered:
            return
        stdin = [p for p in (self.queries, self.candidates, self.include_ids, self.exclude_ids) if p == "-"]
        if len(stdin) > 1:
            raise UsageError(
                "several inputs are '-' (stdin): at most one of QUERIES, --candidates, "
                "--include-ids and --exclude-ids can be stdin"
            )
        if self.where is not None:
            from maxsim_cli.scoring.where import parse_where

            parse_where(self.where)

    def _check_two_stage(self) -> None:
        if self.exact_from is None:
            if self.depth is not None:
                raise UsageError(f"{DEPTH.given(self.depth)} goes with {EXACT_FROM}: give both, or neither")
            return
        if not self.exact_from or any(p == "-" for p in self.exact_from):
            raise UsageError(f"{EXACT_FROM} needs the shard files or folders of the exact corpus")
        if self.candidates is not None:
            raise UsageError(
                f"{EXACT_FROM} finds its candidates in the compressed corpus; a first-stage run "
                f"({self.candidates_name}) is reranked without it"
            )
        if self.devices is not None:
            raise UsageError(f"{EXACT_FROM} runs on one device; leave --devices out")
        if self.depth is not None and self.depth < 1:
            raise UsageError(f"{DEPTH.given(self.depth)}: must be at least 1")
        if self.depth is not None and self.depth < self.top_k:
            # the exact tier sees only the compressed tier's top `depth`: fewer than k would come back
            raise UsageError(
                f"{DEPTH.given(self.depth)} is below {TOP_K.given(self.top_k)}: the exact scores come for "
                f"the compressed tier's top {self.depth} only; give a depth of at least {self.top_k}"
            )
