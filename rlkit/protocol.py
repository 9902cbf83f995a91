"""DataProto: the batch that flows between the steps of an RL loop.

A DataProto holds three kinds of data:
  * ``tensors``     - torch tensors, all sharing the same first (batch) dimension;
  * ``non_tensors`` - per-sample numpy arrays (usually dtype=object: uids, dicts, strings);
  * ``meta``        - batch-level info (metrics, temperature, ...), not indexed by row.
Row operations (index, repeat, concat, ...) act on tensors and non_tensors together,
so the i-th row of every column always describes the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


def _as_object_array(values, key: str) -> np.ndarray:
    """Turn a list/tuple into a 1-D object array (lists of dicts/lists stay 1-D)."""
    if isinstance(values, np.ndarray):
        return values
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"non-tensor {key!r} must be a list or np.ndarray, got {type(values).__name__}")
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def _rows(key: str, value) -> int:
    """Batch size of one column (its first dimension)."""
    if not isinstance(value, (Tensor, np.ndarray)):
        raise TypeError(f"column {key!r} must be a torch.Tensor or np.ndarray, got {type(value).__name__}")
    if value.ndim == 0:
        raise ValueError(f"column {key!r} is 0-dimensional; it needs a batch dimension")
    return value.shape[0]


@dataclass
class DataProto:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tensors = dict(self.tensors)
        self.non_tensors = {k: _as_object_array(v, k) for k, v in self.non_tensors.items()}
        self.meta = dict(self.meta)
        expected = None
        for key, value in self._columns():
            n = _rows(key, value)
            if expected is None:
                expected, first = n, key
            elif n != expected:
                raise ValueError(f"column {key!r} has length {n}, expected {expected} (the length of {first!r})")

    def _columns(self):
        yield from self.tensors.items()
        yield from self.non_tensors.items()

    @classmethod
    def from_dict(cls, tensors=None, non_tensors=None, meta=None) -> DataProto:
        """Build a DataProto from optional dicts of tensors, non-tensors (lists or arrays) and meta."""
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta or {}))

    def __len__(self) -> int:
        """Batch size: the first dimension shared by all columns (0 if there are none)."""
        for key, value in self._columns():
            return _rows(key, value)
        return 0

    def __iter__(self):
        """Iterate over one-row DataProtos."""
        return (self[i] for i in range(len(self)))

    def __getitem__(self, key):
        """``str`` -> that column; ``int`` -> a one-row DataProto; anything else -> ``self.index(key)``."""
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.non_tensors:
                return self.non_tensors[key]
            raise KeyError(f"{key!r} not found; available keys: {self.keys()}")
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            n = len(self)
            if not -n <= key < n:
                raise IndexError(f"row {key} out of range for batch of size {n}")
            return self.index([int(key) % n])
        return self.index(key)

    def __setitem__(self, key: str, value):
        """Set a column: tensors go to ``tensors``, anything else to ``non_tensors`` (length checked)."""
        if isinstance(value, Tensor):
            target, other = self.tensors, self.non_tensors
        else:
            value = _as_object_array(value, key)
            target, other = self.non_tensors, self.tensors
        n = _rows(key, value)
        expected = next((_rows(k, v) for k, v in self._columns() if k != key), None)
        if expected is not None and n != expected:
            raise ValueError(f"column {key!r} has length {n}, expected {expected}")
        other.pop(key, None)
        target[key] = value

    def __contains__(self, key) -> bool:
        """True if ``key`` names a tensor or non-tensor column."""
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        """Names of all columns: tensor keys first, then non-tensor keys."""
        return list(self.tensors) + list(self.non_tensors)

    def index(self, idx) -> DataProto:
        """Select rows by slice, int list, index tensor/array or boolean mask (meta is kept).

        Slices share storage with ``self``; other indices make copies (as torch/numpy do).
        """
        if isinstance(idx, slice):
            t_idx = np_idx = idx
        else:
            np_idx = idx.cpu().numpy() if isinstance(idx, Tensor) else np.asarray(idx)
            if np_idx.size == 0 and np_idx.dtype.kind not in "bi":
                np_idx = np_idx.astype(np.int64)
            t_idx = torch.from_numpy(np_idx)
        return DataProto(
            {k: v[t_idx.to(v.device) if isinstance(t_idx, Tensor) else t_idx] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def select(self, tensor_keys=None, non_tensor_keys=None, meta_keys=None) -> DataProto:
        """Return a DataProto with a subset of columns. ``None`` keeps all of that kind, ``[]`` keeps none."""

        def pick(d, keys):
            return dict(d) if keys is None else {k: d[k] for k in keys}

        return DataProto(pick(self.tensors, tensor_keys), pick(self.non_tensors, non_tensor_keys), pick(self.meta, meta_keys))

    def pop(self, tensor_keys=(), non_tensor_keys=()) -> DataProto:
        """Remove the given columns from ``self`` and return them (with a copy of meta)."""
        for k in list(tensor_keys) + list(non_tensor_keys):
            if k not in self:
                raise KeyError(f"{k!r} not found; available keys: {self.keys()}")
        return DataProto(
            {k: self.tensors.pop(k) for k in tensor_keys}, {k: self.non_tensors.pop(k) for k in non_tensor_keys}, dict(self.meta)
        )

    def union(self, other: DataProto) -> DataProto:
        """Merge the columns of ``self`` and ``other`` into a new DataProto.

        Batch sizes must match (unless one side has no columns) and same-named columns must be
        equal. Meta dicts are merged; ``other`` wins on shared meta keys.
        """
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"cannot union batches of size {len(self)} and {len(other)}")
        for k, v in other.tensors.items():
            if k in self.tensors and not (v.shape == self.tensors[k].shape and torch.equal(v, self.tensors[k])):
                raise ValueError(f"union conflict: tensor {k!r} differs between the two batches")
        for k, v in other.non_tensors.items():
            if k in self.non_tensors and not np.array_equal(v, self.non_tensors[k]):
                raise ValueError(f"union conflict: non-tensor {k!r} differs between the two batches")
        return DataProto({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors}, {**self.meta, **other.meta})

    @staticmethod
    def concat(items: list[DataProto]) -> DataProto:
        """Concatenate along the batch dimension. All items need the same keys; meta comes from the first."""
        if not items:
            raise ValueError("concat needs at least one DataProto")
        first = items[0]
        for i, item in enumerate(items[1:], start=1):
            for kind in ("tensors", "non_tensors"):
                a, b = set(getattr(first, kind)), set(getattr(item, kind))
                if a != b:
                    key = sorted(a ^ b)[0]
                    raise ValueError(f"concat: {kind[:-1]} key {key!r} is missing from item {i if key in a else 0}")
        return DataProto(
            {k: torch.cat([it.tensors[k] for it in items]) for k in first.tensors},
            {k: np.concatenate([it.non_tensors[k] for it in items]) for k in first.non_tensors},
            dict(first.meta),
        )

    def chunk(self, n: int) -> list[DataProto]:
        """Split into ``n`` equal chunks; the batch size must be divisible by ``n``."""
        if n <= 0 or len(self) % n != 0:
            raise ValueError(
                f"cannot split a batch of size {len(self)} into {n} equal chunks; "
                f"use pad_to_divisor({n}) first and unpad the results afterwards"
            )
        size = len(self) // n
        return [self.index(slice(i * size, (i + 1) * size)) for i in range(n)]

    def split(self, size: int) -> list[DataProto]:
        """Split into chunks of ``size`` rows (the last one may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Repeat every row ``n`` times: interleave gives [a,a,b,b], otherwise [a,b,a,b]."""
        rows = torch.arange(len(self))
        return self.index(rows.repeat_interleave(n) if interleave else rows.repeat(n))

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of the first rows (cycling) so ``len % divisor == 0``; return (padded, pad_size)."""
        n = len(self)
        pad_size = -n % divisor
        if pad_size == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty batch")
        return self.index(torch.cat([torch.arange(n), torch.arange(pad_size) % n])), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (undoes ``pad_to_divisor``)."""
        return self.index(slice(0, len(self) - pad_size)) if pad_size else self

    def to(self, device) -> DataProto:
        """Move all tensors to ``device`` (non-tensors and meta are shared)."""
        return DataProto({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    def permute(self, perm) -> DataProto:
        """Reorder rows by ``perm``, which must be a permutation of ``range(len(self))``."""
        perm = torch.as_tensor(perm, dtype=torch.long)
        if not torch.equal(perm.sort().values, torch.arange(len(self))):
            raise ValueError(f"not a permutation of range({len(self)})")
        return self.index(perm)

    def shuffled(self, seed: int) -> DataProto:
        """Return the rows in a random order that is fully determined by ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        return self.permute(torch.randperm(len(self), generator=gen))

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items())
        return f"DataProto(batch_size={len(self)}, tensors={{{tensors}}}, non_tensors={list(self.non_tensors)}, meta={list(self.meta)})"
