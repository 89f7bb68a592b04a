"""The frames between `maxsim serve --workers`' HTTP worker processes and its scoring process.

Each worker holds one Unix-domain socket to the scoring process and sends its requests over it as they
come (several in flight, answered in any order, matched by ``id``). A frame is 8 bytes (the header's and
the payload's lengths, little-endian uint32), a JSON header, then raw array bytes; nothing is pickled,
and arrays are read only as the few dtypes below, with their sizes checked against the header.

- ``{"op": "hello", "worker": i}`` (worker, once): answered ``{"op": "config", ...}`` (the HTTP side's
  settings: the corpus's dim, the token, the body limit, the number of workers, the connection limits,
  the label of the answers' scores).
- ``{"op": "search" | "rerank", "id", "ids", "lengths", "dtype", "dim", "scaled", "k", "candidates",
  "strict", "name", "explain", "depth"}`` + the packed token vectors (then the float32 scales of an int8
  request): a checked request (`schema.Checked`). Answered ``{"id", "status": 200, "results": [[qid,
  [docno, ...], missing], ...], "queue_s", "score_s", "batch"}`` + every hit's float32 score in order (a
  request that asked for explanations: ``[qid, [docno, ...], missing, [explanation, ...]]``), or ``{"id",
  "status", "detail"}`` (the HTTP status and one-line message of the error).
- ``{"op": "health", "id"}``: answered ``{"id", "status": 200, "health": {...}}``.
- ``{"op": "soon"}`` (`SOON`): a request has reached the worker and will follow once read; not answered
  (the scoring process keeps its event loop awake for it: `maxsim_cli.service.awake`).

This module imports no torch (the workers run it).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic_core import from_json, to_json

from maxsim_cli.service.schema import Checked, Hits, QueryAnswer

_PREFIX = struct.Struct("<II")
# A frame's parts at most: a header of ids and candidates, a payload of vectors (the HTTP body limit
# bounds both well below this).
MAX_HEADER_BYTES = 1 << 30
MAX_PAYLOAD_BYTES = (1 << 32) - 1
# The arrays a request may carry, by the name its header gives (bfloat16 travels as its int16 bits).
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16, "int8": np.int8}


class FrameError(Exception):
    """A frame that breaks the protocol (its sender is not a worker of this server, or is broken)."""


def pack(header: dict[str, Any], *payload: bytes | memoryview) -> bytes:
    """One frame: ``header`` as JSON, then the ``payload`` parts."""
    head = to_json(header)
    size = sum(len(part) for part in payload)
    return b"".join((_PREFIX.pack(len(head), size), head, *payload))


SOON = pack({"op": "soon"})


def _split_prefix(prefix: bytes) -> tuple[int, int]:
    head_len, size = _PREFIX.unpack(prefix)
    if head_len > MAX_HEADER_BYTES or size > MAX_PAYLOAD_BYTES:
        raise FrameError(f"a frame of {head_len} + {size} bytes is over the limit")
    return head_len, size


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame's header and payload; `asyncio.IncompleteReadError` at the end of the stream."""
    head_len, size = _split_prefix(await reader.readexactly(_PREFIX.size))
    header = from_json(await reader.readexactly(head_len))
    if not isinstance(header, dict):
        raise FrameError("a frame's header is not a JSON object")
    return header, (await reader.readexactly(size) if size else b"")


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """`read_frame` on a blocking socket (the worker's first exchange, before its event loop runs)."""
    head_len, size = _split_prefix(_recv_exactly(sock, _PREFIX.size))
    header = from_json(_recv_exactly(sock, head_len))
    if not isinstance(header, dict):
        raise FrameError("a frame's header is not a JSON object")
    return header, _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise ConnectionError("the scoring process closed the connection")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


# --------------------------------------------------------------------------------------------------
# requests


def request_frame(request_id: int, kind: str, checked: Checked) -> bytes:
    """A checked request of ``kind`` ("search" or "rerank") as a frame."""
    header = {
        "op": kind,
        "id": request_id,
        "ids": checked.ids,
        "lengths": np.diff(checked.offsets).tolist(),
        "dtype": checked.dtype,
        "dim": int(checked.embeddings.shape[1]),
        "scaled": checked.scales is not None,
        "k": checked.k,
        "candidates": checked.candidates,
        "strict": checked.strict,
        "name": checked.name,
        "explain": checked.explain,
        "include": checked.include,
        "exclude": checked.exclude,
        "depth": checked.depth,
        "where": checked.where,
    }
    parts = [memoryview(np.ascontiguousarray(checked.embeddings)).cast("B")]
    if checked.scales is not None:
        parts.append(memoryview(np.ascontiguousarray(checked.scales, dtype=np.float32)).cast("B"))
    return pack(header, *parts)


def checked_from_frame(header: dict[str, Any], payload: bytes) -> Checked:
    """The checked request a frame carries (its arrays copied out of ``payload``: writable, for torch)."""
    try:
        dtype = np.dtype(DTYPES[header["dtype"]])
        ids = [str(qid) for qid in header["ids"]]
        lengths = np.asarray(header["lengths"], dtype=np.int64)
        dim = int(header["dim"])
        scaled = bool(header["scaled"])
        k = header["k"]
        candidates = header["candidates"]
        name = str(header["name"])
        depth = header.get("depth")
        if depth is not None and (type(depth) is not int or depth < 1):
            raise ValueError("depth")
        where = header.get("where")
        if where is not None and type(where) is not str:
            raise ValueError("where")
    except (KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"a request frame without a valid {exc}") from None
    if len(lengths) != len(ids) or (lengths < 0).any() or dim < 1:
        raise FrameError("a request frame whose ids, lengths and dim disagree")
    tokens = int(lengths.sum())
    vectors = tokens * dim * dtype.itemsize
    if len(payload) != vectors + (4 * tokens if scaled else 0):
        raise FrameError(f"a request frame of {len(payload)} bytes for {tokens} tokens of dim {dim}")
    embeddings = np.frombuffer(payload, dtype=dtype, count=tokens * dim).reshape(tokens, dim).copy()
    scales = np.frombuffer(payload, dtype=np.float32, offset=vectors).copy() if scaled else None
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Checked(
        ids,
        embeddings,
        offsets,
        header["dtype"],
        scales,
        k,
        candidates,
        bool(header.get("strict")),
        name,
        bool(header.get("explain")),
        header.get("include"),
        header.get("exclude"),
        depth,
        where,
    )


# --------------------------------------------------------------------------------------------------
# answers


def answer_frame(
    request_id: int, answers: Sequence[QueryAnswer], queue_s: float, score_s: float, batch: int
) -> bytes:
    """A request's answers: docnos in the header, the float32 scores (exact: they are float32 values)
    as raw bytes."""
    results = [
        [qid, list(hits.docnos), missing]
        if hits.explanations is None
        else [qid, list(hits.docnos), missing, hits.explanations]
        for qid, hits, missing in answers
    ]
    columns = [hits.scores for _, hits, _ in answers]
    scores = np.concatenate(columns, dtype=np.float32) if columns else np.zeros(0, dtype=np.float32)
    header = {
        "id": request_id,
        "status": 200,
        "results": results,
        "queue_s": queue_s,
        "score_s": score_s,
        "batch": batch,
    }
    return pack(header, memoryview(scores).cast("B"))


def answers_from_frame(header: dict[str, Any], payload: bytes) -> list[QueryAnswer]:
    """The answers of an answer frame, as `Batcher.submit` gives them."""
    scores = np.frombuffer(payload, dtype=np.float32)
    total = sum(len(result[1]) for result in header["results"])
    if total != len(scores):
        raise FrameError(f"an answer frame with {len(scores)} scores for {total} hits")
    out: list[QueryAnswer] = []
    at = 0
    for qid, docnos, missing, *explained in header["results"]:
        hits = Hits(docnos, scores[at : at + len(docnos)], explained[0] if explained else None)
        out.append((qid, hits, missing))
        at += len(docnos)
    return out


def error_frame(request_id: int, status: int, detail: str) -> bytes:
    return pack({"id": request_id, "status": status, "detail": detail})
