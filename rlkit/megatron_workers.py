"""Workers whose policy is a Megatron-core GPTModel split by tensor parallelism (--trainer.engine megatron).

World = T x D processes (--trainer.n-workers = T * D, --trainer.tp-size T): each tensor-parallel group of T
processes holds one copy of the model, every linear layer cut in T (attention heads and MLP columns, the
vocabulary of the embedding and LM head); the D groups are data parallel (gradients averaged over them).

- weights in: the Hugging Face checkpoint (Llama / Qwen2 shaped: RMSNorm, SwiGLU, RoPE, GQA, Qwen2's
  qkv bias, tied or untied embeddings) is loaded and cut into this rank's shards (`hf_to_megatron`);
  out: the shards are all-gathered over the tensor-parallel group and mapped back (`megatron_to_hf`);
- log-probs from vocab-parallel logits: each rank holds logits over V/T tokens, and
      log pi(y) = z_y - logsumexp(z),  logsumexp(z) = m + log sum_ranks sum_j exp(z_j - m),  m = max over ranks
  with z_y taken on the rank owning y; entropy H = logsumexp(z) - sum_j p_j z_j, both sums all-reduced
  (differentiable) over the tensor-parallel group: the full vocabulary is never gathered;
- rollout (the hybrid engine): after each update the full weights are gathered into a Hugging Face copy of the
  model kept in every process, which generates its own share of the prompts (as the FSDP workers do);
- grad norm: squares of sharded weights summed over the tensor-parallel group, replicated ones (norms) once;
- checkpoints: each process writes its own shards + optimizer state (rank{r}.pt); resume with the same T and D.

Precision and memory, as the torch engine: --model.dtype is the compute dtype (auto: bf16 on GPU, float32 on CPU); in
bf16 the shards stay float32 masters and every pass runs under torch.autocast (rlkit/engine.py's docstring), the
reference copy and the HF generation copy are stored in bf16. --model.gradient-checkpointing (auto: on for a real
model on a GPU) is Megatron's full recompute, one layer at a time (recompute_granularity "full", "uniform", 1 layer:
each layer's input kept, its activations recomputed in the backward). Attention is torch's scaled_dot_product_attention
(`SDPAttention`: flash / memory-efficient kernels, no (b, heads, L, L) scores; Megatron's own fused softmax needs
Transformer Engine or apex kernels), and the LM head runs on the response positions only (the last keep + 1 columns).
The layout stays padded (rows trimmed to their longest prompt + response): no packing.

Not yet: pipeline parallelism, sequence parallelism, LoRA, a Megatron critic, vLLM rollout.
CPU runs need shims for CUDA assumptions (rlkit/megatron_shims.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist

from rlkit.config import System, rows_per_mini_batch
from rlkit.engine import TorchEngine, trim_padding
from rlkit.errors import ConfigError, MissingFile, MissingPackage
from rlkit.protocol import DataProto
from rlkit.ray_group import dispatch
from rlkit.workers import ActorRolloutRefWorker

INSTALL = "bash scripts/install.sh megatron"


def require_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise MissingPackage(f"--trainer.engine megatron needs megatron-core: {INSTALL}") from e


# -- model and weight conversion -----------------------------------------------------------------
def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of T (each rank holds V/T rows); padded logits are masked."""
    return -(-vocab // tp) * tp


@functools.cache
def sdpa_attention_class():
    """Megatron's core attention (local spec) computed by torch's scaled_dot_product_attention.

    Megatron's DotProductAttention materialises the (b, heads, L, L) scores and their softmax (in float32 whenever
    the config is bf16 or under autocast); its fused softmax needs compiled kernels (apex / Transformer Engine).
    SDPA with a boolean mask runs a memory-efficient or flash kernel instead (CUDA and CPU): O(L) per head.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            """query (sq, b, heads, d), key/value (sk, b, groups, d), attention_mask (b, 1, sq, sk) True = masked -> (sq, b, heads*d)."""
            assert packed_seq_params is None and attention_bias is None
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (b, heads, s, d)
            if q.shape[1] != k.shape[1]:  # GQA: each group's key/value for its query heads (Megatron's order)
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            else:  # a left-padding query sees only itself: no fully masked row (NaN in SDPA, and 0 * NaN downstream)
                eye = torch.eye(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask | eye, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return SDPAttention


def build_gpt(hf_config, tp: int, dtype: torch.dtype = torch.float32, recompute: bool = False):
    """A Megatron GPTModel (local layer spec, no Transformer Engine, SDPA attention) shaped like a Llama/Qwen2 HF config.

    dtype: the parameters' (float32 masters under autocast, or the compute dtype); recompute: Megatron's full
    activation recompute, one layer at a time, applied while the decoder is in training mode (engine._checkpointing).
    """
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from rlkit import megatron_shims

    c = hf_config
    if c.model_type not in ("llama", "qwen2") or getattr(c, "mlp_bias", False):
        raise ConfigError(
            f"--trainer.engine megatron: model type {c.model_type!r} is not mapped (Llama and Qwen2 are); use the fsdp engine"
        )
    heads, groups = c.num_attention_heads, c.num_key_value_heads
    if heads % tp or groups % tp:
        raise ConfigError(f"--trainer.tp-size {tp} must divide the attention heads ({heads}) and key/value heads ({groups})")
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0), "rope_type": "default"}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"--trainer.engine megatron: rope type {rope['rope_type']!r} is not mapped (plain RoPE is)")
    cfg = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=c.model_type == "qwen2" or getattr(c, "attention_bias", False),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
    )
    if recompute:
        megatron_shims.recompute_under_autocast()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(c.vocab_size, tp),
        max_sequence_length=c.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope["rope_theta"]),
        share_embeddings_and_output_weights=bool(c.tie_word_embeddings),
    )
    gpt.decoder.gradient_checkpointing = recompute  # the flag engine._checkpointing looks for: training mode in the update
    return gpt


def _dims(c) -> tuple[int, int, int]:
    """(query heads per key/value group, key/value groups, head dim)."""
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_attention_heads // c.num_key_value_heads, c.num_key_value_heads, d


def hf_to_megatron(sd: dict, c, tp: int, rank: int) -> dict:
    """This tensor-parallel rank's shards, keyed by Megatron parameter names, from a full HF state dict.

    Megatron's fused qkv keeps, per key/value group g, [q heads of g; k_g; v_g] (so a rank gets whole groups);
    linear_fc1 is [gate; up] of this rank's columns; column-parallel weights split rows, row-parallel columns.
    """
    hpg, ng, d = _dims(c)
    V = padded_vocab(c.vocab_size, tp)

    def rows(w):  # (out, ...) -> this rank's rows
        return w.chunk(tp, dim=0)[rank]

    def vocab(w):  # (V, H) padded with zero rows to a multiple of T
        return rows(torch.cat([w, w.new_zeros(V - w.shape[0], w.shape[1])]))

    def qkv(q, k, v):  # (ng*hpg*d, ...), (ng*d, ...) x 2 -> this rank's groups of [q; k; v]
        tail = q.shape[1:]
        fused = torch.cat([q.reshape(ng, hpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1)
        return rows(fused.reshape(ng * (hpg + 2) * d, *tail))

    out = {
        "embedding.word_embeddings.weight": vocab(sd["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    if not c.tie_word_embeddings:
        out["output_layer.weight"] = vocab(sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"])
        if a + "q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = qkv(sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"])
        out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"].chunk(tp, dim=1)[rank]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([rows(sd[h + "mlp.gate_proj.weight"]), rows(sd[h + "mlp.up_proj.weight"])])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
    return out


def megatron_to_hf(shards: list[dict], c) -> dict:
    """The full HF state dict from every tensor-parallel rank's shards (`shards[r]` = rank r's, Megatron names)."""
    hpg, ng, d = _dims(c)

    def cat(key, dim=0):
        return torch.cat([s[key] for s in shards], dim=dim)

    def split_qkv(w):  # -> q, k, v in HF order
        tail = w.shape[1:]
        g = w.reshape(ng, (hpg + 2) * d, *tail)
        return (
            g[:, : hpg * d].reshape(-1, *tail),
            g[:, hpg * d : (hpg + 1) * d].reshape(-1, *tail),
            g[:, (hpg + 1) * d :].reshape(-1, *tail),
        )

    V = c.vocab_size
    out = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight")[:V],
        "model.norm.weight": shards[0]["decoder.final_layernorm.weight"],
    }
    out["lm_head.weight"] = cat("output_layer.weight")[:V] if not c.tie_word_embeddings else out["model.embed_tokens.weight"]
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"]
        for name, w in zip(("q_proj", "k_proj", "v_proj"), split_qkv(cat(m + "self_attention.linear_qkv.weight"))):
            out[f"{a}{name}.weight"] = w
        if m + "self_attention.linear_qkv.bias" in shards[0]:
            for name, b in zip(("q_proj", "k_proj", "v_proj"), split_qkv(cat(m + "self_attention.linear_qkv.bias"))):
                out[f"{a}{name}.bias"] = b
        out[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", dim=1)
        out[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"]
        gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
        out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
        out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", dim=1)
    return out


def local_params(model) -> dict:
    """This rank's weights by Megatron name (no `_extra_state` entries)."""
    return {k: v for k, v in model.named_parameters()}


def gather_hf_state(model, c) -> dict:
    """All-gather every rank's shards over the tensor-parallel group and map them to one full HF state dict."""
    from megatron.core import parallel_state as ps

    mine = {k: v.detach().cpu() for k, v in local_params(model).items()}
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, mine, group=ps.get_tensor_model_parallel_group())
    return megatron_to_hf(shards, c)


# -- vocab-parallel log-probs ----------------------------------------------------------------------
class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) over the tensor-parallel group. Backward: identity, because every rank of the
    group computes the same loss from the sum (Megatron's reduce_from_tensor_model_parallel_region, with a group)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_logprobs(logits, labels, vocab: int, group, with_entropy: bool = False):
    """log pi(labels) and (optionally) the entropy from this rank's slice of the logits, (b, R, V/T) -> (b, R).

    Rank r holds tokens [r*V/T, (r+1)*V/T); ids >= vocab (padding to a multiple of T) get -inf. Formula in the module docstring.
    """

    def all_reduce(x, group):
        return _SumOverGroup.apply(x, group)

    n = logits.shape[-1]
    start = dist.get_rank(group) * n
    valid = torch.arange(start, start + n, device=logits.device) < vocab  # (V/T,)
    z = logits.masked_fill(~valid, float("-inf"))
    m = z.detach().amax(-1)  # (b, R)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))  # (b, R, V/T)
    s = all_reduce(e.sum(-1), group=group)  # (b, R)
    lse = m + torch.log(s)
    local = labels - start
    mine = (local >= 0) & (local < n)
    picked = torch.gather(z, -1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * mine  # z_y on the owning rank, else 0
    logp = all_reduce(picked, group=group) - lse
    if not with_entropy:
        return logp, None
    p_z = (e / s.unsqueeze(-1)) * z.masked_fill(~valid, 0.0)
    return logp, lse - all_reduce(p_z.sum(-1), group=group)


# -- the engine ------------------------------------------------------------------------------------
class MegatronEngine(TorchEngine):
    """TorchEngine whose model (and reference copy) is a tensor-parallel Megatron GPTModel.

    The update loop, optimizer and loss contract are TorchEngine's; what differs: the forward pass
    (Megatron's model, vocab-parallel log-probs) and the gradient norm (data-parallel averaging first,
    then the norm over the tensor-parallel shards). `hf_model` is a full HF copy for the rollout and export.
    """

    masters_under_wrap = True  # its wrap only converts the model: float32 masters + autocast in bf16, as without a wrap

    def __init__(
        self,
        model_cfg,
        actor_cfg=None,
        device: str = "auto",
        need_ref: bool | None = None,
        value_head: bool = False,
        wrap=None,
        model_sys=None,
        update_sys=None,
    ):
        from megatron.core import parallel_state as ps

        if value_head or model_cfg.lora_rank > 0:
            raise ConfigError("--trainer.engine megatron trains the full policy only (no LoRA, no critic yet): use the fsdp engine")
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self.hf_model = None
        super().__init__(
            model_cfg, actor_cfg, device, need_ref=need_ref, wrap=self._to_megatron, model_sys=model_sys, update_sys=update_sys
        )

    def _to_megatron(self, hf):
        """wrap: the HF model's weights cut into this rank's Megatron shards. The first HF model is kept (rollout, export)."""
        from megatron.core import parallel_state as ps

        self.hf_config = hf.config
        gpt = build_gpt(hf.config, self.tp, next(hf.parameters()).dtype, recompute=self.gradient_checkpointing)
        shards = hf_to_megatron(hf.state_dict(), hf.config, self.tp, ps.get_tensor_model_parallel_rank())
        params = local_params(gpt)
        if sorted(params) != sorted(shards):
            raise RuntimeError(f"Megatron/HF name mismatch: {sorted(set(params) ^ set(shards))[:5]}")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(shards[k])
        gpt.requires_grad_(any(p.requires_grad for p in hf.parameters()))  # the reference copy is frozen
        if self.hf_model is None:  # on the engine's device: HFRollout generates there (ids on cuda:0 meet weights on cuda:0);
            # in the compute dtype (a bf16 copy generates as the float32 masters under autocast would; exported in it too)
            self.hf_model = hf.requires_grad_(False).eval().to(self.device, self.dtype)
        return gpt.to(self.device)

    def forward(self, model, mb: DataProto, temperature: float, with_entropy: bool):
        """Per-token log-probs (and entropy) of mb['responses'], (b, R), from vocab-parallel logits.

        Left padding: Megatron's RoPE counts positions from column 0, so a row's real tokens are shifted by its
        padding; attention depends on position differences only, and padded keys are masked: same result.
        The LM head sees only the last keep + 1 positions (those that predict a response token); under the engine's
        autocast (bf16 compute over float32 masters) the logits come out in bf16 and are read in float32.
        """
        prompt_len, resp_len = mb["prompts"].shape[1], mb["responses"].shape[1]
        t, _, keep = trim_padding({k: mb[k].to(self.device) for k in ("input_ids", "attention_mask", "position_ids")}, prompt_len)
        L = t["input_ids"].shape[1]
        allowed = torch.ones(L, L, dtype=torch.bool, device=self.device).tril() & t["attention_mask"].bool()[:, None, :]  # (b, L, L)
        with self.autocast(), lm_head_on_last(model, keep + 1):
            logits = model(input_ids=t["input_ids"], position_ids=t["position_ids"], attention_mask=~allowed[:, None])  # (b, keep+1, V/T)
        logits = logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        labels = mb["responses"][:, :keep].to(self.device)
        lp, en = vocab_parallel_logprobs(logits, labels, self.hf_config.vocab_size, self.tp_group, bool(with_entropy))
        logp = torch.zeros(len(mb), resp_len, device=self.device)
        logp[:, :keep] = lp
        ent = None
        if with_entropy:
            ent = torch.zeros(len(mb), resp_len, device=self.device)
            ent[:, :keep] = en.detach() if with_entropy == "metric" else en
        return logp, ent

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        """Average gradients over data-parallel groups, then clip by the global norm: sqrt(sum over the
        tensor-parallel group of the shards' squares + the replicated weights' squares, counted once)."""
        dp = dist.get_world_size(self.dp_group)
        if dp > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.dp_group)
                    p.grad /= dp
        grads = [(p.grad, getattr(p, "tensor_model_parallel", False)) for p in params if p.grad is not None]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)  # on the gradients' device (NCCL reduces CUDA tensors)
        sq = torch.stack([zero] + [g.double().pow(2).sum() for g, split in grads if split]).sum()
        dist.all_reduce(sq, group=self.tp_group)
        sq = sq + sum((g.double().pow(2).sum() for g, split in grads if not split), zero)
        norm = sq.sqrt().float()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g, _ in grads:
            g.mul_(coef)
        return norm


@contextlib.contextmanager
def lm_head_on_last(model, n: int):
    """The GPTModel's output layer applied to the decoder's last n positions only (its input is (L, b, H))."""
    hook = model.output_layer.register_forward_pre_hook(lambda module, args: (args[0][-n:], *args[1:]))
    try:
        yield
    finally:
        hook.remove()


def seed_model_parallel_rng(seed: int) -> None:
    """Seed Megatron's RNG tracker (its "model-parallel-rng" state, which attention's `fork()` asks for on CUDA; unseeded,
    the first forward pass raises). Megatron's rule: the default generator gets `seed` in every process, the
    tensor-parallel one seed + 2718 + tp rank. Without CUDA the shims make the tracker a no-op (rlkit/megatron_shims.py)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# -- the worker ------------------------------------------------------------------------------------
class MegatronActorRolloutRefWorker(ActorRolloutRefWorker):
    """ActorRolloutRefWorker on a Megatron tensor-parallel engine; one per process of a T x D Ray group."""

    engine_class = MegatronEngine

    def __init__(
        self,
        model_cfg,
        actor_cfg,
        rollout_cfg,
        data_cfg,
        device: str = "auto",
        seed: int = 0,
        need_ref: bool | None = None,
        tp_size: int = 1,
        system=None,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ):
        require_megatron()
        from megatron.core import parallel_state as ps

        from rlkit import megatron_shims
        from rlkit.engine import resolve_device, set_threads
        from rlkit.fsdp_workers import init_process_group

        if (system or System()).rollout.name != "hf":
            raise ConfigError("--trainer.engine megatron generates with --rollout.name hf only (vLLM weight sync is not wired yet)")
        if world_size % tp_size:
            raise ConfigError(f"--trainer.tp-size {tp_size} must divide --trainer.n-workers {world_size}")
        set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dev = resolve_device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", 0)
        init_process_group(rank, world_size, master_addr, master_port, dev)
        megatron_shims.apply()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size)
        seed_model_parallel_rng(seed)
        self.rank, self.world_size = rank, world_size
        super().__init__(model_cfg, actor_cfg, rollout_cfg, data_cfg, device=str(dev), seed=seed, need_ref=need_ref, system=system)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self._synced = 0  # the update count the HF rollout copy holds

    def _same_rows_in_tp_group(self, batch: DataProto, fn) -> DataProto:
        """dispatch('split') gives each process its own rows; a tensor-parallel group must run one batch together:
        gather the group's rows, run fn on all of them, return this rank's."""
        group = self.engine.tp_group
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, batch, group=group)
        out = fn(DataProto.concat(parts))
        start = sum(len(p) for p in parts[: dist.get_rank(group)])
        return out.index(list(range(start, start + len(batch))))

    @dispatch("split")
    def generate(self, prompts: DataProto, validate: bool = False) -> DataProto:
        if self._synced != self.updates:  # a collective: every rank generates on every call
            self.engine.hf_model.load_state_dict(gather_hf_state(self.engine.model, self.engine.hf_config))
            self._synced = self.updates
        torch.manual_seed(self.seed * 7919 + self.rank * 104729 + self.updates)  # different samples per process
        return super().generate(prompts, validate)

    @dispatch("all")
    def set_agent(self, agent) -> None:
        super().set_agent(agent)

    @dispatch("split")
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        return self._same_rows_in_tp_group(batch, super().compute_log_prob)

    @dispatch("split")
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return self._same_rows_in_tp_group(batch, super().compute_ref_log_prob)

    @dispatch("all")
    def update(self, batch: DataProto, loss_fn) -> dict:
        """Every process gets the whole batch; a tensor-parallel group takes its data-parallel share of each mini-batch."""
        n = rows_per_mini_batch(self.actor_cfg, self.rollout_cfg)
        share = n // self.dp_size
        rows = [i for s in range(0, len(batch), n) for i in range(s + self.dp_rank * share, s + (self.dp_rank + 1) * share)]
        metrics = super().update(batch.index(rows), loss_fn)
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: v / self.world_size for k, v in zip(keys, t.tolist())}

    @dispatch("all")
    def num_params(self) -> tuple[int, int]:
        return super().num_params()

    def _local_state(self) -> dict:
        e = self.engine
        return {
            "model": local_params(e.model),
            "optimizer": e.optimizer.state_dict(),
            "scheduler": e.scheduler.state_dict(),
            "updates": self.updates,
        }

    @dispatch("all")
    def state_dict(self) -> dict:
        """This process's shards, optimizer, scheduler and counter (a group returns its processes' states)."""
        return self._local_state()

    @dispatch("all")
    def load_state_dict(self, state: dict) -> None:
        """Back to a state from `state_dict()` of the same process (same tensor-parallel rank)."""
        e = self.engine
        with torch.no_grad():
            for k, p in local_params(e.model).items():
                p.copy_(state["model"][k])
        e.optimizer.load_state_dict(state["optimizer"])
        e.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]
        self._synced = -1  # the rollout copy is refreshed before the next generate

    @dispatch("all")
    def save_checkpoint(self, folder) -> None:
        """Each process writes its shards, optimizer and scheduler state to folder/rank{r}.pt."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = self._local_state()
        state["model"] = {k: v.detach().cpu() for k, v in state["model"].items()}
        torch.save({**state, "world_size": self.world_size, "tp_size": self.engine.tp}, folder / f"rank{self.rank}.pt")
        dist.barrier()

    @dispatch("all")
    def load_checkpoint(self, folder) -> None:
        file = Path(folder) / f"rank{self.rank}.pt"
        if not file.is_file():
            raise MissingFile(f"{file} is missing: resume a Megatron checkpoint with the same --trainer.engine, tp-size and n-workers")
        from rlkit.checkpoint import load_file

        state = load_file(file)  # weights_only: a shared checkpoint cannot run code (a pickled object is refused in one line)
        if (state["world_size"], state["tp_size"]) != (self.world_size, self.engine.tp):
            raise ConfigError(
                f"{folder} was saved with --trainer.n-workers {state['world_size']} --trainer.tp-size {state['tp_size']}: resume with the same"
            )
        self.load_state_dict(state)

    @dispatch("all")
    def save_pretrained(self, path) -> None:
        """A plain Hugging Face folder: every rank gathers the full weights, rank 0 writes them."""
        self.engine.hf_model.load_state_dict(gather_hf_state(self.engine.model, self.engine.hf_config))
        if self.rank == 0:
            self.engine.hf_model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        dist.barrier()
