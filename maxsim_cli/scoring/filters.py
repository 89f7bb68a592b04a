"""Filters at search time: the documents a search or a rerank may return, as one boolean mask over the
corpus's ordinals.

A filter is given as ids to include and/or ids to exclude (`maxsim score --include-ids FILE
--exclude-ids FILE`, the API's ``include=`` / ``exclude=``, a served request's ``"include"`` /
``"exclude"``), or from Python as a boolean mask over the corpus. It becomes `disallowed`: a numpy bool
array, one entry a corpus ordinal, True where the document may not be returned (include given: every
document not in it; exclude given: every document in it). Ids are found through the corpus's id lookup
(`Corpus.id_lookup`, built once per corpus), so building a mask costs what its ids cost. Any other
reason a document may not be returned (a deletion) is OR'ed into the same array.

How the mask is used (`use_subset`):

- **scan** (the usual case): the search scans the corpus as an unfiltered one does, and the order keys of
  disallowed documents are set to the lowest key where each score block enters the running top-k
  (`maxsim_cli.scoring.topk.RunningTopK.add`), on the device; the top-k keeps at most as many documents
  as are allowed, so every result is an allowed document and a query gets ``min(k, allowed)`` of them.
  Document batches that hold no allowed document are neither read nor scored; a batch whose documents
  are all allowed is merged as an unfiltered one is. So a filtered search never costs more than an
  unfiltered one.
- **subset**: when the allowed documents are fewer than `SUBSET_SHARE` of the corpus, scanning the rest
  only to throw it away costs more than scoring the allowed documents as every query's candidates (the
  rerank path: only their rows read, one candidates launch a batch). The run is the same.

A rerank with a filter drops the candidates that the filter disallows as it drops missing ones (without
a warning: they were asked to be left out), counted in its stats (``filtered_candidates``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from maxsim_cli.errors import EXCLUDE, INCLUDE, STRICT, WHERE, InputError, Option, UsageError

# Below this share of the corpus allowed, a filtered search scores the allowed documents as candidates
# instead of scanning the corpus (module docstring; benchmarks/bench_filters.py measures both).
SUBSET_SHARE = 0.05

Logger = Callable[[str], None]


def disallowed_mask(
    corpus: Any,
    include: Any = None,
    exclude: Any = None,
    *,
    strict: bool = False,
    log: Logger,
    where: Any = None,
) -> np.ndarray | None:
    """The corpus's disallowed mask (module docstring) for ``include`` and ``exclude`` (each None, ids
    (a list, set, tuple or array of docnos) or a boolean mask over the corpus: numpy or torch, one entry
    a document) and ``where`` (None, or a condition on the shards' metadata columns: a
    `pyarrow.compute.Expression` or its text, `maxsim_cli.scoring.where`); None when none is given.
    Ids not in the corpus: a warning through ``log`` naming their count and a few (``strict``: an
    `InputError`). No document allowed: a warning (``strict``: an `InputError`), and the run is empty."""
    if include is None and exclude is None and where is None:
        return None
    n = len(corpus)
    disallowed = np.zeros(n, dtype=bool)
    if include is not None:
        allowed = _members(corpus, include, INCLUDE, strict, log)
        np.logical_not(allowed, out=disallowed)
    if exclude is not None:
        disallowed |= _members(corpus, exclude, EXCLUDE, strict, log)
    if where is not None:
        from maxsim_cli.scoring.where import matching

        disallowed |= ~matching(corpus, where)
    deleted = corpus.deleted_mask() if hasattr(corpus, "deleted_mask") else None
    if deleted is not None:  # one mask: a deleted document is never allowed, whatever the filter says
        disallowed |= deleted
    if n and not (~disallowed).any():
        message = (
            f"the filter ({_given(include, exclude, where)}) allows no document of the corpus; the run is "
            "empty"
        )
        if strict:
            raise InputError(f"{message} ({STRICT.given(True)}: an error; drop it to get the empty run)")
        log(f"warning: {message}")
    return disallowed


def use_subset(disallowed: np.ndarray) -> bool:
    """Whether a filtered search scores the allowed documents as candidates (few allowed: `SUBSET_SHARE`)
    rather than scanning the corpus with the mask."""
    n = len(disallowed)
    return n > 0 and (n - int(np.count_nonzero(disallowed))) < SUBSET_SHARE * n


def allowed_count(disallowed: np.ndarray | None, n: int) -> int:
    """Documents a search may return: all ``n`` without a mask."""
    return n if disallowed is None else n - int(np.count_nonzero(disallowed))


def _given(include: Any, exclude: Any, where: Any = None) -> str:
    given = ((INCLUDE, include), (EXCLUDE, exclude), (WHERE, where))
    return " and ".join(str(option) for option, value in given if value is not None)


def share_mask(disallowed: np.ndarray | None, corpus: Any, shards: Sequence[int]) -> np.ndarray | None:
    """The part of a mask over ``corpus`` that covers its shards ``shards`` (indices, in the order a
    corpus of those shards numbers its documents): what a rank of a job, or a device of a corpus spread
    over several, scores with (`maxsim_cli.parallel`)."""
    if disallowed is None:
        return None
    starts = corpus.doc_starts
    parts = [disallowed[int(starts[s]) : int(starts[s + 1])] for s in shards]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _members(corpus: Any, value: Any, option: Option, strict: bool, log: Logger) -> np.ndarray:
    """A bool array over the corpus: True for the documents ``value`` names (ids, or a mask)."""
    n = len(corpus)
    mask = _as_mask(value, n, option)
    if mask is not None:
        return mask
    ids = _as_ids(value, option)
    members = np.zeros(n, dtype=bool)
    if not ids:
        return members
    ordinals = corpus.id_lookup().ordinals_of(ids)
    found = ordinals >= 0
    members[ordinals[found]] = True
    unknown = len(ids) - int(np.count_nonzero(found))
    if unknown:
        examples = ", ".join(repr(ids[i]) for i in np.flatnonzero(~found)[:3].tolist())
        if strict:
            raise InputError(
                f"{option}: {unknown} ids are not in the corpus, e.g. {examples}; check the ids, or drop "
                f"{STRICT.given(True)} to skip them"
            )
        log(
            f"warning: {option}: {unknown} ids are not in the corpus, e.g. {examples}; they are skipped "
            f"({STRICT.given(True)} makes this an error)"
        )
    return members


def _as_mask(value: Any, n: int, option: Option) -> np.ndarray | None:
    """``value`` as a numpy bool array of length ``n`` when it is a mask (a numpy array or torch tensor
    of bools); None when it is ids. A mask of the wrong length or dtype is an `InputError`."""
    array = value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        if str(value.dtype) != "torch.bool":
            raise InputError(
                f"{option}: a tensor of {str(value.dtype).removeprefix('torch.')}; give a bool mask over "
                f"the corpus ({n} documents) or a list of docnos"
            )
        array = value.detach().cpu().numpy()
    if not isinstance(array, np.ndarray):
        return None
    if array.dtype.kind in ("U", "O", "S") and array.dtype != bool:
        return None  # docnos in an array
    if array.dtype != bool:
        raise InputError(
            f"{option}: an array of {array.dtype}; give a bool mask over the corpus ({n} documents) or a "
            "list of docnos"
        )
    if array.ndim != 1 or len(array) != n:
        raise InputError(
            f"{option}: a mask of shape {tuple(array.shape)} over a corpus of {n} documents; give one bool "
            "a document, in corpus order"
        )
    return np.ascontiguousarray(array)


def _as_ids(value: Any, option: Option) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise UsageError(
            f"{option}: got {type(value).__name__}; give a list or set of docnos, or a bool mask over the "
            "corpus"
        )
    ids = [str(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    for docno in ids:
        if not docno or len(docno.split()) != 1 or docno.strip() != docno:
            raise InputError(f"{option}: the id {docno[:60]!r} is empty or holds whitespace; ids have none")
    return ids
