"""The running max over a document's tiles, shared by the fp16 and int8 kernels (Triton device functions).

A program walks a document in tiles of similarities [rows, tile tokens]; per row it keeps the max so far
and, when asked, the index of the token that holds it within the document (the lowest on ties: a later
tile replaces the argmax only when strictly greater). After the document's last tile both start again.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fold_row_max(s, row_max, row_arg, tok, doc_start, RETURN_ARGMAX: tl.constexpr):
    """Fold tile `s` [rows, tokens from `tok`] into `row_max` (and `row_arg`, an index from `doc_start`)."""
    if RETURN_ARGMAX:
        t_max, t_arg = tl.max(s, axis=1, return_indices=True, return_indices_tie_break_left=True)
        better = t_max > row_max  # strict: an earlier tile keeps its tie
        row_arg = tl.where(better, (tok - doc_start + t_arg).to(tl.int32), row_arg)
        row_max = tl.where(better, t_max, row_max)
    else:
        row_max = tl.maximum(row_max, tl.max(s, axis=1))
    return row_max, row_arg


@triton.jit
def restart_row_max(last, row_max, row_arg, RETURN_ARGMAX: tl.constexpr):
    """-inf (and -1) where `last`: the next tile starts the next document."""
    row_max = tl.where(last, float("-inf"), row_max)
    if RETURN_ARGMAX:
        row_arg = tl.where(last, -1, row_arg)
    return row_max, row_arg
