"""INT8 x INT8 MaxSim on Hopper (sm_90), in Gluon, for the shapes bound by HBM: one query against many
documents, and each query against its own candidates (reranking). Document-major tiles: each 64-token
int8 tile, brought by TMA through a deep ring, is the first operand of a warpgroup MMA from shared memory
against the query held in shared memory, while the previous tile's products are scaled and folded.

    acc[j, i]   = sum_k d8[j, k] * q8[i, k]                 (int32, exact; j a document token)
    score(q, d) = sum_{i in q} s_q[i] * max_{j in d} (s_d[j] * acc[j, i])

the math of `maxsim_int8` (its docstring): each `s_d[j] * acc[j, i]` is one fp32 product of the exact
integer and the fp32 scale, so the maxima are bit for bit those of the Triton kernels and of the float64
reference with `round_products`; the query-scale products and the sum over a query's rows are fp32 and
differ from the Triton kernels' only by the order of the additions.

Scope: on an sm_90 GPU with the Triton release the kernel was built with, scores only, dim 128, queries of
at most MAX_QUERY_TOKENS tokens (the query is wgmma's N: 16, 32 or 64 columns), and either one query
against all documents or candidates; everything else keeps the Triton kernels of `maxsim_int8`.

int4 codes (PACKED; `code_packing`, the same score with c[j] in -7..7 for d8[j]): a tile is 64 rows of 64
bytes, two values a byte. Each thread loads its bytes of the tile from shared memory straight into wgmma's
register operand layout (four consecutive bytes a register), splits them into the low and the high
nibbles and issues two products from registers, the low nibbles (values 2m) against the query's even
columns and the high ones against its odd columns, both held in shared memory. For queries of at most 32
tokens (BIASED) the nibbles are taken as stored, n + 8 (`code_unpacking`: 3 integer instructions for 8
values, where the signed values take 7), after a first product that starts the tile's accumulator at -8
sum q8 of each query row (`_correction_tiles`); at N = 64 the signed nibbles. The integer products and
maxima are those of the int8 kernel on the decoded values, bit for bit. A document's end does not wait
for the other warps (DEFER, `deferred`): each warp keeps the maxima of its 16 rows in the item's slot of a
shared buffer, and the program's scores are summed after its last tile (`_deferred_scores`; the sums in
another order than the int8 kernel's).
Bound (H100, 3.35 TB/s): 68 bytes a token, 1.09 GB for one query x 100K documents of 20-300 tokens, 0.33
ms; a tile brings 4 KB, so an SM takes one in every ~300 clocks at the bound. Measured 0.475 ms against
the Triton scan's 0.684 and fp16's 1.309 (docs/kernel-notes.md, "4-bit on the Gluon stream kernel").

int2 codes (QUARTER; `code_packing`: 2 bits a dimension, code v of dimension 4m + p in bits 2p, 2p + 1 of
byte m, the odd value 2v - 3; a scale a token): a tile is 64 rows of 32 bytes (TMA). Each thread loads its
bytes into wgmma's int8 register operand layout (four bytes a register) and takes code p of each byte as
its value v (`code_unpacking`: 7 integer instructions for 16 values, where the odd values take 16), and
issues four products from registers, part p against the query's columns 4m + p (the int8 codes of q *
steps, `int2_queries`, in shared memory); the fold makes each product the odd values' (2 acc - 3 sum q8,
exact in int32, `_retire`), then folds as int4 (the launcher adds each query row's q . offsets).
Queries of at most 32 tokens (INT2_MAX_QUERY_TOKENS). Bound (H100, 3.35 TB/s): 36 bytes a token, 0.58 GB
for one query x 100K documents, 0.17 ms; the products are 64 x N x 128 int8 MACs a tile, as int8's.

residual2 codes of separable buckets (RESIDUAL; `code_packing`: a row is a uint32 centroid id and 2 bits a
dimension, 36 bytes at dim 128; the query side `maxsim_codes.residual2_query_tables`): rows of 36 bytes are
not 16-byte aligned, so a tile's bucket words (32 bytes a row) come by cp.async, four bytes a copy, each
thread's copies arriving on the ring slot's barrier (its count is the threads'). Each thread loads its bytes
of the tile into wgmma's fp16 register operand layout (two consecutive bytes a pair of elements), makes each
2-bit bucket position p (dimensions 4m + p of byte m) into its bit planes b0 and b1 (fp16 0 or 2^-14:
`code_unpacking`) and chains eight products from registers, b_v of part p against the query's plane v of part
p (fp16, [32, N] in shared memory), into one fp32 accumulator: the Triton scan's products
(`maxsim_codes._code_tile`, CODEC 2); a tile's register operands are 64 registers a thread. The fold adds the
centroid table's entry of each token and query row (fp32, gathered from L2 by the token's id; the ids loaded
two tiles ahead and the entries gathered one tile ahead, so no load is waited for at the fold): sim = acc *
plane_scale + table[id, row]; NaN past the document, +inf for an id outside the codebook (the item then scores
NaN). Queries of at most 32 tokens (RESIDUAL_MAX_QUERY_TOKENS). Bound (H100): 36 bytes a token, 0.58 GB for
one query x 100K documents, 0.17 ms at 3.35 TB/s; the products are 64 x N x 256 fp16 MACs a tile (~250
tensor-core clocks an SM at N = 32, 0.29 ms for 300K tiles over 132 SMs), the unpacking ~140 integer
instructions a thread a tile beside them.

Work items. The items are the entries of a flat list: the candidates (item c scores query owner(c) against
document candidate_docs[c]), or for one query all documents (item c is document c). A program takes up to
ITEMS consecutive items of one query: program k < n_chunks the items of chunk k (items [k * ITEMS, (k + 1)
* ITEMS)) that belong to the query of the chunk's first item; for candidates, program n_chunks + q the
first items of query q when its list starts inside a chunk owned by an earlier query. Every item is scored
once. A candidate index outside [0, nd) (the host does not read candidates on the GPU) is walked as an
empty document, never read through, and scored NaN.

Per program (one warp group, 4 warps):

- the query's rows (zero past its length) go to shared memory once, as wgmma's second operand;
- the program walks its items' tiles in order, each document's first tile at its first token (the last
  one reads past the document: those rows get a NaN scale, whose products max ignores). Two cursors walk
  the same sequence of tiles: the ring's, STAGES tiles ahead, issues the TMA copies; the scales', two
  tiles ahead, loads each tile's 64 scales into registers (two a thread). Each cursor loads an item's
  document range one item ahead and the candidate's document index two ahead, so no load waits at a
  document's end. With TABLE (one query, where the codec's `Tuning.table` has N, from the second scan of
  the same offsets: `walks_table`) the cursors read the walk from a table counted once for the corpus's
  offsets (`walk_table`: a tile's first token, rows, last-tile bit and item in one int64, each entry
  loaded a tile before its use), where walking the offsets takes ~25 more instructions a tile and warp;
- tile t's product D8_t . Q8^T [64, N] (int32) is issued asynchronously; while it runs, tile t - 1's
  products are converted (the conversion instruction, exact for |acc| < 2^24), scaled by their token's
  scale and folded into a running maximum per element. At a document's last tile the maxima are reduced
  over the tokens, weighted by the query scales and summed: one score.

A producer warp (PRODUCER, `gl.warp_specialize`; int2's and int4's one query at N = 16 and 32,
`Tuning.producer`): a fifth warp owns the ring's cursor and its copies (`_produce`). It copies
tile x into slot x mod STAGES once the scan has handed back the slot's previous tile (an `empty` mbarrier
a slot, arrived on when that tile's products are done), and the four scanning warps (`_scan`) neither step
the ring's cursor nor issue copies: 30 (int2) and 44 (int4) fewer instructions a tile and warp in triton
3.6's sm_90 build (the loop of two tiles 461 against 521, 440 against 529), and where no document ends
that loop has four barriers of the warp group's 128 threads (before each `ready` wait, as before, and
before each hand-back, which one thread arrives on) against six CTA barriers, two memory barriers and two
proxy fences (Triton's shared-memory hazard analysis around each refill). Registers are handed out by
warp group, so a program holds eight warps' worth of its cap; the producer's group keeps
PRODUCER_REGISTERS and gives the rest to the scan's (a cap of 64 at N = 32: 104 registers; 56 at
N = 16: 88; the products not serialized, four programs an SM). The tiles, their order and the folds are
the same: the scores are the same bits.

Cost, bound (H200, HBM ~4.2-4.4 TB/s as the fp16 kernel reads): 132 bytes a token (128 of codes, 4 of
scale), one read each. One query x 100K documents of 20-300 tokens: 2.11 GB, 0.48-0.50 ms; rerank 64
queries x 1000 candidates x 180 tokens: 1.52 GB, 0.35-0.36 ms. A tile is 8 KB and 64 x N x 128 int8 MACs
(64 tensor-core clocks an SM at N = 32), 64 x N products past the MMA (three instructions each: 16 a
thread at N = 32). At the bound an SM takes in a tile every ~520 clocks, so neither the tensor cores nor
the issue slots are the limit; the bytes in flight are: at ~1.5 us of loaded latency an SM needs ~48 KB
outstanding, which the rings of the programs on an SM keep (each up to STAGES - 1 tiles ahead: five
programs x 3 x 8 KB for one query). Measured (docs/kernel-notes.md, "INT8 on HBM-bound shapes: the Gluon
stream kernel"): one query 0.514-0.549 ms (3.84-4.10 TB/s), rerank 0.406-0.428 ms (3.55-3.75 TB/s), against
the Triton TMA tiles' 0.622-0.674 and 0.446-0.464 in the same rounds.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .code_unpacking import INT4_BIASED_ASM as _BIASED_TEXT
from .code_unpacking import INT4_NIBBLES_ASM as _NIBBLES_TEXT
from .code_unpacking import PLANE_UNIT_ASM, bucket_planes_asm, quarter_values_asm
from .launch import hopper_device
from .maxsim_int8 import candidate_query
from .validation import cdiv, memo

if TYPE_CHECKING:
    from .maxsim_codes import QueryTables

BLOCK_T = 64  # document tokens a tile (wgmma's M)
# Tuning (triton 3.6; one query x 100K documents of 20-300 tokens, rerank 64 queries x 1000 candidates x
# 180 tokens; every alternative: docs/kernel-notes.md, "INT8 on HBM-bound shapes: the Gluon stream kernel").
STAGES = 4  # ring of tiles; 6: one query 0.558-0.595 ms against 0.553-0.588, 8: 0.616-0.681
GROUP = 2  # tiles a turn of the unrolled loop (two products in flight); the walk is padded to a multiple.
# 4: one query 0.580-0.601 ms against 0.558-0.586 (ring of 6)
ITEMS_ONE_QUERY = 32  # documents a program; 64: 0.551-0.613 ms
ITEMS_CANDIDATES = 16  # candidates a program; 32: 0.424-0.486 ms
MAX_ITEMS_CANDIDATES = 64  # a program's candidates with a bad index are the bits of one integer
NUM_WARPS = 4
_WARPS = gl.constexpr(NUM_WARPS)
# ptxas's register cap a thread by wgmma's N (the query tile's columns): (one query, candidates). At N <=
# 32 five and four programs an SM (65,536 registers / (programs x 128 threads)), no spills; at N = 64 the
# accumulators double, those caps spill (one query 1.68 ms, rerank 1.15, against the Triton tiles' 1.19
# and 0.84), uncapped (204 / 238 registers) two programs an SM run 0.97 / 0.63, and 168 (three programs,
# 12 bytes spilled for candidates) 0.72-0.75 / 0.586-0.591 (64-token queries).
REGISTERS = {16: (96, 128), 32: (96, 128), 64: (168, 168)}
MAX_QUERY_TOKENS = 64
# PRODUCER: the producer warp's registers (the fewest a warp group takes). Registers are handed out by
# warp group, so a program of four scanning warps and the producer holds eight warps' worth of its cap
# (`Tuning.producer`): cap x 256, of which the producer's group gives up all but these to the scan's.
PRODUCER_REGISTERS = 24
# PRODUCER's cap where a codec's tuning names none: 64 gives the scan's warps 104 registers, and 65,536 /
# (64 x 256) four programs an SM; at N = 32 (int2, int4) faster than 48 and 56, at N = 16 slower than 56
# (ab-producer-caps-n16-h100.json)
PRODUCER_CAP = 64
# PRODUCER's items a program: a sweep with 64 documents a program once did not finish on an H100; the
# 64-document programs run alone since (int4's one query of 13, 32 and 64 tokens, both walks, a ring of 2;
# int2's table walk) finished with the same bits (producer-64-items-h100.txt), the stall not reproduced.
# The tuned 32 and fewer are what the GPU tests compare bit for bit
PRODUCER_MAX_ITEMS = 32
_PRODUCER_REGISTERS = gl.constexpr(PRODUCER_REGISTERS)
_NIBBLES_ASM = gl.constexpr(_NIBBLES_TEXT)  # int4: the two nibbles of four bytes (`code_unpacking`)
_BIASED_ASM = gl.constexpr(_BIASED_TEXT)  # int4 as stored: the nibbles plus 8 (`code_unpacking`)
# residual2: the bit planes of bucket p of four bytes; int2: the values v of code p (`code_unpacking`)
_PLANES = gl.constexpr(tuple(bucket_planes_asm(p) for p in range(4)))
_QUARTERS = gl.constexpr(tuple(quarter_values_asm(p) for p in range(4)))
RESIDUAL_DIM = 128
# a residual2 row in int32 words: the centroid id, then 2 bits a dimension (36 bytes)
RESIDUAL_WORDS = gl.constexpr(1 + RESIDUAL_DIM // 16)
# queries of at most this many tokens: N = 64 would double the accumulators, running maxima and table
# entries (~100 more registers a thread beside the products' 64 register operands); not built
RESIDUAL_MAX_QUERY_TOKENS = 32


# int4, int2 and residual2: an item's end keeps each warp's maxima in shared memory (items x 4 warps x N
# fp32), the program's scores made at its end (`_deferred_scores`), where that takes at most this much
# (queries of at most 32 tokens; 16 KB for the tuned 32 items at N = 32): no barrier at a document's end.
DEFERRED_BYTES = 32 << 10


def deferred(codes: bool, items: int, n: int) -> bool:
    """Whether a launch keeps its items' maxima for the program's end (`DEFERRED_BYTES`): codes below 8
    bits (int4, int2, residual2) only."""
    return codes and n <= 32 and items * NUM_WARPS * n * 4 <= DEFERRED_BYTES


class Tuning(NamedTuple):
    """One codec's tiles: the ring's stages, tiles a turn, items a program (one query, candidates), the
    register caps by the query tile's N, the N at which one query walks the corpus's walk table
    (`walk_table`) rather than the documents' offsets, (N, stages) where one query's ring at that N
    is deeper or shallower than `stages`, and (N, register cap) where one query runs with a producer
    warp (PRODUCER; the cap is the kernel's, of which the scan's warps get 2 cap - PRODUCER_REGISTERS)."""

    stages: int
    group: int
    items_one_query: int
    items_candidates: int
    registers: dict[int, tuple[int, int]]
    table: tuple[int, ...] = ()
    ring: tuple[tuple[int, int], ...] = ()
    producer: tuple[tuple[int, int], ...] = ()

    def stages_at(self, n: int, one_query: bool) -> int:
        """The ring's depth at query tile N = `n`, for one query or for candidates."""
        return dict(self.ring).get(n, self.stages) if one_query else self.stages

    def cap(self, n: int, one_query: bool, producer: bool) -> int:
        """The register cap at query tile N = `n` (0: none), with or without a producer warp."""
        if producer:
            return dict(self.producer).get(n, PRODUCER_CAP)
        return self.registers[n][0 if one_query else 1]


def takes_producer(tuned: Tuning, n: int, one_query: bool, items: int) -> bool:
    """Whether a launch's tuned plan has a producer warp fill the ring (PRODUCER): one query, at a query
    tile N = `n` that the codec's `Tuning.producer` names, in programs of at most PRODUCER_MAX_ITEMS
    items."""
    return one_query and n in dict(tuned.producer) and items <= PRODUCER_MAX_ITEMS


INT8_TILES = Tuning(STAGES, GROUP, ITEMS_ONE_QUERY, ITEMS_CANDIDATES, REGISTERS)
# int4 (PACKED), one query x 100K documents on an H100 (bench_codes.py --stream-sweep, before DEFER:
# codes-stream-sweep-h100-6ce52ad.json):
# 0.588 ms with a ring of 4 (6: 0.597, 8: 0.591, 12: 0.604); 16 documents a program 0.668, 64 0.612; 4
# tiles a turn 0.654; the cap of 128 registers (four programs an SM) against 168 0.684, none (138, three
# programs) 0.688 and 96 (spills) 0.936: the scan is bound by the latency of each program's chain of a
# tile (load into registers, unpack, two products, fold), so programs an SM count, the ring's depth not.
# With the codes multiplied as stored (bench_codes.py --stream-sweep int2,int4, H100,
# codes-stream-sweep-h100-5863efa.json), one query at N = 32 under a cap of 80 registers (no spills): 0.443 ms
# against 0.460 at 128 (five programs an SM, bound by its 40 KB of shared memory, against four), 72 0.471,
# 96 0.507; at N = 16 a cap of 80 spills 132 bytes
# The walk table (`walk_table`, one query x 100K documents, H100, `python benchmarks/ab_stream_codes.py
# --codecs int2,int4 --baseline-tiles table=0 --current-tiles table=1 --rounds 5`,
# ab-walk-table-5rounds-h100-33eb8ba.json, the same bits): int4 at N = 16 (13-token query) 0.395 ms against
# 0.414 walking the offsets, at N = 64 0.849 against 0.901, at N = 32 0.450 against 0.439 (slower: kept);
# int2 at N = 16 0.346 against 0.401, at N = 32 0.413 against 0.421; int8 at N = 32 0.699 either way
# One query's ring at N = 64 (a query of 64 tokens, the table's walk, `python benchmarks/ab_stream_codes.py
# --codecs int2,int4 --rounds 5 --rep-ms 80 --current-tiles stages=3 --current-tiles stages=6`, H100,
# ab-tiles-sweep-h100.json): 0.772 ms with 3 stages, 0.771 with 6, against 0.840 with 4; at N = 32
# 6 stages ran 4% slower and 3 no faster, at N = 16 both 1-2% slower: 6 at N = 64 alone. Candidates of
# 64-token queries keep 4: 0.636 ms with 6 against 0.591 (ab-tuned-cand64-ring6-h100.json). Against the
# previous tuning (`--baseline` the previous module, ab-tuned-{table,offsets,cand64}-h100.json): one query of
# 64 tokens 0.777 ms against 0.841 (the offsets' walk 0.895 against 0.901), candidates 0.594 either way
# A producer warp (PRODUCER; `python benchmarks/ab_stream_codes.py --codecs int2,int4 --rounds 3 --rep-ms 80
# --current-tiles producer=1,maxnreg=64`, H100, ab-producer-h100.json, the same bits): one query at N = 32
# 0.4315 ms against 0.4506 (the scan's warps at 104 registers, four programs an SM, products not
# serialized; a ring of 3, 6 or 8 no faster: ab-producer-stages{3,6,8}-h100.json), at N = 16 0.425
# against 0.412, at N = 64 0.990 against 0.778, candidates 0.437 against 0.366; a cap of 72 (three
# programs an SM) 0.455 at N = 32 (ab-producer-caps-h100.txt). Taken at N = 32: the tuning against the
# same without it (`--baseline-tiles producer=0`, ab-producer-taken-h100.json) 0.4195 ms against 0.4393,
# the other cases unchanged. At N = 16 caps of 48 and 56 ran 1.04x faster (ab-producer-caps-n16-h100.json);
# 56 taken (not serialized, four programs an SM): against the same without the producer (`--baseline-tiles
# producer=0`, ab-producer-n16-taken-h100.json, the same bits) 0.3964 ms against 0.4111 at N = 16
INT4_TILES = Tuning(4, 2, 32, 16, {16: (128, 128), 32: (80, 128), 64: (168, 168)}, table=(16, 64),
                    ring=((64, 6),), producer=((16, 56), (32, PRODUCER_CAP)))  # fmt: skip
# residual2 (RESIDUAL), one query x 100K documents on an H100 (bench_codes.py --stream-sweep): 1.235 ms with
# a ring of 6, 2 tiles a turn and a cap of 128 registers (four programs an SM), against 1.305 at 168 (three)
# and 1.355 uncapped (255, two programs); 4 tiles a turn 1.470 uncapped
# int2 (QUARTER), the same sweep: one query at N = 32 under a cap of 80 registers (no spills, six programs an
# SM against four) 0.417 ms against 0.444 at 128, 72 0.428, 96 0.508, 64 (spills) 0.529; a ring of 6 or 8
# 0.421-0.424, 64 documents a program 0.454, 16 0.629; at N = 16 a cap of 80 spilled 80 bytes then (72 builds
# without spills since: below). Queries of at most 32 tokens (INT2_MAX_QUERY_TOKENS): at N = 64 the
# candidates build spills 200 bytes under int4's cap of 168 registers.
# At N = 16 (queries of at most 16 tokens) one query under a cap of 72 registers, seven programs an SM (its
# products serialized, no spills): 0.3115 ms against 0.3458 at 128 (four, unserialized) and 0.393 at 88, the
# table's walk (the ab_stream_codes.py sweep of INT4_TILES' ring, ab-tiles-sweep-h100.json); against
# the previous tuning (ab-tuned-table-h100.json, ab-tuned-offsets-h100.json) 0.312 against 0.346 walking
# the table, 0.341 against 0.400 walking the offsets
# A producer warp (the same runs as int4's): one query at N = 32 0.3798 ms against 0.4113, at N = 16 0.350
# against 0.312 (seven programs an SM without it), candidates 0.457 against 0.373; a cap of 72: 0.502 at
# N = 32. Taken at N = 32 (ab-producer-taken-h100.json: 0.3808 against 0.4121 ms, the same bits); at N = 16
# a cap of 48 or 56 ran 0.296 against 0.312 (ab-producer-caps-n16-h100.json), 56 taken as int4's
# (ab-producer-n16-taken-h100.json: 0.2957 against 0.3122 ms, the same bits)
INT2_TILES = Tuning(4, 2, 32, 16, {16: (72, 128), 32: (80, 128)}, table=(16, 32),
                    producer=((16, 56), (32, PRODUCER_CAP)))
INT2_MAX_QUERY_TOKENS = 32
RESIDUAL2_TILES = Tuning(6, 2, 32, 16, {16: (128, 128), 32: (128, 128)})


@gluon.jit
def _is_bad(bad, c, ITEMS: gl.constexpr):
    """Whether item c's candidate index is outside [0, n_docs): bit c mod ITEMS of the run's mask `bad`."""
    return ((bad >> (c % ITEMS)) & 1) != 0


@gluon.jit
def _item_range(c, c_last, cand_ptr, off_ptr, bad, IDENTITY: gl.constexpr, ITEMS: gl.constexpr):
    """Document range [start, end) of item c (0, 0 at or past c_last, or for a bad index), int32."""
    ok = c < c_last
    if not IDENTITY:
        ok = ok & ~_is_bad(bad, c, ITEMS)
    if IDENTITY:
        doc = c
    else:
        doc = gl.load(cand_ptr + c, mask=ok, other=0).to(gl.int32)
    start = gl.load(off_ptr + doc, mask=ok, other=0).to(gl.int32)
    end = gl.load(off_ptr + doc + 1, mask=ok, other=0).to(gl.int32)
    return start, end


@gluon.jit
def _item_doc(c, c_last, cand_ptr, IDENTITY: gl.constexpr):
    """Document of item c (0 at or past c_last)."""
    if IDENTITY:
        return gl.where(c < c_last, c, 0)
    else:
        return gl.load(cand_ptr + c, mask=c < c_last, other=0).to(gl.int32)


@gluon.jit
def _table_entry(walk_ptr, i, walk_last):
    """Tile i's entry of the walk's table (`walk_table`; past the program's last tile, its last
    tile's): (first token, meta: its rows in the document | its last-tile bit << 7 | item mod ITEMS << 8)."""
    entry = gl.load(walk_ptr + gl.minimum(i, walk_last))
    return entry.to(gl.int32), (entry >> 32).to(gl.int32)


@gluon.jit
def _cursor_start(c_first, c_last, cand_ptr, off_ptr, bad, walk_ptr, walk_last, IDENTITY: gl.constexpr,
                  ITEMS: gl.constexpr, TABLE: gl.constexpr):  # fmt: skip
    """A cursor at the first tile of item c_first: (item, tile's first token, document end, next item's
    start and end, document of the item after it). Past c_last the ranges are (0, 0) or stale, which only
    padding tiles (copied, never folded) read. TABLE (one query, `walk_table`): (tile, first token, the
    end of its rows, the next tile's first token and meta, this tile's meta), the next tile's entry
    loaded a tile ahead of its use."""
    if TABLE:
        tok, meta = _table_entry(walk_ptr, 0, walk_last)
        n_tok, n_meta = _table_entry(walk_ptr, 1, walk_last)
        return c_first * 0, tok, tok + (meta & 127), n_tok, n_meta, meta
    tok, end = _item_range(c_first, c_last, cand_ptr, off_ptr, bad, IDENTITY, ITEMS)
    n_start, n_end = _item_range(c_first + 1, c_last, cand_ptr, off_ptr, bad, IDENTITY, ITEMS)
    n_doc = _item_doc(c_first + 2, c_last, cand_ptr, IDENTITY)
    return c_first, tok, end, n_start, n_end, n_doc


@gluon.jit
def _cursor_next(c, tok, end, n_start, n_end, n_doc, c_last, cand_ptr, off_ptr, bad, walk_ptr, walk_last,
                 IDENTITY: gl.constexpr, ITEMS: gl.constexpr, BLOCK_T: gl.constexpr,
                 TABLE: gl.constexpr):  # fmt: skip
    """The cursor at the next tile. Entering an item it loads the range of the item after it (whose
    document index it loaded one item earlier) and the document index of the one after that: each loaded
    value is first used an item later, and a masked load keeps its register's old value, so no load is
    waited for here (a select of the loaded value would wait for it). A bad index (`bad`) is not read
    through: its range is (0, 0), set by the masked load's fallback value, selected before the load.
    TABLE: the next tile is the entry loaded a tile ago; the one after it is loaded now."""
    if TABLE:
        n_tok, n_meta = _table_entry(walk_ptr, c + 2, walk_last)
        return c + 1, n_start, n_start + (n_end & 127), n_tok, n_meta, n_end
    last = tok + BLOCK_T >= end
    tok = gl.where(last, n_start, tok + BLOCK_T)
    end = gl.where(last, n_end, end)
    c = gl.where(last, c + 1, c)
    # past c_last nothing is loaded: the cursor walks the last item's range again, for padding tiles
    take = last & (c + 1 < c_last)
    if IDENTITY:
        n_start = gl.load(off_ptr + n_doc, mask=take, other=n_start).to(gl.int32)
        n_end = gl.load(off_ptr + n_doc + 1, mask=take, other=n_end).to(gl.int32)
    else:
        read = take & ~_is_bad(bad, c + 1, ITEMS)
        n_start = gl.load(off_ptr + n_doc, mask=read, other=gl.where(take, 0, n_start)).to(gl.int32)
        n_end = gl.load(off_ptr + n_doc + 1, mask=read, other=gl.where(take, 0, n_end)).to(gl.int32)
    if IDENTITY:
        n_doc = gl.where(last & (c + 2 < c_last), c + 2, n_doc)
    else:
        n_doc = gl.load(cand_ptr + c + 2, mask=last & (c + 2 < c_last), other=n_doc).to(gl.int32)
    return c, tok, end, n_start, n_end, n_doc


@gluon.jit
def _cursor_place(c, tok, end, meta, c_first, BLOCK_T: gl.constexpr, TABLE: gl.constexpr):
    """The cursor's tile in the walk: (whether it is its item's last, its item)."""
    if TABLE:
        return ((meta >> 7) & 1) != 0, c_first + (meta >> 8)
    return tok + BLOCK_T >= end, c


@gluon.jit
def _tile_scales(sd_ptr, tok, end, rows):
    """The tile's token scales in the accumulator's row layout, NaN past the document."""
    return gl.load(sd_ptr + tok + rows, mask=tok + rows < end, other=float("nan"))


@gluon.jit
def _copy_codes(codes_ptr, smem, bar, tok, n_tokens, BLOCK_T: gl.constexpr):
    """residual2: the bucket words (1 .. 8) of rows tok .. tok + BLOCK_T - 1 into smem [BLOCK_T, 8] int32
    by cp.async, four bytes a copy (a row is 36 bytes: no 16-byte alignment for TMA); `bar` completes its
    phase when every thread's copies have landed (its count is the threads'). Rows past the codes are not
    read."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [_WARPS, 1], [1, 0])
    rows = tok + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, layout))
    words = 1 + gl.arange(0, RESIDUAL_WORDS - 1, layout=gl.SliceLayout(0, layout))
    at = codes_ptr + rows.to(gl.int64)[:, None] * RESIDUAL_WORDS + words[None, :]
    async_copy.async_copy_global_to_shared(smem, at, mask=(rows < n_tokens)[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _request(d_desc, d_smem, ready, slot, tok, n_tokens, BLOCK_T: gl.constexpr, RESIDUAL: gl.constexpr):
    """Copy the tile at token tok into ring slot `slot`: by TMA, or by cp.async for residual2 codes."""
    if RESIDUAL:
        _copy_codes(d_desc, d_smem.index(slot), ready.index(slot), tok, n_tokens, BLOCK_T)
    else:
        mbarrier.expect(ready.index(slot), d_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(d_desc, [tok, 0], ready.index(slot), d_smem.index(slot))


@gluon.jit
def _tile_ids(codes_ptr, tok, end, rows, n_centroids):
    """residual2: the tile's centroid ids in the accumulator's row layout, -1 past the document and
    n_centroids for an id outside the codebook (stored ids are uint32: 2^31 and above read negative)."""
    inside = tok + rows < end
    cid = gl.load(codes_ptr + (tok + rows).to(gl.int64) * RESIDUAL_WORDS, mask=inside, other=0)
    cid = gl.where((cid >= 0) & (cid < n_centroids), cid, n_centroids)
    return gl.where(inside, cid, -1)


@gluon.jit
def _tile_centroids(tab_ptr, ids, cols, stride_tab, n_centroids):
    """residual2: the centroid table's entries of the tile's tokens ([BLOCK_T, N] fp32, `_tile_ids`' ids):
    NaN past the document (max ignores it), +inf for an id outside the codebook (the item scores NaN). The
    N columns from the query's first row are read whatever its length: past it they are the next rows' (or
    the table's slack, `maxsim_codes.TABLE_SLACK`), never summed."""
    ok = (ids >= 0) & (ids < n_centroids)
    fill = gl.where(ids < 0, float("nan"), float("inf"))
    at = tab_ptr + ids.to(gl.int64)[:, None] * stride_tab + cols[None, :]
    return gl.load(at, mask=ok[:, None], other=fill[:, None])


@gluon.jit
def _side(sd_ptr, codes_ptr, tok, end, rows, n_centroids, RESIDUAL: gl.constexpr):
    """What the fold of a tile takes beside its products, loaded two tiles ahead: its token scales, or
    for residual2 its centroid ids (`_tile_ids`; their table entries are gathered a tile later)."""
    if RESIDUAL:
        return _tile_ids(codes_ptr, tok, end, rows, n_centroids)
    else:
        return _tile_scales(sd_ptr, tok, end, rows)


@gluon.jit
def _ready_side(side, tab_ptr, cols, stride_tab, n_centroids, RESIDUAL: gl.constexpr):
    """The next tile's fold input: the scales as loaded, or residual2's centroid table entries gathered by
    the ids loaded a tile earlier."""
    if RESIDUAL:
        return _tile_centroids(tab_ptr, side, cols, stride_tab, n_centroids)
    else:
        return side


@gluon.jit
def _bucket_planes(packed, PART: gl.constexpr):
    """Bit planes b0 and b1 of bucket position PART of each byte (`code_unpacking.bucket_planes_asm`)."""
    b0, b1, _ = gl.inline_asm_elementwise(
        _PLANES[PART], "=r,=r,=r,=r,=r,=r,r", [packed], dtype=(gl.float16,) * 3, is_pure=True, pack=4
    )
    return b0, b1


@gluon.jit
def _residual_products(packed, q_planes, zero):
    """residual2: the tile's products, bit planes b0 and b1 of each bucket position p (dimensions 4m + p,
    byte m of the buckets) against the query planes 0 and 1 of part p (`q_planes` index 4v + p): eight
    from registers, chained."""
    acc = zero
    for p in gl.static_range(4):
        b0, b1 = _bucket_planes(packed, p)
        acc = warpgroup_mma(b0, q_planes.index(p).permute((1, 0)), acc, use_acc=p > 0, is_async=True)
        acc = warpgroup_mma(b1, q_planes.index(4 + p).permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _correction_tiles(fix, BLOCK_T: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
    """The operands of a product that starts each tile's accumulator at `fix` (int32 [N], a query row's
    correction, |fix| < 2^17; the slice of `layout` along its rows): A [BLOCK_T, 32] int8 is 1 in its first
    16 columns and 127 in the others, and B [N, 32] int8 splits fix into 127 hi + lo (hi the nearest
    integer of fix / 127, |lo| <= 63), hi spread over the last 16 entries and lo over the first 16, each
    within [-65, 65]: A . B^T = fix in every row, exact in int32. Both in shared memory."""
    k = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, layout))
    a = gl.where(k[None, :] < 16, 1, 127) + 0 * rows[:, None]
    a_smem = gl.allocate_shared_memory(
        gl.int8, [BLOCK_T, 32], gl.NVMMASharedLayout.get_default_for([BLOCK_T, 32], gl.int8)
    )
    a_smem.store(a.to(gl.int8))
    hi = (fix + 127 * 2048 + 63) // 127 - 2048  # operands kept non-negative: // and % of C
    lo = fix - 127 * hi
    half = gl.where(k[None, :] < 16, lo[:, None], hi[:, None]) + 2048  # 16 entries summing to it, + 2048
    b = half // 16 - 128 + ((k[None, :] % 16) < half % 16).to(gl.int32)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 32], gl.int8)
    b_smem = gl.allocate_shared_memory(gl.int8, [N, 32], b_layout)
    b_smem.store(b.to(gl.int8))
    return a_smem, b_smem


@gluon.jit
def _quarter(packed, PART: gl.constexpr):
    """int2: the values v (0..3) of 2-bit code PART of each byte as int8 (`code_unpacking`)."""
    return gl.inline_asm_elementwise(_QUARTERS[PART], "=r,r", [packed], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _quarter_products(packed, q_parts, zero):
    """int2: the tile's products, code p of each byte (dimensions 4m + p) against the query's part p:
    four from registers, chained; of the values v, which the fold makes the odd values' (`_retire`)."""
    acc = zero
    for p in gl.static_range(4):
        acc = warpgroup_mma(_quarter(packed, p), q_parts.index(p).permute((1, 0)), acc, use_acc=p > 0,
                            is_async=True)  # fmt: skip
    return acc


@gluon.jit
def _product(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, x, zero, STAGES: gl.constexpr, PACKED: gl.constexpr,
             RESIDUAL: gl.constexpr, QUARTER: gl.constexpr, BIASED: gl.constexpr):  # fmt: skip
    """Tile x's D8 . Q8^T, asynchronous, once its copy has landed. PACKED (int4 codes): the tile's bytes
    are loaded into wgmma's register operand layout and split into their low and high nibbles (values 2m
    and 2m + 1; with BIASED as stored, plus 8, after the correction's product `_correction_tiles`), each
    multiplied with the query's matching columns (q_t, q_hi_t); ptxas keeps those registers until the
    products are waited for (it serializes the wgmmas where it cannot: the build test says where that is
    measured the faster build)."""
    slot = x % STAGES
    mbarrier.wait(ready.index(slot), (x // STAGES) & 1)
    if RESIDUAL:
        # q_t holds the query planes [8, N, 32] (plane v of part p at 4v + p), d_smem the tiles' bytes
        a_layout_r: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zero.type.layout, k_width=2)
        return _residual_products(d_smem.index(slot).load(a_layout_r), q_t, zero)
    elif QUARTER:
        # q_t holds the query's parts [4, N, DIM / 4] (part p: the columns 4m + p)
        a_layout_q: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zero.type.layout, k_width=4)
        return _quarter_products(d_smem.index(slot).load(a_layout_q), q_t, zero)
    elif PACKED:
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zero.type.layout, k_width=4)
        packed = d_smem.index(slot).load(a_layout)
        if BIASED:
            low, high = gl.inline_asm_elementwise(
                _BIASED_ASM, "=r,=r,r", [packed], dtype=(gl.int8, gl.int8), is_pure=True, pack=4
            )
            acc = warpgroup_mma(fix_a, fix_b.permute((1, 0)), zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(low, q_t, acc, is_async=True)
        else:
            low, high = gl.inline_asm_elementwise(
                _NIBBLES_ASM, "=r,=r,r", [packed], dtype=(gl.int8, gl.int8), is_pure=True, pack=4
            )
            acc = warpgroup_mma(low, q_t, zero, use_acc=False, is_async=True)
        return warpgroup_mma(high, q_hi_t, acc, is_async=True)
    else:
        return warpgroup_mma(d_smem.index(slot), q_t, zero, use_acc=False, is_async=True)


@gluon.jit
def _retire(acc, x, run, sc, sc_next, last, item, pc, ps, pe, pns, pne, pnd, s_c, s_tok, s_end, s_ns, s_ne,
            s_nd, scan, IDENTITY: gl.constexpr, ITEMS: gl.constexpr, BLOCK_T: gl.constexpr,
            STAGES: gl.constexpr, DEFER: gl.constexpr, RESIDUAL: gl.constexpr, QUARTER: gl.constexpr,
            TABLE: gl.constexpr, PRODUCER: gl.constexpr):  # fmt: skip
    """Tile x's product is done: refill its ring slot with tile x + STAGES (the ring cursor p's tile),
    fold tile x (`sc`: its scales, or residual2's centroid table entries; item `item`, `last` if it ends
    the item) into the running maxima `run`, storing the item's score at its end (NaN for a bad index),
    and load what the fold of tile x + 2 takes (the side cursor s; `_side`). Returns tile x + 1's fold
    input ready (`_ready_side` of `sc_next`) and tile x + 2's as loaded. With DEFER the item's end keeps
    each warp's maxima of its rows in `partial` (shared memory, a slot an item of the program) and no warp
    waits for another: `_deferred_scores` finishes the program's items at its end. QUARTER: the products of
    int2's values v become the odd values' as 2 acc + q_fix (q_fix = -3 sum q8 of the query row), exact in
    int32."""
    (tiles, total, qs, q_ok, out_ptr, rows, c_last, cand_ptr, off_ptr, sd_ptr, d_desc, d_smem, ready, bad,
     partial, c_first, n_tokens, cols, stride_tab, n_centroids, plane_scale, q_fix, walk_ptr, walk_last,
     empty) = scan
    if PRODUCER:
        mbarrier.arrive(empty.index(x % STAGES), count=1)
    elif x + STAGES < tiles:
        _request(d_desc, d_smem, ready, x % STAGES, ps, n_tokens, BLOCK_T, RESIDUAL)
        pc, ps, pe, pns, pne, pnd = _cursor_next(pc, ps, pe, pns, pne, pnd, c_last, cand_ptr, off_ptr, bad,
                                                 walk_ptr, walk_last, IDENTITY, ITEMS, BLOCK_T,
                                                 TABLE)  # fmt: skip
    if x < total:
        if RESIDUAL:
            v = acc * plane_scale + sc
        else:
            if QUARTER:
                acc = acc * 2 + q_fix[None, :]
            v = acc.to(gl.float32) * sc[:, None]
        run = gl.maximum(run, v)
        if last:
            if DEFER:
                # rows 16w .. 16w + 15 are warp w's (the accumulator's layout): their max stays in the warp
                by_warp = gl.max(gl.reshape(run, [_WARPS, BLOCK_T // _WARPS, run.shape[1]]), axis=1)
                partial.index(item - c_first).store(by_warp)
            else:
                best = gl.max(run, axis=0)
                score = gl.sum(gl.where(q_ok, qs * best, 0.0), axis=0)
                if RESIDUAL:  # +inf only from a centroid id outside the codebook
                    score = gl.where(score == float("inf"), float("nan"), score)
                if not IDENTITY:
                    score = gl.where(_is_bad(bad, item, ITEMS), float("nan"), score)
                gl.store(out_ptr + item, score)
            run = gl.full(run.shape, float("-inf"), gl.float32, run.type.layout)
    # tile x + 1's fold input, then what tile x + 2's takes and its place in the walk
    sc_ready = _ready_side(sc_next, sd_ptr, cols, stride_tab, n_centroids, RESIDUAL)
    sc_new = _side(sd_ptr, d_desc, s_tok, s_end, rows, n_centroids, RESIDUAL)
    last_new, item_new = _cursor_place(s_c, s_tok, s_end, s_nd, c_first, BLOCK_T, TABLE)
    s_c, s_tok, s_end, s_ns, s_ne, s_nd = _cursor_next(s_c, s_tok, s_end, s_ns, s_ne, s_nd, c_last, cand_ptr,
                                                       off_ptr, bad, walk_ptr, walk_last, IDENTITY, ITEMS,
                                                       BLOCK_T, TABLE)  # fmt: skip
    return (run, sc_ready, sc_new, last_new, item_new, pc, ps, pe, pns, pne, pnd,
            s_c, s_tok, s_end, s_ns, s_ne, s_nd)  # fmt: skip


@gluon.jit
def _deferred_scores(partial, qs_ptr, row_first, row_last, c_first, c_last, out_ptr, bad,
                     IDENTITY: gl.constexpr, ITEMS: gl.constexpr, N: gl.constexpr,
                     RESIDUAL: gl.constexpr):  # fmt: skip
    """The scores of the program's items from the warps' maxima kept in `partial` ([ITEMS, warps, N], DEFER):
    the max over the warps, weighted by the query's scales and summed (NaN for a bad index)."""
    gl.thread_barrier()
    layout: gl.constexpr = gl.BlockedLayout([1, _WARPS, 1], [32 // N, 1, N], [_WARPS, 1, 1], [2, 1, 0])
    # the same bytes (row-major, unswizzled) seen whole: a slot an item was written through `index`
    whole = partial._reinterpret(gl.float32, [ITEMS, _WARPS, N], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    best = gl.max(whole.load(layout), axis=1)
    best_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols = row_first + gl.arange(0, N, layout=gl.SliceLayout(0, best_layout))
    q_ok = cols < row_last
    qs = gl.load(qs_ptr + cols, mask=q_ok, other=0.0)
    score = gl.sum(gl.where(q_ok[None, :], qs[None, :] * best, 0.0), axis=1)
    if RESIDUAL:  # +inf only from a centroid id outside the codebook
        score = gl.where(score == float("inf"), float("nan"), score)
    items = c_first + gl.arange(0, ITEMS, layout=gl.SliceLayout(1, best_layout))
    if not IDENTITY:
        score = gl.where(_is_bad(bad, items, ITEMS), float("nan"), score)
    gl.store(out_ptr + items, score, mask=items < c_last)


@gluon.jit
def _scan(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, empty, tiles, total, qs, q_ok, out_ptr,
          c_first, c_last, cand_ptr, off_ptr, sd_ptr, d_desc, ring, bad, partial, n_tokens, cols,
          stride_tab, n_centroids, plane_scale, q_fix, walk_ptr, walk_last, qs_ptr, row_first, row_last,
          pc, ps, pe, pns, pne, pnd, acc_layout: gl.constexpr,
          IDENTITY: gl.constexpr, ITEMS: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr,
          GROUP: gl.constexpr, N: gl.constexpr, PACKED: gl.constexpr, DEFER: gl.constexpr,
          RESIDUAL: gl.constexpr, QUARTER: gl.constexpr, BIASED: gl.constexpr, TABLE: gl.constexpr,
          PRODUCER: gl.constexpr):  # fmt: skip
    """The program's walk of its tiles (the module docstring, "Per program"): each tile's products, the
    previous tile's fold, the items' scores. The ring's tiles 0 .. STAGES - 1 are requested, its cursor
    (pc ..) at tile STAGES; the scan refills each slot once its tile's products are done. With PRODUCER
    the producer warp (`_produce`) fills the ring: the scan hands each slot back on `empty` instead, and
    the ring's cursor is not its own (pc .. unused)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    # the fold inputs of tiles 0 (ready) and 1 (as loaded), their cursor left at tile 2
    rows = gl.arange(0, BLOCK_T, layout=row_layout)
    s_c, s_tok, s_end, s_ns, s_ne, s_nd = _cursor_start(c_first, c_last, cand_ptr, off_ptr, bad, walk_ptr,
                                                        walk_last, IDENTITY, ITEMS, TABLE)  # fmt: skip
    sc0 = _ready_side(_side(sd_ptr, d_desc, s_tok, s_end, rows, n_centroids, RESIDUAL), sd_ptr, cols,
                      stride_tab, n_centroids, RESIDUAL)  # fmt: skip
    last0, item0 = _cursor_place(s_c, s_tok, s_end, s_nd, c_first, BLOCK_T, TABLE)
    s_c, s_tok, s_end, s_ns, s_ne, s_nd = _cursor_next(s_c, s_tok, s_end, s_ns, s_ne, s_nd, c_last,
                                                       cand_ptr, off_ptr, bad, walk_ptr, walk_last,
                                                       IDENTITY, ITEMS, BLOCK_T, TABLE)  # fmt: skip
    sc1 = _side(sd_ptr, d_desc, s_tok, s_end, rows, n_centroids, RESIDUAL)
    last1, item1 = _cursor_place(s_c, s_tok, s_end, s_nd, c_first, BLOCK_T, TABLE)
    s_c, s_tok, s_end, s_ns, s_ne, s_nd = _cursor_next(s_c, s_tok, s_end, s_ns, s_ne, s_nd, c_last,
                                                       cand_ptr, off_ptr, bad, walk_ptr, walk_last,
                                                       IDENTITY, ITEMS, BLOCK_T, TABLE)  # fmt: skip

    run = gl.full([BLOCK_T, N], float("-inf"), gl.float32, acc_layout)
    zero = gl.zeros([BLOCK_T, N], gl.float32 if RESIDUAL else gl.int32, acc_layout)
    # what the fold of every tile reads (`_retire`)
    scan = (tiles, total, qs, q_ok, out_ptr, rows, c_last, cand_ptr, off_ptr, sd_ptr, d_desc, ring, ready,
            bad, partial, c_first, n_tokens, cols, stride_tab, n_centroids, plane_scale, q_fix, walk_ptr,
            walk_last, empty)
    # wgmma groups a tile's products take (`_product`): waiting for all but the newest tile's
    PRODUCTS: gl.constexpr = 8 if RESIDUAL else (4 if QUARTER else (2 + BIASED if PACKED else 1))
    for base in range(0, tiles, GROUP):
        t_a = _product(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, base, zero, STAGES, PACKED, RESIDUAL,
                       QUARTER, BIASED)  # fmt: skip
        t_b = _product(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, base + 1, zero, STAGES, PACKED, RESIDUAL,
                       QUARTER, BIASED)  # fmt: skip
        t_b, acc_a = warpgroup_mma_wait(num_outstanding=PRODUCTS, deps=[t_b, t_a])
        (run, sc0, sc1, last2, item2, pc, ps, pe, pns, pne, pnd,
         s_c, s_tok, s_end, s_ns, s_ne, s_nd) = _retire(
            acc_a, base, run, sc0, sc1, last0, item0, pc, ps, pe, pns, pne, pnd,
            s_c, s_tok, s_end, s_ns, s_ne, s_nd, scan,
            IDENTITY, ITEMS, BLOCK_T, STAGES, DEFER, RESIDUAL, QUARTER, TABLE, PRODUCER,
        )  # fmt: skip
        last0, item0, last1, item1 = last1, item1, last2, item2
        for j in gl.static_range(2, GROUP, 2):
            t_a = _product(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, base + j, zero, STAGES, PACKED,
                           RESIDUAL, QUARTER, BIASED)  # fmt: skip
            t_a, acc_b = warpgroup_mma_wait(num_outstanding=PRODUCTS, deps=[t_a, t_b])
            (run, sc0, sc1, last2, item2, pc, ps, pe, pns, pne, pnd,
             s_c, s_tok, s_end, s_ns, s_ne, s_nd) = _retire(
                acc_b, base + j - 1, run, sc0, sc1, last0, item0, pc, ps, pe, pns, pne, pnd,
                s_c, s_tok, s_end, s_ns, s_ne, s_nd, scan,
                IDENTITY, ITEMS, BLOCK_T, STAGES, DEFER, RESIDUAL, QUARTER, TABLE, PRODUCER,
            )  # fmt: skip
            last0, item0, last1, item1 = last1, item1, last2, item2
            t_b = _product(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, base + j + 1, zero, STAGES, PACKED,
                           RESIDUAL, QUARTER, BIASED)  # fmt: skip
            t_b, acc_a = warpgroup_mma_wait(num_outstanding=PRODUCTS, deps=[t_b, t_a])
            (run, sc0, sc1, last2, item2, pc, ps, pe, pns, pne, pnd,
             s_c, s_tok, s_end, s_ns, s_ne, s_nd) = _retire(
                acc_a, base + j, run, sc0, sc1, last0, item0, pc, ps, pe, pns, pne, pnd,
                s_c, s_tok, s_end, s_ns, s_ne, s_nd, scan,
                IDENTITY, ITEMS, BLOCK_T, STAGES, DEFER, RESIDUAL, QUARTER, TABLE, PRODUCER,
            )  # fmt: skip
            last0, item0, last1, item1 = last1, item1, last2, item2
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[t_b])
        (run, sc0, sc1, last2, item2, pc, ps, pe, pns, pne, pnd,
         s_c, s_tok, s_end, s_ns, s_ne, s_nd) = _retire(
            acc_b, base + GROUP - 1, run, sc0, sc1, last0, item0, pc, ps, pe, pns, pne, pnd,
            s_c, s_tok, s_end, s_ns, s_ne, s_nd, scan,
            IDENTITY, ITEMS, BLOCK_T, STAGES, DEFER, RESIDUAL, QUARTER, TABLE, PRODUCER,
        )  # fmt: skip
        last0, item0, last1, item1 = last1, item1, last2, item2

    if DEFER:
        _deferred_scores(partial, qs_ptr, row_first, row_last, c_first, c_last, out_ptr, bad, IDENTITY,
                         ITEMS, N, RESIDUAL)  # fmt: skip


@gluon.jit
def _produce(d_desc, ring, ready, empty, tiles, c_first, c_last, cand_ptr, off_ptr, bad, walk_ptr, walk_last,
             n_tokens, IDENTITY: gl.constexpr, ITEMS: gl.constexpr, BLOCK_T: gl.constexpr,
             STAGES: gl.constexpr, TABLE: gl.constexpr):  # fmt: skip
    """PRODUCER: one warp that fills the ring. Tile x goes to slot x mod STAGES once the scan has handed
    the slot's previous tile back (`empty`, phase x // STAGES - 1; the first STAGES tiles wait for
    nothing), its copy arriving on `ready` as without a producer. The proxy fence orders the scan's reads
    of the slot before the copy's writes."""
    pc, ps, pe, pns, pne, pnd = _cursor_start(c_first, c_last, cand_ptr, off_ptr, bad, walk_ptr, walk_last,
                                              IDENTITY, ITEMS, TABLE)  # fmt: skip
    for x in range(tiles):
        slot = x % STAGES
        mbarrier.wait(empty.index(slot), ((x // STAGES) & 1) ^ 1)
        fence_async_shared()
        _request(d_desc, ring, ready, slot, ps, n_tokens, BLOCK_T, False)
        pc, ps, pe, pns, pne, pnd = _cursor_next(pc, ps, pe, pns, pne, pnd, c_last, cand_ptr, off_ptr, bad,
                                                 walk_ptr, walk_last, IDENTITY, ITEMS, BLOCK_T,
                                                 TABLE)  # fmt: skip


@gluon.jit(
    do_not_specialize=[
        "n_queries", "n_items", "n_chunks", "n_docs", "n_tokens", "stride_plane", "stride_tab", "n_centroids"
    ]
)
def _int8_stream_kernel(
    q_ptr, qs_ptr, q_off_ptr, cand_off_ptr, cand_ptr, off_ptr, d_desc, sd_ptr, out_ptr,
    walk_ptr, walk_first_ptr,
    n_queries, n_items, n_chunks, n_docs, stride_q,
    n_tokens, stride_plane, stride_tab, n_centroids, plane_scale,
    DIM: gl.constexpr, N: gl.constexpr, ITEMS: gl.constexpr, BLOCK_T: gl.constexpr, STAGES: gl.constexpr,
    GROUP: gl.constexpr, IDENTITY: gl.constexpr, PACKED: gl.constexpr, DEFER: gl.constexpr,
    RESIDUAL: gl.constexpr, QUARTER: gl.constexpr, TABLE: gl.constexpr, PRODUCER: gl.constexpr = False,
):  # fmt: skip
    """Scores of a run of items (see the module docstring): q int8 [Tq, DIM], qs fp32 [Tq], q_off [nq + 1],
    cand_off [nq + 1] (the items of each query) and cand int64 [n_items], both unused with IDENTITY (one
    query, item c is document c), off int64 [nd + 1], d_desc the int8 documents [Td, DIM] in [BLOCK_T,
    DIM] tiles (PACKED: int4 codes, uint8 [Td, DIM / 2] in [BLOCK_T, DIM / 2] tiles), sd fp32 [Td], out
    fp32 [n_items], n_docs the number of documents (nd). RESIDUAL (residual2 codes of separable buckets):
    q the fp16 query planes [3, Tq, DIM] (row stride stride_q, plane stride stride_plane), d_desc the codes
    as int32 words [Td, 9] (n_tokens = Td rows), sd the centroid table fp32 [n_centroids, stride_tab]
    (column = query row), plane_scale the planes' scale. A candidate index
    outside [0, n_docs) is never read through: its item is walked as an empty document and scored NaN
    (the run's bad items, found once when its length is counted, are the bits of `bad`)."""
    pid = gl.program_id(0)
    if IDENTITY:
        query = pid * 0
        c_first = pid * ITEMS
        c_last = gl.minimum(c_first + ITEMS, n_items)
    elif pid < n_chunks:
        c_first = pid * ITEMS
        query = candidate_query(cand_off_ptr, c_first, n_queries)
        q_end = gl.load(cand_off_ptr + query + 1).to(gl.int32)
        c_last = gl.minimum(gl.minimum(c_first + ITEMS, n_items), q_end)
    else:
        query = pid - n_chunks
        c_first = gl.load(cand_off_ptr + query).to(gl.int32)
        q_end = gl.load(cand_off_ptr + query + 1).to(gl.int32)
        c_last = gl.minimum(q_end, gl.cdiv(c_first, ITEMS) * ITEMS)
    if c_first < c_last:
        if RESIDUAL:  # fp16 products
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
            )
        else:
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32]
            )
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        item_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

        # the query: rows past its length are zero, their scales zero
        row_first = gl.load(q_off_ptr + query)
        row_last = gl.load(q_off_ptr + query + 1)
        q_tok = row_first + gl.arange(0, N, layout=gl.SliceLayout(1, ld_layout))
        q_row_ptr = q_ptr + q_tok.to(gl.int64)[:, None] * stride_q
        q_in = (q_tok < row_last)[:, None]
        # int4 and int2 multiply the codes' values as stored: int4's nibbles plus 8 after a product that
        # starts each tile at -8 sum q8 of its query row (`_correction_tiles`; at N = 64 the signed nibbles:
        # its candidates build spills 40 bytes against 32 so, in triton 3.6), int2's v corrected in the
        # fold (`_retire`). Each is measured the faster of the two ways for its codec (docs/kernel-notes.md)
        BIASED: gl.constexpr = PACKED and not QUARTER and N <= 32
        q_sum = gl.zeros([N], gl.int32, gl.SliceLayout(1, ld_layout))
        if RESIDUAL:
            # planes 0 and 1 of each part p (columns 32p ..): wgmma's second operands, [N, 32] each
            k = gl.arange(0, DIM // 4, layout=gl.SliceLayout(0, ld_layout))
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, DIM // 4], gl.float16)
            q_smem = gl.allocate_shared_memory(gl.float16, [8, N, DIM // 4], q_layout)
            for i in gl.static_range(8):
                at = q_row_ptr + (i // 4) * stride_plane + (i % 4) * (DIM // 4) + k[None, :]
                q_smem.index(i).store(gl.load(at, mask=q_in, other=0.0))
        elif QUARTER:
            # the query's columns 4m + p, part p: the products of the codes' 2-bit values p
            k = gl.arange(0, DIM // 4, layout=gl.SliceLayout(0, ld_layout))
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, DIM // 4], gl.int8)
            q_smem = gl.allocate_shared_memory(gl.int8, [4, N, DIM // 4], q_layout)
            for i in gl.static_range(4):
                part = gl.load(q_row_ptr + 4 * k[None, :] + i, mask=q_in, other=0)
                q_smem.index(i).store(part)
                q_sum += gl.sum(part.to(gl.int32), axis=1)
            q_hi_smem = q_smem  # unused
        elif PACKED:
            # the query's even and odd columns: the products of the codes' low and high nibbles
            k = gl.arange(0, DIM // 2, layout=gl.SliceLayout(0, ld_layout))
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, DIM // 2], gl.int8)
            q_smem = gl.allocate_shared_memory(gl.int8, [N, DIM // 2], q_layout)
            q_hi_smem = gl.allocate_shared_memory(gl.int8, [N, DIM // 2], q_layout)
            even = gl.load(q_row_ptr + 2 * k[None, :], mask=q_in, other=0)
            odd = gl.load(q_row_ptr + 2 * k[None, :] + 1, mask=q_in, other=0)
            q_smem.store(even)
            q_hi_smem.store(odd)
            q_sum = gl.sum(even.to(gl.int32), axis=1) + gl.sum(odd.to(gl.int32), axis=1)
        else:
            k = gl.arange(0, DIM, layout=gl.SliceLayout(0, ld_layout))
            q_smem = gl.allocate_shared_memory(
                gl.int8, [N, DIM], gl.NVMMASharedLayout.get_default_for([N, DIM], gl.int8)
            )
            q_smem.store(gl.load(q_row_ptr + k[None, :], mask=q_in, other=0))
            q_hi_smem = q_smem
        if BIASED:
            fix_a, fix_b = _correction_tiles(q_sum * -8, BLOCK_T, N, ld_layout)
        else:
            fix_a, fix_b = q_smem, q_smem  # unused
        cols = row_first + gl.arange(0, N, layout=col_layout)
        q_fix = gl.convert_layout(q_sum, col_layout) * -3  # int2's correction (`_retire`)
        q_ok = cols < row_last
        qs = gl.load(qs_ptr + cols, mask=q_ok, other=0.0)

        if RESIDUAL:
            # the tiles' bucket bytes, copied as words and read as bytes (unswizzled, row-major)
            plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            words = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_T, DIM // 16], plain)
            d_smem = words._reinterpret(gl.uint8, [STAGES, BLOCK_T, DIM // 4], plain)
            ring = words
        elif PACKED:
            d_smem = gl.allocate_shared_memory(
                d_desc.dtype, [STAGES, BLOCK_T, DIM // (4 if QUARTER else 2)], d_desc.layout
            )
            ring = d_smem
        else:
            d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_T, DIM], d_desc.layout)
            ring = d_smem
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # cp.async: every thread's copies arrive on the barrier; TMA: one arrival and the bytes
            mbarrier.init(ready.index(i), count=_WARPS * 32 if RESIDUAL else 1)
        if PRODUCER:
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(empty.index(i), count=1)
        else:
            empty = ready  # unused
        fence_async_shared()
        gl.thread_barrier()
        if RESIDUAL or QUARTER:
            q_t = q_smem
            q_hi_t = q_smem  # unused
        else:
            q_t = q_smem.permute((1, 0))
            q_hi_t = q_hi_smem.permute((1, 0))
        if DEFER:  # each warp's maxima at each item's end: [ITEMS, warps, N] fp32
            partial = gl.allocate_shared_memory(
                gl.float32, [ITEMS, _WARPS, N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            )
        else:
            partial = d_smem  # unused

        # the walk's length: every item has max(1, ceil(len / BLOCK_T)) tiles
        if TABLE:  # counted once for the corpus (`walk_table`): the program's run of the table
            bad = 0
            walk_first = gl.load(walk_first_ptr + pid)
            total = gl.load(walk_first_ptr + pid + 1) - walk_first
            walk_ptr = walk_ptr + walk_first
            walk_last = total - 1
        else:
            cc = c_first + gl.arange(0, ITEMS, layout=item_layout)
            c_in = cc < c_last
            if IDENTITY:
                docs = cc
                bad = 0
                c_ok = c_in
            else:
                # the run's items lie in one aligned block of ITEMS, so c mod ITEMS tells them apart
                docs = gl.load(cand_ptr + cc, mask=c_in, other=0)
                c_ok = c_in & (docs >= 0) & (docs < n_docs)
                if ITEMS > 32:  # one bit an item: int32 for the tuned runs (one register), int64 past 32
                    shift = (cc % ITEMS).to(gl.int64)
                else:
                    shift = cc % ITEMS
                bad = gl.sum(gl.where(c_in & ~c_ok, 1 << shift, 0), axis=0)
            lens = gl.load(off_ptr + docs + 1, mask=c_ok, other=0)
            lens -= gl.load(off_ptr + docs, mask=c_ok, other=0)
            total = gl.sum(gl.where(c_in, gl.maximum((lens.to(gl.int32) + BLOCK_T - 1) // BLOCK_T, 1), 0),
                           axis=0)  # fmt: skip
            walk_last = total  # unused
        tiles = gl.cdiv(total, GROUP) * GROUP  # padding tiles (past `total`): copied, multiplied, not folded

        if PRODUCER:  # one more warp fills the ring (`_produce`); the program's four scan it
            unused = c_first * 0
            gl.warp_specialize([
                (_scan, (d_smem, q_t, q_hi_t, fix_a, fix_b, ready, empty, tiles, total, qs, q_ok, out_ptr,
                         c_first, c_last, cand_ptr, off_ptr, sd_ptr, d_desc, ring, bad, partial, n_tokens,
                         cols, stride_tab, n_centroids, plane_scale, q_fix, walk_ptr, walk_last, qs_ptr,
                         row_first, row_last, unused, unused, unused, unused, unused, unused, acc_layout,
                         IDENTITY, ITEMS, BLOCK_T, STAGES, GROUP, N, PACKED, DEFER, RESIDUAL, QUARTER, BIASED,
                         TABLE, True)),
                (_produce, (d_desc, ring, ready, empty, tiles, c_first, c_last, cand_ptr, off_ptr, bad,
                            walk_ptr, walk_last, n_tokens, IDENTITY, ITEMS, BLOCK_T, STAGES, TABLE)),
            ], [1], [_PRODUCER_REGISTERS])
        else:
            # the ring: tiles 0 .. STAGES - 1 requested, its cursor left at tile STAGES
            pc, ps, pe, pns, pne, pnd = _cursor_start(c_first, c_last, cand_ptr, off_ptr, bad, walk_ptr,
                                                      walk_last, IDENTITY, ITEMS, TABLE)
            for i in gl.static_range(STAGES):
                if i < tiles:
                    _request(d_desc, ring, ready, i, ps, n_tokens, BLOCK_T, RESIDUAL)
                    pc, ps, pe, pns, pne, pnd = _cursor_next(pc, ps, pe, pns, pne, pnd, c_last, cand_ptr,
                                                             off_ptr, bad, walk_ptr, walk_last, IDENTITY,
                                                             ITEMS, BLOCK_T, TABLE)
            _scan(d_smem, q_t, q_hi_t, fix_a, fix_b, ready, empty, tiles, total, qs, q_ok, out_ptr,
                  c_first, c_last, cand_ptr, off_ptr, sd_ptr, d_desc, ring, bad, partial, n_tokens, cols,
                  stride_tab, n_centroids, plane_scale, q_fix, walk_ptr, walk_last, qs_ptr, row_first,
                  row_last, pc, ps, pe, pns, pne, pnd, acc_layout,
                  IDENTITY, ITEMS, BLOCK_T, STAGES, GROUP, N, PACKED, DEFER, RESIDUAL, QUARTER, BIASED,
                  TABLE, False)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            if PRODUCER:
                mbarrier.invalidate(empty.index(i))


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def query_columns(max_query_len: int) -> int:
    """wgmma's N for queries of at most `max_query_len` tokens: 16, 32 or 64."""
    return max(16, 1 << max(0, max_query_len - 1).bit_length())


def code_width(docs: torch.Tensor, int2: bool = False) -> int | None:
    """The row width this kernel reads for `docs`' dtype (int8 values: 128; int4 codes, uint8: 64; int2
    codes, uint8: 32)."""
    if int2:
        return 32 if docs.dtype == torch.uint8 else None
    return {torch.int8: 128, torch.uint8: 64}.get(docs.dtype)


def tiles_for(docs: torch.Tensor, residual: bool = False, int2: bool = False) -> Tuning:
    """The tuned tiles of the codec `docs` holds (int8 values, int4 or int2 codes, or residual2 codes)."""
    if residual:
        return RESIDUAL2_TILES
    if int2:
        return INT2_TILES
    return INT4_TILES if docs.dtype == torch.uint8 else INT8_TILES


def supports_residual(q_lens: np.ndarray, codes: torch.Tensor) -> bool:
    """Whether this kernel takes a residual2 scan: `q_lens` the query lengths (host, at most
    RESIDUAL_MAX_QUERY_TOKENS), `codes` uint8 [Td, 36] rows of dim 128, contiguous and 4-byte aligned (read
    as int32 words). The codebook's buckets must be separable (the caller checks)."""
    if not len(q_lens) or codes.dim() != 2 or codes.dtype != torch.uint8:
        return False
    return (
        codes.shape[1] == 4 * RESIDUAL_WORDS
        and 1 <= int(q_lens.min())
        and int(q_lens.max()) <= RESIDUAL_MAX_QUERY_TOKENS
        and 0 < codes.shape[0] < 2**31 - BLOCK_T  # the walk's tokens are int32
        and codes.stride(1) == 1
        and codes.stride(0) == codes.shape[1]
        and codes.data_ptr() % 4 == 0
        and hopper_device(codes.device)
    )


def supports(q_lens: np.ndarray, d8: torch.Tensor, return_argmax: bool, int2: bool = False) -> bool:
    """Whether this kernel takes the problem: `q_lens` the query lengths (host), `d8` the documents (int8
    values [Td, 128], or int4 codes, uint8 [Td, 64], or int2 codes, uint8 [Td, 32])."""
    if return_argmax or not len(q_lens) or d8.dim() != 2 or d8.shape[1] != code_width(d8, int2):
        return False
    if int2 and int(q_lens.max()) > INT2_MAX_QUERY_TOKENS:
        return False
    return (
        1 <= int(q_lens.min())
        and int(q_lens.max()) <= MAX_QUERY_TOKENS
        and 0 < d8.shape[0] < 2**31 - BLOCK_T  # TMA coordinates and the walk are int32
        and d8.stride(1) == 1
        and d8.stride(0) % 16 == 0
        and d8.data_ptr() % 16 == 0
        and hopper_device(d8.device)
    )


@functools.cache
def _doc_layout(width: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    element = gl.int8 if dtype == torch.int8 else gl.uint8
    return gl.NVMMASharedLayout.get_default_for([BLOCK_T, width], element)


# documents a program of `_walk_table_kernel`
_WALK_DOCS = 256


@triton.jit
def _walk_table_kernel(off_ptr, first_ptr, out_ptr, n_docs, capacity, ITEMS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The entries of documents [pid * BLOCK, (pid + 1) * BLOCK) (`walk_table`): document d's tiles at
    first[d] ...; an entry past `capacity` (offsets that do not add up) is not written."""
    docs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = docs < n_docs
    start = tl.load(off_ptr + docs, mask=ok, other=0)
    length = tl.load(off_ptr + docs + 1, mask=ok, other=0) - start
    count = tl.maximum((length + BLOCK_T - 1) // BLOCK_T, 1)
    first = tl.load(first_ptr + docs, mask=ok, other=0)
    item = (docs % ITEMS).to(tl.int64) << 40
    for k in range(0, tl.max(tl.where(ok, count, 0), axis=0)):
        rows = tl.minimum(tl.maximum(length - k * BLOCK_T, 0), BLOCK_T)
        last = (k == count - 1).to(tl.int64) << 39
        entry = ((start + k * BLOCK_T) & 0xFFFFFFFF) | (rows << 32) | last | item
        tl.store(out_ptr + first + k, entry, mask=ok & (k < count) & (first + k < capacity))


def walk_table(d_off: torch.Tensor, n_tokens: int, items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query's walk of every document, counted once for the offsets `d_off` (int64 [nd + 1], on the
    GPU; `memo`: kept while the tensor lives unchanged), where each program counts its documents' tiles
    and walks their offsets (TABLE; docs/kernel-notes.md, "The walk from a table").

    Returns (entries, firsts). entries int64, one a tile in the walk's order (each document's max(1,
    ceil(len / BLOCK_T)) tiles from its first token): the tile's first token (low 32 bits), its rows in
    the document (7 bits), whether it is the document's last (1 bit) and the document's index mod `items`
    (its slot in its program). firsts int32 [programs + 1]: program p's first entry (programs of `items`
    documents). Made on the GPU without a host synchronisation: the entries are sized for nd +
    ceil(n_tokens / BLOCK_T) tiles, which offsets within n_tokens never pass (others are cut there: their
    scores are then wrong, but the table is not written nor read past its end)."""

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        n_docs = d_off.numel() - 1
        capacity = n_docs + cdiv(n_tokens, BLOCK_T) + 1
        lens = d_off[1:] - d_off[:-1]
        counts = torch.clamp_min(torch.div(lens + (BLOCK_T - 1), BLOCK_T, rounding_mode="floor"), 1)
        ends = torch.cumsum(counts, 0)
        firsts = ends - counts
        entries = torch.empty(capacity, dtype=torch.int64, device=d_off.device)
        grid = (cdiv(n_docs, _WALK_DOCS),)
        _walk_table_kernel[grid](d_off, firsts, entries, n_docs, capacity, ITEMS=items, BLOCK_T=BLOCK_T,
                                 BLOCK=_WALK_DOCS)  # fmt: skip
        by_program = torch.cat([firsts[::items], ends[-1:]])
        return entries, torch.clamp_max(by_program, capacity - 1).to(torch.int32)

    return memo(d_off, ("walk_table", n_tokens, items), compute)


def walks_table(d_off: torch.Tensor, n: int, tuned: Tuning, table: bool | None = None) -> bool:
    """Whether one query against the documents of `d_off` walks `walk_table` (query tile N = `n`): where
    `table` says so, else where the codec's tuning takes it at N and these offsets are walked for the
    second time or later. Counting the table costs a few launches (a cumulative sum, one Triton kernel),
    more than one scan of a small batch saves by it: offsets seen once (a streamed batch) keep the
    offsets' walk, a corpus scanned again (resident, served) counts its table once and keeps it. An
    inference tensor has no version counter to key the count by, and keeps the offsets' walk."""
    if table is not None:
        return table and not d_off.is_inference()
    if n not in tuned.table or d_off.is_inference():
        return False
    walks = memo(d_off, "one_query_walks", lambda: [0])
    walks[0] += 1
    return walks[0] > 1


def maxsim_int8_stream(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_off: torch.Tensor,
    item_off: torch.Tensor | None,
    items: torch.Tensor | None,
    d8: torch.Tensor,
    sd: torch.Tensor,
    d_off: torch.Tensor,
    max_query_len: int,
    *,
    residual: QueryTables | None = None,
    int2: bool = False,
) -> torch.Tensor:
    """fp32 scores [n_items]: q8 int8 [Tq, 128] with scales sq fp32 [Tq], query offsets int64 [nq + 1];
    item_off int64 [nq + 1] the items of each query and items int64 [n_items] the candidates' document
    indices, or both None for one query against every document; d8 int8 [Td, 128] (or int4 codes, uint8
    [Td, 64], or with `int2` int2 codes, uint8 [Td, 32]: `code_packing`) with scales sd fp32 [Td] and
    offsets d_off int64 [nd + 1]; all on the GPU. `max_query_len` (host) sizes the query tile
    (`supports`). A candidate index outside [0, nd) scores NaN and is never read through (the indices are
    not read by the host). The tiles are the codec's tuned
    ones (`tiles_for`). residual2 codes (`code_packing`, uint8 [Td, 36], `supports_residual`): `residual`
    is the query side (`maxsim_codes.residual2_query_tables` of q8, separable buckets), sd is not read."""
    return stream_with_tiles(
        q8, sq, q_off, item_off, items, d8, sd, d_off, max_query_len, residual=residual, int2=int2
    )


def stream_with_tiles(
    q8: torch.Tensor,
    sq: torch.Tensor,
    q_off: torch.Tensor,
    item_off: torch.Tensor | None,
    items: torch.Tensor | None,
    d8: torch.Tensor,
    sd: torch.Tensor,
    d_off: torch.Tensor,
    max_query_len: int,
    *,
    residual: QueryTables | None = None,
    int2: bool = False,
    items_per_prog: int | None = None,
    stages: int | None = None,
    group: int | None = None,
    maxnreg: int | None = None,
    table: bool | None = None,
    producer: bool | None = None,
) -> torch.Tensor:
    """`maxsim_int8_stream` with some of its tiles replaced (None keeps the tuned choice; `maxnreg` 0: no
    register cap; `table`: whether one query walks `walk_table`; `producer`: whether a producer warp fills
    the ring, not for residual2), for sweeps and for the tests that every configuration gives the same
    bits."""
    tuned = tiles_for(d8, residual is not None, int2)
    n = query_columns(max_query_len)
    per = items_per_prog or (tuned.items_one_query if items is None else tuned.items_candidates)
    if items is not None and per > MAX_ITEMS_CANDIDATES:
        raise ValueError(f"items_per_prog: at most {MAX_ITEMS_CANDIDATES} candidates a program, got {per}")
    if group is not None and (group < 2 or group % 2):
        # a turn of the loop takes its tiles in pairs: an odd group reads a tile the walk never pads to
        # (group=1 faulted on an H100, one query of int2 codes)
        raise ValueError(f"group: tiles a turn come in pairs (an even number from 2), got {group}")
    if producer is None:
        producer = takes_producer(tuned, n, items is None, per)
    if producer and residual is not None:
        raise ValueError("producer: residual2's copies are every thread's (cp.async), not one warp's")
    if producer and per > PRODUCER_MAX_ITEMS:
        raise ValueError(f"producer: at most {PRODUCER_MAX_ITEMS} items a program, got {per}")
    if maxnreg is None:
        maxnreg = tuned.cap(n, items is None, producer)
    nq = q_off.numel() - 1
    n_items = d_off.numel() - 1 if items is None else items.numel()
    out = torch.empty((n_items,), dtype=torch.float32, device=d8.device)
    if n_items == 0:
        return out
    n_chunks = cdiv(n_items, per)
    packed = d8.dtype == torch.uint8 and residual is None
    use_table = items is None and walks_table(d_off, n, tuned, table)
    if use_table:
        walk, firsts = walk_table(d_off, d8.shape[0], per)
    else:
        walk, firsts = d_off, d_off  # unused
    if residual is None:
        q, stride_q, stride_plane, scales = q8, q8.stride(0), 0, sd
        tab_stride, n_centroids, plane_scale = 0, 0, 1.0
        docs = TensorDescriptor.from_tensor(d8, [BLOCK_T, d8.shape[1]], _doc_layout(d8.shape[1], d8.dtype))
    else:
        by_centroid = residual.by_centroid
        slack = by_centroid.untyped_storage().nbytes() // 4 - by_centroid.storage_offset()
        slack -= by_centroid.numel()
        if not by_centroid.is_contiguous() or slack < n:
            raise ValueError(f"the centroid table needs {n} fp32 entries of slack past its end; got {slack}")
        q, stride_q, stride_plane = residual.planes, residual.planes.stride(1), residual.planes.stride(0)
        scales, tab_stride, n_centroids = by_centroid, by_centroid.stride(0), by_centroid.shape[0]
        plane_scale = residual.plane_scale / PLANE_UNIT_ASM
        docs = d8.view(torch.int32)  # [Td, 9] words: cp.async, four bytes a copy
    _int8_stream_kernel[(n_chunks + (0 if items is None else nq),)](
        q, sq, q_off, q_off if item_off is None else item_off, d_off if items is None else items, d_off,
        docs, scales, out, walk, firsts,
        nq, n_items, n_chunks, d_off.numel() - 1, stride_q,
        d8.shape[0], stride_plane, tab_stride, n_centroids, plane_scale,
        DIM=q8.shape[1], N=n, ITEMS=per, BLOCK_T=BLOCK_T,
        STAGES=tuned.stages_at(n, items is None) if stages is None else stages,
        GROUP=tuned.group if group is None else group, IDENTITY=items is None, PACKED=packed,
        DEFER=deferred(packed or residual is not None, per, n), RESIDUAL=residual is not None,
        QUARTER=int2, TABLE=use_table, PRODUCER=bool(producer),
        num_warps=NUM_WARPS, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return out
