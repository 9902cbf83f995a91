"""The two places where megatron-core assumes CUDA, patched for CPU processes (gloo). Applied only without CUDA.

Checked against megatron-core 0.16.1 (the newest release for Python 3.11), local (non-Transformer-Engine)
layer spec, no sequence parallelism:

1. `megatron.core.utils.GlobalMemoryBuffer.get_tensor` allocates its scratch buffer (the attention
   scores' `baddbmm` input) on `torch.cuda.current_device()`; here it allocates on the CPU.
2. `megatron.core.tensor_parallel.random.CudaRNGStatesTracker` stores and swaps CUDA RNG states:
   `add()` and `fork()` (used around attention dropout) fail without CUDA. Here `add()` only records
   the name and `fork()` is a no-op: the CPU generator is used as is. rlkit runs with dropout off, so
   nothing random happens inside a fork.
3. `megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb` moves `inv_freq`
   to `torch.cuda.current_device()` at the first forward pass; here, during that call only, the
   "current device" is the CPU.

A newer megatron-core may move these; `apply()` checks the attributes exist and names the version it
was written for when they do not.
"""

from __future__ import annotations

import contextlib
import operator
from functools import reduce

import torch

CHECKED_VERSION = "0.16.1"
_applied = False


def apply() -> None:
    """Patch megatron-core for CPU (idempotent); does nothing when CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as mrandom

    patched = ((utils.GlobalMemoryBuffer, "get_tensor"), (mrandom.CudaRNGStatesTracker, "fork"), (mrandom.CudaRNGStatesTracker, "add"))
    for owner, name in (*patched, (RotaryEmbedding, "get_emb")):
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron-core changed: {owner.__name__}.{name} is gone (rlkit's CPU shims were checked on {CHECKED_VERSION})"
            )

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype, device="cpu")
        return buf[:n].view(*tensor_shape)

    def add(self, name, seed):
        self.states_[name] = None  # no CUDA state to keep

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    cuda_get_emb = RotaryEmbedding.get_emb

    def get_emb(self, *args, **kwargs):
        current, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"
        try:
            return cuda_get_emb(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current

    utils.GlobalMemoryBuffer.get_tensor = get_tensor
    RotaryEmbedding.get_emb = get_emb
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    _applied = True
