"""Codecs below 8 bits (docs/format.md, "Codes below 8 bits"): what a shard of codes holds, the residual2
codebook file beside the shards (written, read, checked), and the training of that codebook.

- ``int4-per-token`` (`maxsim quantize --bits 4`): two signed 4-bit values a byte and one fp32 scale a
  token: ``dim / 2 + 4`` bytes a token (68 at dim 128).
- ``residual2-kmeans`` (`--bits 2`), the ColBERTv2 residual scheme: the id of the token's nearest k-means
  centroid (4 bytes) and a 2-bit bucket a dimension, whose value per dimension comes from the codebook:
  ``4 + dim / 4`` bytes a token (36 at dim 128), plus the codebook once per corpus.

The byte layouts and the decoding are `maxsim_kernels.code_packing`'s. Importing this module imports no
torch (the shard readers use its constants); the functions that need torch import it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import InputError, UsageError

if TYPE_CHECKING:
    import torch

# shard metadata `quantization` -> codec of `maxsim_kernels.code_packing`
CODE_QUANTIZATIONS = {"int4-per-token": "int4", "residual2-kmeans": "residual2", "int2-grid": "int2"}
CODES_DTYPE = "uint8"  # the dtype of a codes shard's `embeddings`
CODES_VERSION = "1"  # metadata `codes_version`: the layout of docs/format.md, "Codes below 8 bits"
CODEBOOK_NAME = "codebook.safetensors"
CODEBOOK_FORMAT = "maxsim-codebook"
# shard metadata keys of a residual2 shard
CODEBOOK_KEY = "codebook"
CODEBOOK_SHA256_KEY = "codebook_sha256"
NUM_CENTROIDS_KEY = "num_centroids"
CODES_VERSION_KEY = "codes_version"
# shard metadata keys of every quantized shard: the float corpus it was made from (its number of documents
# and the sha256 of its ids in order), which `maxsim score --exact-from` checks the exact tier against
SOURCE_DOCS_KEY = "source_num_docs"
SOURCE_IDS_KEY = "source_ids_sha256"
# and the committed generation of the source corpus folder (docs/format.md, "Generations"; 0: none)
SOURCE_GENERATION_KEY = "source_generation"
BITS = {8: "int8-per-token", 4: "int4-per-token", 2: "residual2-kmeans"}
# --bits 2's codecs (`maxsim quantize --codec`): the quantization each writes
CODECS_2BIT = {"residual2": "residual2-kmeans", "int2": "int2-grid"}
MAX_CENTROIDS = 1 << 18  # the peers' largest (PLAID: 2^16-2^18)
DEFAULT_SAMPLE_TOKENS = 1 << 18  # k-means sample: 128 MiB of fp32 at dim 128
KMEANS_ITERATIONS = 20
# fastkmeans' Triton assignment kernel walks the centroids in tiles of 128 (64 past dim 384) and reads the
# tile past the last centroid unmasked: with k not a multiple of 128 it can return an id >= k (a
# device-side assert in its index_add, seen on an H100 with k = 64). Its torch path is used for other k.
TRITON_KMEANS_CENTROIDS = 128
INT2_ITERATIONS = 20  # Lloyd steps of the int2 grid (fit_int2_levels)
BUCKET_ITERATIONS = 10  # Lloyd-Max steps of the bucket cutoffs and values (fit_buckets)
BUCKET_BLOCK_ELEMS = 1 << 22  # residuals fit_buckets sorts at once: ~100 MB of float64 temporaries
_ID_BYTES = 4


def code_width(quantization: str, dim: int) -> int:
    """Bytes a token of ``dim`` values takes in the ``embeddings`` of a codes shard (the int4 scale is the
    separate ``scales``); ``dim`` for any other quantization (values a token)."""
    codec = CODE_QUANTIZATIONS.get(quantization)
    if codec == "int4":
        return dim // 2
    if codec == "residual2":
        return _ID_BYTES + dim // 4
    if codec == "int2":
        return dim // 4
    return dim


def has_scales(quantization: str) -> bool:
    """Whether a shard of this quantization carries one fp32 scale a token."""
    return quantization in ("int8-per-token", "int4-per-token", "int2-grid")


def dim_problem(quantization: str, dim: int) -> str | None:
    """Why a codec cannot store vectors of ``dim`` values, or None."""
    if quantization == "int4-per-token" and dim % 2:
        return f"--bits 4 stores two values a byte and needs an even dim, got {dim}"
    if quantization in ("residual2-kmeans", "int2-grid") and dim % 4:
        return f"--bits 2 stores four values a byte and needs a dim that is a multiple of 4, got {dim}"
    return None


def default_centroids(num_tokens: int) -> int:
    """ColBERTv2's rule: the power of two nearest 16 * sqrt(tokens), between 1 and MAX_CENTROIDS."""
    wanted = 16 * math.sqrt(max(1, num_tokens))
    return int(min(MAX_CENTROIDS, 2 ** round(math.log2(wanted))))


def ids_sha256(shards: Any) -> str:
    """The sha256 of a corpus's document ids in corpus order, each id's UTF-8 bytes followed by a newline
    (ids hold no whitespace): the identity `SOURCE_IDS_KEY` records."""
    digest = hashlib.sha256()
    for shard in shards:
        ids = shard.ids
        if ids:
            digest.update(("\n".join(ids) + "\n").encode("utf-8"))
    return digest.hexdigest()


def source_metadata(corpus: Any) -> dict[str, str]:
    """The metadata keys that name ``corpus`` (an open `Corpus`) as the source of a quantized one."""
    return {
        SOURCE_DOCS_KEY: str(corpus.num_docs),
        SOURCE_IDS_KEY: ids_sha256(corpus.shards),
        SOURCE_GENERATION_KEY: str(getattr(corpus, "generation", 0)),
    }


def check_same_documents(
    compressed: Any, exact: Any, compressed_name: str, exact_name: str, exact_ids_sha256: str | None = None
) -> None:
    """Refuse, in one line naming both, an exact tier that is not the corpus the compressed tier was
    quantized from: every shard of ``compressed`` records that corpus (`source_metadata`), which must be
    ``exact``'s documents in the same order. ``exact_ids_sha256``: `ids_sha256` of ``exact`` when the
    caller has it already (a server checks at every request)."""
    sources = {s.info.source for s in compressed.shards}
    if None in sources or len(sources) != 1:
        raise InputError(
            f"{compressed_name}: records no single source corpus (a corpus written by this version of "
            f"`maxsim quantize` does); quantize {exact_name} again to use it with --exact-from"
        )
    num_docs, sha = sources.pop()
    made_from = {s.info.source_generation for s in compressed.shards} - {None}
    generation = getattr(exact, "generation", 0)
    if made_from and made_from != {generation}:
        raise InputError(
            f"{compressed_name} was quantized from generation {max(made_from)} of {exact_name}, which is at "
            f"generation {generation} now (maxsim add, delete or compact); quantize {exact_name} again "
            f"(maxsim quantize {exact_name} -o {compressed_name} --overwrite)"
        )
    if num_docs != exact.num_docs or sha != (exact_ids_sha256 or ids_sha256(exact.shards)):
        raise InputError(
            f"{compressed_name} was quantized from another corpus than {exact_name} ({num_docs:,} documents "
            f"there, {exact.num_docs:,} here, or other ids or order); give the corpus it was quantized from"
        )


def _err(path: str, message: str) -> InputError:
    return InputError(f"{path}: {message}")


def sha256_of(path: str) -> str:
    """Lower-case hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# The codebook file
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Codebook:
    """A residual2 codebook: ``centroids`` fp16 [K, dim], ``bucket_weights`` fp32 [dim, 4] (the decoded
    value of each bucket), ``bucket_cutoffs`` fp32 [dim, 3] (where a residual moves to the next bucket:
    what encoding uses), and the file and sha256 it was read from or written to."""

    centroids: torch.Tensor
    bucket_weights: torch.Tensor
    bucket_cutoffs: torch.Tensor
    path: str = ""
    sha256: str = ""

    @property
    def num_centroids(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    def to(self, device: Any) -> Codebook:
        """The same codebook with its tensors on ``device`` (file and sha256 kept): what encoding batch
        after batch uses, so the centroids cross to a GPU once, not once a batch."""
        return replace(
            self,
            centroids=self.centroids.to(device),
            bucket_weights=self.bucket_weights.to(device),
            bucket_cutoffs=self.bucket_cutoffs.to(device),
        )

    def for_kernels(self, device: Any = None) -> Any:
        """The `maxsim_kernels.code_packing.ResidualCodebook` of it (on ``device`` when given)."""
        from maxsim_kernels.code_packing import ResidualCodebook

        book = ResidualCodebook(self.centroids, self.bucket_weights)
        return book if device is None else book.to(device)


@dataclass(frozen=True)
class Int2Grid:
    """An int2 codebook (`maxsim_kernels.code_packing.Int2Levels`): per dimension the ``offsets`` and
    ``steps`` (fp32 [dim] each) of the four values ``offset + step * c``, c = -3, -1, 1, 3, and the file and
    sha256 it was read from or written to."""

    offsets: torch.Tensor
    steps: torch.Tensor
    path: str = ""
    sha256: str = ""
    num_centroids = 0  # no centroids: the shards record none

    @property
    def dim(self) -> int:
        return int(self.offsets.shape[0])

    def to(self, device: Any) -> Int2Grid:
        return replace(self, offsets=self.offsets.to(device), steps=self.steps.to(device))

    def for_kernels(self, device: Any = None) -> Any:
        """The `maxsim_kernels.code_packing.Int2Levels` of it (on ``device`` when given)."""
        from maxsim_kernels.code_packing import Int2Levels

        levels = Int2Levels(self.offsets, self.steps)
        return levels if device is None else levels.to(device)


def write_codebook(folder: str, codebook: Codebook | Int2Grid) -> Codebook | Int2Grid:
    """Write ``codebook`` atomically as ``folder/codebook.safetensors``; returns it with path and sha256."""
    from maxsim_cli.arrays import safetensors_bytes

    path = os.path.join(folder, CODEBOOK_NAME)
    tmp = path + ".tmp"
    if isinstance(codebook, Int2Grid):
        arrays = {
            "offsets": codebook.offsets.to("cpu").float().contiguous().numpy(),
            "steps": codebook.steps.to("cpu").float().contiguous().numpy(),
        }
        meta = {"format": CODEBOOK_FORMAT, "format_version": CODES_VERSION, "codec": "int2-grid",
                "dim": str(codebook.dim)}  # fmt: skip
    else:
        arrays = {
            "centroids": codebook.centroids.to("cpu").half().contiguous().numpy(),
            "bucket_weights": codebook.bucket_weights.to("cpu").float().contiguous().numpy(),
            "bucket_cutoffs": codebook.bucket_cutoffs.to("cpu").float().contiguous().numpy(),
        }
        meta = {
            "format": CODEBOOK_FORMAT,
            "format_version": CODES_VERSION,
            "codec": "residual2-kmeans",
            "dim": str(codebook.dim),
            "num_centroids": str(codebook.num_centroids),
        }
    # the same codebook, the same bytes: the shards record its sha256 (`safetensors_bytes`)
    with open(tmp, "wb") as f:
        f.write(safetensors_bytes(arrays, meta))
    os.chmod(tmp, 0o644)  # readable like the shards beside it
    os.replace(tmp, path)
    return replace(codebook, path=path, sha256=sha256_of(path))


def read_codebook(
    path: str,
    *,
    shard: str,
    sha256: str,
    dim: int,
    num_centroids: int,
    quantization: str = "residual2-kmeans",
) -> Codebook | Int2Grid:
    """The codebook at ``path`` named by the metadata of ``shard``: checked against the checksum, dim,
    codec (``quantization``) and number of centroids the shard records, and for NaN/Inf (an int2 grid: and
    for negative steps). Every problem is one line naming both files."""
    import torch
    from safetensors import safe_open

    both = f"{path} (the codebook of {shard})"
    grid = quantization == "int2-grid"
    if not os.path.isfile(path):
        raise InputError(
            f"{both}: missing; a --bits 2 corpus needs the {CODEBOOK_NAME} written beside its shards: "
            "copy it with the shards, or quantize the float corpus again"
        )
    actual = sha256_of(path)
    if actual != sha256:
        raise InputError(
            f"{both}: sha256 {actual[:16]}... differs from the {sha256[:16]}... the shard records; the "
            "codebook belongs to another corpus: keep each codebook with the shards quantized with it"
        )
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(header_len)).get("__metadata__") or {}
        if meta.get("format") == CODEBOOK_FORMAT and meta.get("codec", "residual2-kmeans") != quantization:
            raise InputError(
                f"{both}: a {meta.get('codec')} codebook, where the shard holds {quantization} codes; "
                "quantize again"
            )
        names = ("offsets", "steps") if grid else ("centroids", "bucket_weights", "bucket_cutoffs")
        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in names}
    except InputError:
        raise
    except Exception as exc:  # safetensors raises its own error types
        raise InputError(f"{both}: corrupt codebook ({str(exc).splitlines()[0]}); quantize again") from None
    if meta.get("format") != CODEBOOK_FORMAT or meta.get("format_version") != CODES_VERSION:
        raise InputError(f"{both}: not a {CODEBOOK_FORMAT} version {CODES_VERSION} file; quantize again")
    if grid:
        offsets, steps = tensors["offsets"], tensors["steps"]
        for name, tensor in tensors.items():
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != (dim,):
                raise InputError(
                    f"{both}: holds {name} {tuple(tensor.shape)} {tensor.dtype}; the shard needs fp32 "
                    f"[{dim}]; quantize again"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise InputError(f"{both}: NaN or Inf in {name}; the file is damaged: quantize again")
        if bool((steps < 0).any()):
            raise InputError(f"{both}: a negative step; the file is damaged: quantize again")
        return Int2Grid(offsets, steps, path, actual)
    cent, wts, cuts = tensors["centroids"], tensors["bucket_weights"], tensors["bucket_cutoffs"]
    if (
        cent.dtype != torch.float16
        or tuple(cent.shape) != (num_centroids, dim)
        or wts.dtype != torch.float32
        or tuple(wts.shape) != (dim, 4)
        or cuts.dtype != torch.float32
        or tuple(cuts.shape) != (dim, 3)
    ):
        raise InputError(
            f"{both}: holds centroids {tuple(cent.shape)} {cent.dtype}, bucket weights {tuple(wts.shape)}, "
            f"cutoffs {tuple(cuts.shape)}; the shard needs fp16 [{num_centroids}, {dim}], fp32 [{dim}, 4] "
            f"and fp32 [{dim}, 3]; quantize again"
        )
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise InputError(f"{both}: NaN or Inf in {name}; the file is damaged: quantize again")
    return Codebook(cent, wts, cuts, path, actual)


def shard_codebook_path(shard_path: str, name: str) -> str:
    """The codebook file a shard names: a plain file name, beside the shard."""
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise InputError(f"{shard_path}: codebook {name!r} is not a file name beside the shard; rewrite it")
    return os.path.join(os.path.dirname(os.path.abspath(shard_path)), name)


# ----------------------------------------------------------------------------------------------------------
# Training and encoding
# ----------------------------------------------------------------------------------------------------------


def train_codebook(
    sample: torch.Tensor, num_centroids: int, *, seed: int = 0, device: torch.device | None = None
) -> Codebook:
    """k-means centroids of ``sample`` (float [n, dim]) with fastkmeans (on ``device`` when it is a GPU),
    then per dimension the bucket cutoffs and values that `fit_buckets` fits to the sample's residuals."""
    import torch

    try:
        from fastkmeans import FastKMeans
    except ImportError:
        raise UsageError(
            "--bits 2 trains k-means with fastkmeans, which is not installed: pip install 'maxsim[codes]'"
        ) from None
    data = sample.float().cpu().contiguous()
    k = max(1, min(num_centroids, data.shape[0]))
    gpu = device is not None and device.type == "cuda"
    kmeans = FastKMeans(
        d=data.shape[1], k=k, niter=KMEANS_ITERATIONS, gpu=gpu, seed=seed,
        device=device if gpu else "cpu", verbose=False, use_triton=gpu and k % TRITON_KMEANS_CENTROIDS == 0,
    )  # fmt: skip
    kmeans.train(data.numpy())
    centroids = torch.from_numpy(np.asarray(kmeans.centroids, dtype=np.float32)).half()
    # the sample's assignment runs where the k-means ran: on the host it is an fp32 product of the sample
    # and every centroid (262,144 x 65,536 x 128 for an 8 GB corpus: minutes of CPU time)
    ids = nearest_centroids(data, centroids, device=device if gpu else None)
    residuals = data - centroids[ids].float()
    cutoffs, weights = fit_buckets(residuals)
    return Codebook(centroids, weights, cutoffs)


def fit_int2_levels(
    sample: torch.Tensor, iterations: int = INT2_ITERATIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int2 codec's grid (`maxsim_kernels.code_packing.Int2Levels`) fitted to ``sample`` (float [n,
    dim]): per dimension the offset and step of four evenly spaced values ``offset + step * c`` (c = -3, -1,
    1, 3) with the least squared error Lloyd iteration finds from the mean and half the standard deviation
    (each value its nearest point of the grid, then the grid's least-squares line through them). A
    dimension that does not vary in the sample gets step 0: it decodes to its offset, its mean. The sample
    is read a block of rows at a time (`BUCKET_BLOCK_ELEMS` values), its sums kept in float64: the fit's
    memory beyond the sample is one block's. Returns (offsets, steps), fp32 [dim] each."""
    import torch
    from maxsim_kernels.code_packing import int2_grid_codes

    n, dim = sample.shape
    step_rows = max(1, BUCKET_BLOCK_ELEMS // max(1, dim))
    blocks = [slice(a, a + step_rows) for a in range(0, n, step_rows)]

    def sums(offsets: torch.Tensor, steps: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Over the sample, per dimension: sum (x - offsets)^2 (``steps`` None), or the sums of c, c^2 and
        c x for the grid's nearest odd values c."""
        total = [torch.zeros(dim, dtype=torch.float64, device=sample.device) for _ in range(3)]
        for rows in blocks:
            x = sample[rows].double()
            if steps is None:
                parts = ((x - offsets) ** 2,)
            else:
                c = int2_grid_codes(x - offsets, steps).mul_(2).sub_(3)
                parts = (c, c * c, c * x)
            for t, part in zip(total, parts, strict=False):
                t += part.sum(dim=0)
        return tuple(total)

    mean_x = sum(sample[rows].double().sum(dim=0) for rows in blocks) / n
    spread = (sums(mean_x, None)[0] / n).sqrt()  # two passes: exact 0 for a constant dimension
    varies = spread > 0
    offsets = mean_x
    steps = torch.where(varies, spread / 2, torch.ones_like(spread))
    for _ in range(iterations):
        sum_c, sum_cc, sum_cx = sums(offsets, steps)
        c_mean = sum_c / n
        c_var = sum_cc / n - c_mean * c_mean
        slope = (sum_cx / n - c_mean * mean_x) / c_var.clamp_min(1e-300)
        fitted = (c_var > 1e-12) & (slope > 0)
        steps = torch.where(fitted, slope, steps)
        offsets = torch.where(fitted, mean_x - steps * c_mean, offsets)
    return offsets.float(), torch.where(varies, steps, torch.zeros_like(steps)).float()


def fit_buckets(
    residuals: torch.Tensor, iterations: int = BUCKET_ITERATIONS, *, grid: str = "separable"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per dimension, the 2-bit quantizer of ``residuals`` (float [n, dim]) with the least squared error
    that Lloyd-Max iteration finds: (cutoffs fp32 [dim, 3], bucket values fp32 [dim, 4]).

    It starts from the quartiles as cutoffs (ColBERTv2's buckets); each step sets a bucket's value to the
    mean of the residuals in it (a residual ``r`` is in bucket ``j``, the number of cutoffs ``<= r``) and
    each cutoff half-way between the values beside it; the values returned are the means of the buckets
    the cutoffs returned make. Against ColBERTv2's values (the 1/8, 3/8, 5/8 and 7/8 quantiles) this
    lowers the error of the decoded vectors by a third on real-text embeddings (docs/two-stage.md). An
    empty bucket keeps a value between its cutoffs. A dimension's residuals are sorted once, so a step
    costs a binary search per cutoff; a block of dimensions at a time bounds the memory.

    ``grid``: "free" is the above. "separable" takes as many more steps under the constraint w3 - w2 =
    w1 - w0, the values ``b0 + l D0 + h D1`` of the bucket ``l + 2h`` (each step the least-squares ``b0,
    D0, D1`` of the buckets' members, `_constrained_values`), rounded to a grid on which the four values
    and their differences are exact in fp32: the third bit plane of the scan kernels (``w3 - w2 - w1 +
    w0``) is then exactly zero and its products are skipped (`maxsim_kernels.maxsim_codes`). Same squared
    error within 0.2% and the same recall and nDCG on real text (docs/two-stage.md, "The buckets").
    "uniform" constrains further to evenly spaced values ``b0 + b D`` (D1 = 2 D0, exactly), so that the
    bucket itself is the one integer a product takes; it costs 7.5% more squared error than "separable"
    on sample_data (docs/kernel-notes.md, "Evenly spaced buckets"), and `maxsim quantize` does not use it."""
    import torch

    if grid not in BUCKET_GRIDS:
        raise ValueError(f"unknown bucket grid {grid!r} (expected one of {', '.join(BUCKET_GRIDS)})")
    n, dim = residuals.shape
    cutoffs = torch.empty(dim, 3, dtype=torch.float32)
    weights = torch.empty(dim, 4, dtype=torch.float32)
    block = max(1, BUCKET_BLOCK_ELEMS // max(1, n))  # dimensions at a time
    for a in range(0, dim, block):
        values = residuals[:, a : a + block].T.double().sort(dim=1).values.contiguous()  # [b, n]
        # sums[:, i]: the sum of the i smallest residuals of the dimension
        sums = torch.nn.functional.pad(values.cumsum(dim=1), (1, 0))
        rank = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64) * (n - 1)
        low = rank.floor().long()
        frac = rank - low
        cuts = values[:, low] * (1 - frac) + values[:, (low + 1).clamp(max=n - 1)] * frac  # the quartiles
        for step in range(iterations + 1):
            bounds = _bucket_bounds(values, cuts)
            counts = bounds[:, 1:] - bounds[:, :-1]
            totals = sums.gather(1, bounds[:, 1:]) - sums.gather(1, bounds[:, :-1])
            edges = torch.cat([cuts[:, :1], cuts, cuts[:, -1:]], dim=1)
            empty = 0.5 * (edges[:, :-1] + edges[:, 1:])
            means = torch.where(counts > 0, totals / counts.clamp(min=1), empty)
            if step == iterations:
                break
            cuts = 0.5 * (means[:, :-1] + means[:, 1:])
        if grid != "free":  # the values returned: the fit of the buckets the cutoffs returned make
            for step in range(iterations + 1):
                if step:
                    cuts = 0.5 * (means[:, :-1] + means[:, 1:])
                bounds = _bucket_bounds(values, cuts)
                counts = (bounds[:, 1:] - bounds[:, :-1]).double()
                totals = sums.gather(1, bounds[:, 1:]) - sums.gather(1, bounds[:, :-1])
                means = _constrained_values(counts, totals, means, _GRID_TERMS[grid])
        cutoffs[a : a + block] = cuts.float()
        weights[a : a + block] = means.float()
    return cutoffs, weights


def _bucket_bounds(values: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """int64 [b, 5]: where each bucket starts in each row of the sorted ``values`` (the residuals below
    each cutoff), and the row's end."""
    import torch

    rows, n = values.shape
    return torch.cat(
        [
            torch.zeros(rows, 1, dtype=torch.int64),
            torch.searchsorted(values, cuts),
            torch.full((rows, 1), n, dtype=torch.int64),
        ],
        dim=1,
    )


# bucket l + 2h -> its value's terms: separable (1, l, h), value = b0 + l D0 + h D1; uniform (1, b), value
# = b0 + b D
_GRID_TERMS = {
    "separable": ((1.0, 0.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.0, 1.0), (1.0, 1.0, 1.0)),
    "uniform": ((1.0, 0.0), (1.0, 1.0), (1.0, 2.0), (1.0, 3.0)),
}
BUCKET_GRIDS = ("free", *_GRID_TERMS)


def _constrained_values(
    counts: torch.Tensor, totals: torch.Tensor, previous: torch.Tensor, grid_terms: tuple
) -> torch.Tensor:
    """float64 [b, 4]: the values ``terms @ params`` (``grid_terms``: a bucket's row of terms) of least
    squared error for buckets of ``counts`` members summing to ``totals`` ([b, 4] each), the parameters
    rounded to the grid 2^(e - 23) with 2^e above the largest magnitude a value can have from them, so
    that each value, and each sum or difference of them, is exact in fp32. A row whose buckets leave the
    system singular (too few kinds of members), or whose values would not increase, keeps ``previous``."""
    import torch

    terms = torch.tensor(grid_terms, dtype=torch.float64)
    normal = torch.einsum("bj,jk,jl->bkl", counts, terms, terms)
    rhs = torch.einsum("bj,jk->bk", totals, terms)
    solvable = torch.linalg.matrix_rank(normal) == terms.shape[1]
    eye = torch.eye(terms.shape[1], dtype=torch.float64).expand_as(normal)
    params = torch.linalg.solve(torch.where(solvable[:, None, None], normal, eye), rhs)
    top = (params.abs() * terms.abs().max(dim=0).values).sum(dim=1).clamp(min=2.0**-100)
    grid = torch.exp2(torch.ceil(torch.log2(top)) - 23)[:, None]
    values = (torch.round(params / grid) * grid) @ terms.T
    keep = solvable & (values[:, 1:] > values[:, :-1]).all(dim=1)
    return torch.where(keep[:, None], values, previous)


# `nearest_centroids`: distances held at once on the host (64 MiB of fp32), and rows a launch of the GPU
# kernel (which holds no distances: 64 MiB of fp16 rows at dim 128)
NEAREST_BLOCK_ELEMS = 1 << 24
NEAREST_GPU_ROWS = 1 << 18


def nearest_centroids(
    x: torch.Tensor,
    centroids: torch.Tensor,
    block_elems: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The index (int64 [n], on the device of ``x``) of the centroid nearest each row of ``x`` in L2:
    argmax of ``x . c - |c|^2 / 2`` in fp32 (the first index of a tie), computed on ``device`` (default:
    that of ``x``) a block of rows at a time.

    On a GPU, fp16 rows against fp16 centroids (a codebook's) take `maxsim_kernels.nearest_centroid`: the
    tensor cores' products of fp16 values are exact in fp32, so its scores are the fp32 ones up to the
    order of the summation, and no [rows, K] matrix of them reaches memory. Other inputs take an fp32
    product a block of at most ``block_elems`` distances at a time, then its argmax."""
    import torch

    work = x.device if device is None else torch.device(device)
    cent = centroids.to(work)
    cent32 = cent.float()
    half_norm = 0.5 * (cent32 * cent32).sum(dim=1)
    n, k = x.shape[0], cent.shape[0]
    ids = torch.empty(n, dtype=torch.int64, device=work)
    if work.type == "cuda" and x.dtype == torch.float16 and cent.dtype == torch.float16 and k > 0:
        from maxsim_kernels.nearest_centroid import nearest_centroid_ids

        for a in range(0, n, NEAREST_GPU_ROWS):
            rows = x[a : a + NEAREST_GPU_ROWS].to(work, non_blocking=True)
            nearest_centroid_ids(rows, cent, half_norm, out=ids[a : a + rows.shape[0]])
        return ids.to(x.device)
    step = max(1, (block_elems or NEAREST_BLOCK_ELEMS) // max(1, k))
    # one distance block reused: a fresh one a block is, on the host, a fresh mapping whose page faults
    # (system time) cost more than the product
    dist = torch.empty(min(step, n), k, dtype=torch.float32, device=work)
    for a in range(0, n, step):
        rows = x[a : a + step].to(work, non_blocking=True).float()
        block = torch.mm(rows, cent32.T, out=dist[: rows.shape[0]])
        block.sub_(half_norm)
        torch.argmax(block, dim=1, out=ids[a : a + rows.shape[0]])
    return ids.to(x.device)


def encode(
    quantization: str, x: torch.Tensor, codebook: Codebook | Int2Grid | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes uint8 [T, width], fp32 scales [T] or None) of float tokens ``x`` [T, dim]."""
    from maxsim_kernels import code_packing

    if quantization == "int4-per-token":
        return code_packing.encode_int4(x)
    assert codebook is not None
    if isinstance(codebook, Int2Grid):
        return code_packing.encode_int2(x, codebook.for_kernels(x.device))
    centroids = codebook.centroids.to(x.device)  # no copy for a codebook there already (`Codebook.to`)
    ids = nearest_centroids(x, centroids)
    rows = code_packing.encode_residual2(x, ids, centroids, codebook.bucket_cutoffs.to(x.device))
    return rows, None


def check_code_rows(
    path: str, quantization: str, rows: torch.Tensor, num_centroids: int, offsets: np.ndarray, ids: list[str]
) -> None:
    """A residual2 centroid id at or past ``num_centroids``: one line naming the shard, document and token."""
    if quantization != "residual2-kmeans" or rows.numel() == 0:
        return
    from maxsim_kernels.code_packing import residual2_ids

    bad = (residual2_ids(rows) >= num_centroids).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        doc = int(np.searchsorted(offsets, row, side="right")) - 1
        raise _err(
            path,
            f"document {ids[doc]!r} token {row - int(offsets[doc])} has centroid id "
            f"{int(residual2_ids(rows[row : row + 1])[0])}, outside the codebook's {num_centroids} "
            "centroids; the file is damaged: quantize again",
        )


def corpus_codebook(infos: list[Any]) -> Codebook | Int2Grid | None:
    """The codebook of a residual2 or int2 corpus (None for any other), from the `ShardInfo` of its shards:
    each shard's codebook file is read (once per file) and checked against what the shard records; shards
    that record different codebooks are refused, naming both."""
    if not infos or infos[0].quantization not in ("residual2-kmeans", "int2-grid"):
        return None
    first = infos[0]
    loaded: dict[str, Codebook] = {}
    for info in infos:
        if (info.codebook_sha256, info.num_centroids) != (first.codebook_sha256, first.num_centroids):
            raise InputError(
                f"{info.path}: its codebook (sha256 {info.codebook_sha256[:16]}...) differs from that of "
                f"{first.path} ({first.codebook_sha256[:16]}...); a corpus is quantized with one codebook"
            )
        path = shard_codebook_path(info.path, info.codebook)
        if path not in loaded:
            loaded[path] = read_codebook(
                path, shard=info.path, sha256=info.codebook_sha256, dim=info.dim,
                num_centroids=info.num_centroids, quantization=first.quantization,
            )  # fmt: skip
    return next(iter(loaded.values()))
