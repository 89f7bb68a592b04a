"""The running max over a document's tiles, shared by the fp16 and int8 kernels (Triton device functions).

A program walks a document in tiles of similarities [rows, tile tokens] (or [tile tokens, rows] for the
fp16 kernel's document-major tiles). It keeps either
- per row, the max so far and, when asked, the index of the token that holds it within the document (the
  lowest on ties: a later tile replaces the argmax only when strictly greater); or
- with ELEMENT_MAX (scores only), the max so far per tile element, reduced over the tokens once, at the
  document's last tile: one max instruction an element a tile, no cross-thread reduction per tile.
After the document's last tile, inside its branch (other tiles pay nothing for it), all start again.
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
def fold_tile(
    s, row_max, row_arg, m_tile, tok, doc_start, ELEMENT_MAX: tl.constexpr, RETURN_ARGMAX: tl.constexpr
):
    """Fold one tile into the document's running max: per row (`fold_row_max`) or per element."""
    if ELEMENT_MAX:
        m_tile = tl.maximum(m_tile, s)
    else:
        row_max, row_arg = fold_row_max(s, row_max, row_arg, tok, doc_start, RETURN_ARGMAX)
    return row_max, row_arg, m_tile


@triton.jit
def document_max(row_max, m_tile, TOKENS_AXIS: tl.constexpr, ELEMENT_MAX: tl.constexpr):
    """At a document's last tile: the max per row (over the tokens axis of `m_tile` when kept per element)."""
    if ELEMENT_MAX:
        row_max = tl.max(m_tile, axis=TOKENS_AXIS)
    return row_max


@triton.jit
def restart(row_max, row_arg, m_tile, ELEMENT_MAX: tl.constexpr, RETURN_ARGMAX: tl.constexpr):
    """-inf (and argmax -1): called in the document-end branch, the next tile starts the next document."""
    if ELEMENT_MAX:
        m_tile = tl.full(m_tile.shape, float("-inf"), tl.float32)
    else:
        row_max = tl.full(row_max.shape, float("-inf"), tl.float32)
        if RETURN_ARGMAX:
            row_arg = tl.full(row_arg.shape, -1, tl.int32)
    return row_max, row_arg, m_tile


@triton.jit
def tile_count(d_off_ptr, docs, readable, counted, BLOCK_D: tl.constexpr):
    """The BLOCK_D-token tiles that the entries `counted` of `docs` take when walked one after the other
    in one loop (an empty document, or an entry not `readable`, still one tile: its score is stored there)."""
    lens = tl.load(d_off_ptr + docs + 1, mask=readable, other=0) - tl.load(
        d_off_ptr + docs, mask=readable, other=0
    )
    return tl.sum(tl.where(counted, tl.maximum(tl.cdiv(lens, BLOCK_D), 1), 0))
