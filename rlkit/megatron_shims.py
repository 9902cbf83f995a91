"""The places where megatron-core assumes CUDA, patched for CPU processes (gloo) (`apply`, only without CUDA), and
its activation recompute made to run under the forward's autocast (`recompute_under_autocast`, on every device).

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
4. Activation recompute (`tensor_parallel.random.CheckpointFunction`) saves and restores the CUDA RNG states
   (`_get_cuda_rng_state` / `_set_cuda_rng_state`): here there are none.
5. The linear layers' autograd function (`LinearWithGradAccumulationAndAsyncCommunication`) re-enters the forward's
   autocast in its backward for CUDA only (`custom_bwd(device_type="cuda")`): under CPU autocast its backward would
   multiply a bf16 gradient by the float32 weight. Here the backward runs under the forward's CPU autocast.

`recompute_under_autocast`: Megatron's CheckpointFunction recomputes a layer in the backward without the
forward's autocast (it expects bf16 weights, not float32 masters under autocast): the recomputation multiplies the
saved bf16 input by a float32 weight and fails ("expected m1 and m2 to have the same dtype", on CPU), and where it
did not it would run in float32, not as the forward did. Patched, the recomputed function runs under the autocast
state (CUDA and CPU) that was active when the layer ran forward, as torch.utils.checkpoint does.

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
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel import random as mrandom

    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    patched = ((utils.GlobalMemoryBuffer, "get_tensor"), (mrandom.CudaRNGStatesTracker, "fork"), (mrandom.CudaRNGStatesTracker, "add"))
    rng = ((mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state"), (linear, "forward"), (linear, "backward"))
    for owner, name in (*patched, *rng, (RotaryEmbedding, "get_emb")):
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron-core changed: {getattr(owner, '__name__', owner)}.{name} is gone (rlkit's CPU shims were checked on {CHECKED_VERSION})"
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

    linear_forward, linear_backward = linear.forward, linear.backward

    def forward(ctx, *args):
        ctx.cpu_autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        return linear_forward(ctx, *args)

    def backward(ctx, *grads):
        on, dtype = ctx.cpu_autocast
        with torch.autocast("cpu", dtype=dtype, enabled=on):
            return linear_backward(ctx, *grads)

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    linear.forward, linear.backward = staticmethod(forward), staticmethod(backward)
    utils.GlobalMemoryBuffer.get_tensor = get_tensor
    RotaryEmbedding.get_emb = get_emb
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    _applied = True


_recompute_patched = False


def recompute_under_autocast() -> None:
    """Megatron's activation recompute under the forward's autocast (module docstring; idempotent, every device)."""
    global _recompute_patched
    if _recompute_patched:
        return
    from megatron.core.tensor_parallel import random as mrandom

    fn = mrandom.CheckpointFunction
    checkpoint_forward = fn.forward

    def forward(ctx, run_function, distribute_saved_activations, *args):
        devices = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
        state = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]

        def run(*inputs):  # the forward and its recomputation in the backward, under the same autocast
            with contextlib.ExitStack() as stack:
                for device, on, dtype in state:
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=on))
                return run_function(*inputs)

        return checkpoint_forward(ctx, run, distribute_saved_activations, *args)

    fn.forward = staticmethod(forward)
    _recompute_patched = True
