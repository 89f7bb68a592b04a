"""`ScoreRequest`: every option of a scoring run, built once (by `maxsim_cli.scoring.entry.score`, the API or
a job) and passed down unchanged; a rank of a job gets ``dataclasses.replace(request, ...)`` with its
share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from maxsim_cli.devices import check_backend_option, resolve_device
from maxsim_cli.errors import BATCH_QUERIES, MAX_HOST_MEMORY, MAX_MEMORY, TOP_K, UsageError


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

    def __post_init__(self) -> None:
        # paths may come as os.PathLike, the corpus as any sequence (a list from JSON)
        corpus: Sequence[str] = self.corpus or ()
        object.__setattr__(self, "queries", str(self.queries))
        object.__setattr__(self, "corpus", tuple(str(p) for p in corpus))
        object.__setattr__(self, "output", str(self.output))
        if self.candidates is not None:
            object.__setattr__(self, "candidates", str(self.candidates))

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
        return device
