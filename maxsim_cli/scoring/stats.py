"""`ScoreStats`: what a scoring run did and where its time went, as `maxsim score --stats-json` writes it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from maxsim_cli.shards import write_text_atomic
from maxsim_cli.units import format_count, format_counted, format_rate, format_size


@dataclass
class ScoreStats:
    """What a run did and where the time went (seconds; `read_s` is summed over reader threads)."""

    mode: str
    device: str
    backend: str
    output: str
    queries: int = 0
    documents: int = 0
    tokens: int = 0
    pairs: int = 0
    queries_with_candidates: int = 0  # rerank mode: queries that had at least one candidate scored
    query_batches: int = 0
    doc_batches: int = 0
    resident: bool = False
    missing_candidates: int = 0
    oom_retries: int = 0
    wall_s: float = 0.0
    read_s: float = 0.0
    copy_s: float = 0.0
    score_s: float = 0.0
    wait_s: float = 0.0
    setup_s: float = 0.0
    write_s: float = 0.0
    bytes_read: int = 0
    peak_gpu_bytes: int | None = None
    peak_host_bytes: int = 0
    gpu_budget_bytes: int | None = None
    host_budget_bytes: int = 0
    reader_threads: int = 1
    query_batch_size: int = 0
    max_batch_docs: int = 0
    max_batch_tokens: int = 0
    planned_device_bytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def docs_per_s(self) -> float:
        """Documents scored (against every query) per second of wall time."""
        return self.documents / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def pairs_per_s(self) -> float:
        """(query, document) pairs scored per second of wall time: the work done, in either mode."""
        return self.pairs / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Document tokens scored (against every query) per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        """The stats as a JSON-ready dict, with throughput added."""
        out = asdict(self)
        out.pop("extra")
        out.update(self.extra)
        out["docs_per_s"] = self.docs_per_s
        out["pairs_per_s"] = self.pairs_per_s
        out["tokens_per_s"] = self.tokens_per_s
        return out

    def summary(self) -> str:
        """One line for stderr: the pairs scored (exhaustive: every query x every document; rerank: the
        candidates found in the corpus, of the queries that had some), their rate, and what was read."""
        gpu = f", peak GPU {format_size(self.peak_gpu_bytes)}" if self.peak_gpu_bytes is not None else ""
        n = format_count
        two = self.extra.get("two_stage")
        if self.mode == "two-stage" and two is not None:
            work = (
                f"searched {format_counted(self.queries, 'query', 'queries')} x "
                f"{format_counted(two['scan_documents'], 'document', 'documents')} in "
                f"{two['compressed_quantization']} (top {n(two['depth'])} each, {two['scan_wall_s']:.2f} s), "
                f"then scored {n(self.pairs)} candidates exactly ({self.wall_s - two['scan_wall_s']:.2f} s)"
            )
            kept = self.extra.get("filter")
            if kept is not None:
                work += f", {format_counted(kept['allowed'], 'document', 'documents')} allowed by the filter"
            return f"{work}: {self.wall_s:.2f} s in all on {self.device}{gpu}; the scores are exact"
        if self.mode == "rerank":
            without = self.queries - self.queries_with_candidates
            none = f"; {n(without)} of {n(self.queries)} queries had none" if without > 0 else ""
            missing = f", {n(self.missing_candidates)} not in the corpus" if self.missing_candidates else ""
            if self.extra.get("filtered_candidates"):
                missing += f", {n(self.extra['filtered_candidates'])} outside the filter"
            work = (
                f"reranked {format_counted(self.pairs, 'candidate', 'candidates')} of "
                f"{format_counted(self.queries_with_candidates, 'query', 'queries')} "
                f"({format_counted(self.documents, 'document', 'documents')}, "
                f"{format_counted(self.tokens, 'token', 'tokens')}{missing}{none})"
            )
        else:
            work = (
                f"scored {format_counted(self.queries, 'query', 'queries')} x "
                f"{format_counted(self.documents, 'document', 'documents')} = {n(self.pairs)} pairs "
                f"({n(self.tokens)} document tokens)"
            )
            kept = self.extra.get("filter")
            if kept is not None:
                work += f", {format_counted(kept['allowed'], 'document', 'documents')} allowed by the filter"
        approximate = ""
        if self.extra.get("scores") == "approximate":
            approximate = (
                f"; the scores are the {self.extra.get('quantization')} codes' (approximate: --exact-from "
                "CORPUS scores the top documents exactly)"
            )
        return (
            f"{work} in {self.wall_s:.2f} s: {format_rate(self.pairs, self.wall_s, 'pairs')} "
            f"on {self.device}{gpu}{approximate}"
        )

    def write_json(self, path: str) -> None:
        """Write `as_dict` to ``path`` atomically."""
        write_text_atomic(path, json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n", commits=True)
