"""What shard writers and in-memory shards take from a user, as tensors: arrays or tensors of numbers
(`as_tensor`, `infer_dtype`) and masks (`mask_rows`); and the warning about documents that carry
all-zero token rows (`zero_row_warning`: padding kept without its mask, most often).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from maxsim_cli.errors import InputError
from maxsim_cli.shards.format import one_line, show_id, torch_dtypes

if TYPE_CHECKING:
    import torch


def as_tensor(x: Any, where: str = "embeddings", *, keep_device: bool = False) -> torch.Tensor:
    """An array or tensor of numbers as a CPU tensor (``keep_device``: a tensor stays on its device);
    anything else (strings, objects, complex or boolean values, ragged nested lists) is an `InputError`
    naming ``where`` (the file and document)."""
    import torch

    if isinstance(x, torch.Tensor):
        if x.is_complex():
            raise InputError(f"{where}: dtype {x.dtype} is not a real-number type; {_NUMBERS}")
        if x.device.type == "meta":
            raise InputError(f"{where}: a tensor on the meta device holds no values; {_NUMBERS}")
        return x.detach() if keep_device else x.detach().cpu()
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged nested lists, objects numpy cannot take
        raise InputError(f"{where}: not an array of numbers ({one_line(exc)}); {_NUMBERS}") from None
    if arr.dtype == np.float64 or arr.dtype == np.float32 or arr.dtype == np.float16 or arr.dtype == np.int8:
        with warnings.catch_warnings():  # read-only (memory-mapped) arrays: we never write to them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    if arr.dtype.kind in "iu" or arr.dtype.kind == "f":
        return torch.from_numpy(arr.astype(np.float32))
    raise InputError(f"{where}: dtype {arr.dtype} is not a real-number type; {_NUMBERS}")


# What `as_tensor` and `mask_rows` ask for.
_NUMBERS = "pass arrays or tensors of numbers (float16, bfloat16, float32, float64 or integers)"
_MASKS = "a mask holds True/1 for real tokens, False/0 for padding, one row a document"


def infer_dtype(x: torch.Tensor) -> str:
    """The shard dtype for an input tensor: float64 is stored as float32, the others as they are."""
    import torch

    if x.dtype == torch.float64:
        return "float32"
    dtype_names = {v: k for k, v in torch_dtypes().items()}
    if x.dtype in dtype_names:
        return dtype_names[x.dtype]
    raise TypeError(f"unsupported embedding dtype {x.dtype}")


def mask_rows(mask: Any, where: str) -> torch.Tensor:
    """One document's mask as a bool tensor: True/1 marks a real token, False/0 padding."""
    import torch

    if isinstance(mask, torch.Tensor):
        if mask.device.type == "meta":
            raise InputError(f"{where}: a tensor on the meta device holds no values; {_MASKS}")
        keep = mask.detach().cpu()
    else:
        try:
            array = np.asarray(mask)
        except (ValueError, TypeError) as exc:  # ragged nested lists
            raise InputError(
                f"{where}: not an array of booleans or 0/1 ({one_line(exc)}); {_MASKS}"
            ) from None
        if array.dtype.kind not in "biuf":  # None, strings, objects
            raise InputError(f"{where}: dtype {array.dtype} is not boolean or 0/1; {_MASKS}")
        keep = torch.as_tensor(array)
    if keep.is_complex():
        raise InputError(f"{where}: dtype {keep.dtype} is not boolean or 0/1; {_MASKS}")
    if keep.dtype != torch.bool:
        if not bool(((keep == 0) | (keep == 1)).all()):
            bad = keep[(keep != 0) & (keep != 1)][0].item()
            raise InputError(
                f"{where} holds {bad!r}; a mask holds True/1 for real tokens, False/0 for padding"
            )
        keep = keep != 0
    return keep


def zero_row_warning(path: str, num_docs: int, first_id: str, remedy: str, *, where: str = "") -> str:
    """What to tell a user whose documents carry all-zero token rows (most often padding kept because
    the mask was not passed: the rows then take part in every max and change the scores). `where`: the
    first document's place in its source."""
    docs = f"{num_docs:,} document carries" if num_docs == 1 else f"{num_docs:,} documents carry"
    first = show_id(first_id) + (f" at {where}" if where else "")
    return f"{path}: {docs} all-zero token rows (first: {first}): padding kept without its mask? {remedy}"
