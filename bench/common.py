"""What the benchmarks share: the rlkit GRPO step (the recipe's own loop body), a random-weight model,
thread and timing helpers. Not a public API; see bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def set_threads(n: int) -> None:
    """Pin torch (and the BLAS/OpenMP pools it starts) to n threads, before torch does any work."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)  # rlkit and these scripts run no inter-op parallel work
    except RuntimeError:  # already set, or torch already ran parallel work
        pass


def load_recipe(name: str):
    """recipes/<name>.py as a module (recipes/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_random_model(out_dir: str | Path, hidden: int = 256, layers: int = 4, seed: int = 0, sampled_eos: bool = False) -> str:
    """A Llama-shaped causal LM with random weights and the embedded model's tokenizer, saved as a Hugging Face
    folder (so both libraries load it with from_pretrained). Its EOS is a token added to the tokenizer past the
    model's vocabulary, so it is never sampled: every response runs to the length cap, and any two libraries
    generate exactly the same number of tokens. sampled_eos: keep the tokenizer's own EOS (in the vocabulary),
    for workloads that write their responses themselves (bench/vs_trl.py --workload gsm8k)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from rlkit import demos

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return str(out_dir)
    base = AutoConfig.from_pretrained(demos.ARITH_MODEL)
    tok = AutoTokenizer.from_pretrained(demos.ARITH_MODEL)
    vocab = len(tok)
    if not sampled_eos:
        tok.add_special_tokens({"eos_token": "<|never-sampled-eos|>"})
    eos = tok.eos_token_id
    assert sampled_eos or eos >= vocab, (eos, vocab)
    torch.manual_seed(seed)
    heads = max(hidden // 64, 2)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=base.pad_token_id,
        eos_token_id=None,
        bos_token_id=None,  # EOS: generation config
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=base.pad_token_id)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def resolve_model(name: str, work_dir: Path, hidden: int, layers: int) -> str:
    """'embedded' -> the embedded tiny model; 'random' -> a random-weight Llama made here; else a path."""
    from rlkit import demos

    if name == "embedded":
        return str(demos.ARITH_MODEL)
    if name == "random":
        return make_random_model(work_dir / f"random-llama-h{hidden}-l{layers}", hidden, layers)  # fresh temp dir per run
    if not Path(name, "config.json").is_file():  # else from_pretrained would try the (unreachable) Hub
        raise SystemExit(f"model {name!r}: not 'embedded', 'random' or a model folder with a config.json")
    return name


@contextmanager
def quiet():
    """Silence transformers' progress bars and info logs while loading."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class RlkitGRPO:
    """rlkit's GRPO, built from the recipe's own pieces (Config, make_actor_loss, build_policy, PromptLoader,
    RewardFn), stepped one training step at a time: `step()` runs what `recipes/grpo.py`'s loop runs inside its
    `timing/step` timer and returns those timings.

    skip_old_log_prob / logits_to_keep / prefix_sharing prototype proposed optimisations without touching rlkit/ (see
    docs/performance.md); all off by default, i.e. this is rlkit as it is. Keep step() in line with the recipe's loop.
    """

    def __init__(
        self,
        model_path: str,
        prompts: int,
        n: int,
        max_new_tokens: int,
        lr: float,
        beta: float,
        threads: int,
        out_dir: Path,
        seed: int = 1,
        micro_batch: int | None = None,
        skip_old_log_prob: bool = False,
        logits_to_keep: bool = False,
        prefix_sharing: bool = False,
        padded: bool = False,
        train_files: list[str] | None = None,
        shared_prompt_attention: str | None = None,
        rollout: str = "hf",
    ):
        from rlkit import recipe
        from rlkit.data import PromptLoader, build_prompts
        from rlkit.placement import build_policy, build_reward

        grpo = load_recipe("grpo")
        self.grpo, self.recipe = grpo, recipe
        cfg = grpo.Config()
        cfg.model.path = model_path
        cfg.data.train_batch_size = prompts
        cfg.data.max_response_length = max_new_tokens
        cfg.system.data.val_files = []
        if train_files:
            cfg.data.train_files = train_files
        cfg.rollout.n = n
        cfg.system.rollout.name = rollout  # hf or vllm (--rollout.name)
        cfg.system.rollout.log_prob_micro_batch_size = micro_batch or prompts * n
        cfg.actor.lr = lr
        cfg.actor.ppo_mini_batch_size = prompts  # one optimizer step per training step (exactly on-policy)
        cfg.system.actor.ppo_micro_batch_size = micro_batch or prompts * n
        cfg.actor.use_kl_loss = beta > 0
        cfg.actor.kl_loss_coef = beta
        if shared_prompt_attention:
            cfg.system.model.shared_prompt_attention = shared_prompt_attention
        cfg.system.model.remove_padding = not padded  # padded: rlkit before issue #15 (padded rows, every prompt n times)
        cfg.system.trainer.num_threads = threads
        cfg.trainer.seed = seed
        cfg.system.trainer.default_local_dir = str(out_dir)
        cfg.system.trainer.logger = []
        self.cfg = cfg
        recipe.setup(cfg)
        with quiet():
            self.policy = build_policy(cfg)
        self.tok = self.policy.tokenizer
        self.train = PromptLoader(
            build_prompts(cfg.data.train_files, self.tok, cfg.data, cfg.system.data), prompts, self.tok.pad_token_id, cfg.data.shuffle, seed
        )
        self.reward_fn = build_reward(cfg, self.policy)
        self.actor_loss = grpo.make_actor_loss(cfg)
        self.skip_old_log_prob = skip_old_log_prob
        if skip_old_log_prob:
            base = self.actor_loss

            def on_policy_loss(mb, log_prob, entropy, norm):  # exactly on-policy: pi_old = pi, detached
                mb["old_log_probs"] = log_prob.detach()
                return base(mb, log_prob, entropy, norm)

            self.actor_loss = on_policy_loss
        if logits_to_keep:
            patch_logits_to_keep(self.policy.worker.engine)
        if padded:
            self.policy.worker.rollout.shared_prefill = lambda ids, mask, *_: None
        if prefix_sharing:
            patch_prefix_sharing(self.policy.worker.engine, self.policy.worker.rollout, n)
        self.steps = 0

    @property
    def model(self):
        return self.policy.worker.engine.model

    def step(self) -> dict:
        """One GRPO training step, the body of recipes/grpo.py's loop. Returns timings (seconds) and token counts."""
        cfg, policy, recipe, algos = self.cfg, self.policy, self.recipe, self.grpo.algos
        self.steps += 1
        step, timings = self.steps, {}
        with recipe.timer("step", timings):
            batch = self.train.next_batch()
            batch["uid"] = [f"{step}-{i}" for i in range(len(batch))]
            batch = batch.repeat(cfg.rollout.n, interleave=True)
            with recipe.timer("gen", timings):
                batch = policy.generate(batch)
            with recipe.timer("reward", timings):
                scores, _ = recipe.score(batch, self.tok, self.reward_fn)
            with recipe.timer("ref", timings):
                if cfg.actor.use_kl_loss:
                    batch = batch.union(policy.compute_ref_log_prob(batch))
            with recipe.timer("old_log_prob", timings):
                if not (self.skip_old_log_prob or self.policy.update_is_one_step()):  # as recipes/grpo.py
                    batch = batch.union(policy.compute_log_prob(batch))
            advantages = algos.grpo_advantage(scores, batch["uid"], norm_by_std=cfg.norm_adv_by_std_in_grpo)
            batch["advantages"] = advantages[:, None] * batch["response_mask"]
            with recipe.timer("update", timings):
                metrics = policy.update(batch, self.actor_loss)
        prompt_len = batch["prompts"].shape[1]
        timings["groups"] = common_groups(batch, prompt_len)  # for the roofline: (P, [R_i]) per group
        timings["ran_old_log_prob"] = not (self.skip_old_log_prob or self.policy.update_is_one_step())
        timings["gen_tokens"] = int(batch["response_mask"].sum())
        timings["gen_width"] = int(batch["responses"].shape[1])
        timings["prompt_tokens"] = int(batch["attention_mask"][:, : batch["prompts"].shape[1]].sum())
        timings["pg_loss"] = metrics.get("actor/pg_loss", float("nan"))
        return timings


def common_groups(batch, prompt_len: int) -> list[tuple[int, list[int]]]:
    """A rollout batch's groups [(prompt tokens, [response tokens])], from its attention mask and uids."""
    mask = batch["attention_mask"]
    return groups_of(mask[:, :prompt_len].sum(-1).tolist(), mask[:, prompt_len:].sum(-1).tolist(), list(batch["uid"]))


def patch_logits_to_keep(engine) -> None:
    """Prototype: project only the response positions through the LM head (HF `logits_to_keep`), instead of
    computing logits for every prompt position and slicing them away. Same log-probs, less work and memory
    (vocab x prompt length per row); matters for real vocabularies (150k), barely for the embedded one (275)."""
    import torch

    from rlkit import algos
    from rlkit.engine import trim_padding

    def forward(model, mb, temperature, with_entropy):
        prompt_len, resp_len = mb["prompts"].shape[1], mb["responses"].shape[1]
        t, first, keep = trim_padding({k: mb[k].to(engine.device) for k in ("input_ids", "attention_mask", "position_ids")}, prompt_len)
        logits = (
            model(
                input_ids=t["input_ids"],
                attention_mask=t["attention_mask"],
                position_ids=t["position_ids"],
                use_cache=False,
                logits_to_keep=keep + 1,
            )
            .logits[:, :-1]
            .float()
            / temperature
        )
        labels = mb["responses"][:, :keep].to(engine.device)
        logp = torch.zeros(len(mb), resp_len, device=engine.device)
        logp[:, :keep] = algos.logprobs_from_logits(logits, labels)
        ent = None
        if with_entropy:
            ent = torch.zeros(len(mb), resp_len, device=engine.device)
            ent[:, :keep] = algos.entropy_from_logits(logits)
        return logp, ent

    engine.forward = forward


def _groups_share_prompt(prompts, n: int) -> bool:
    """Rows i*n .. i*n+n-1 hold the same prompt (batch.repeat(n, interleave=True))."""
    import torch

    return len(prompts) % n == 0 and bool(torch.equal(prompts.view(-1, n, prompts.shape[1]), prompts[::n, None].expand(-1, n, -1)))


def prefix_shared_logits(model, input_ids, attention_mask, prompt_len: int, n: int, keep_logits: int):
    """Logits predicting the response tokens, with each group's prompt run through the model ONCE.

    GRPO's n samples of a prompt share it: run the B distinct prompts (B = rows / n) with a KV cache, repeat the
    cache n times, then run only the response tokens of all B*n rows against it. The prompt's last position
    predicts response token 0; response position j predicts token j+1. Works with gradients (the cache
    repetition is differentiable), so it serves the update as well as the no-grad passes.
    Returns (rows, keep_logits, vocab).
    """
    import torch

    p_ids, p_mask = input_ids[::n, :prompt_len], attention_mask[::n, :prompt_len]
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, prompt_len : prompt_len + keep_logits - 1]
    first = out.logits[:, -1:].repeat_interleave(n, 0)
    if keep_logits == 1:
        return first
    rest = model(
        input_ids=input_ids[:, prompt_len : prompt_len + keep_logits - 1],
        attention_mask=attention_mask[:, : prompt_len + keep_logits - 1],
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], 1)


def patch_prefix_sharing(engine, rollout, n: int) -> None:
    """Prototype: share each GRPO group's prompt in generation (one prefill per prompt, cache repeated n times)
    and in every log-prob pass (reference, old, update). Falls back to rlkit's own code when a (micro-)batch
    does not hold whole groups."""
    import torch

    from rlkit import algos
    from rlkit.engine import trim_padding
    from rlkit.rollout import NEUTRAL_SAMPLING, assemble

    plain_forward = engine.forward

    def forward(model, mb, temperature, with_entropy):
        if engine.value_head or not _groups_share_prompt(mb["prompts"], n):
            return plain_forward(model, mb, temperature, with_entropy)
        prompt_len, resp_len = mb["prompts"].shape[1], mb["responses"].shape[1]
        t, first, keep = trim_padding({k: mb[k].to(engine.device) for k in ("input_ids", "attention_mask")}, prompt_len)
        logits = prefix_shared_logits(model, t["input_ids"], t["attention_mask"], prompt_len - first, n, keep).float() / temperature
        labels = mb["responses"][:, :keep].to(engine.device)
        logp = torch.zeros(len(mb), resp_len, device=engine.device)
        logp[:, :keep] = algos.logprobs_from_logits(logits, labels)
        ent = None
        if with_entropy:
            ent = torch.zeros(len(mb), resp_len, device=engine.device)
            ent[:, :keep] = algos.entropy_from_logits(logits)
        return logp, ent

    plain_generate = rollout.generate

    @torch.no_grad()
    def generate(prompts, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, micro_batch_size=None):
        if temperature <= 0 or top_p < 1.0 or top_k or not _groups_share_prompt(prompts["input_ids"], n):
            return plain_generate(prompts, max_new_tokens, temperature, top_p, top_k, micro_batch_size)
        model, tok = rollout.model, rollout.tokenizer
        ids, mask = prompts["input_ids"].to(rollout.device), prompts["attention_mask"].to(rollout.device)
        out = model(
            input_ids=ids[::n],
            attention_mask=mask[::n],
            position_ids=(mask[::n].cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        probs = torch.softmax(out.logits[:, -1].float() / temperature, -1).repeat_interleave(n, 0)
        first = torch.multinomial(probs, 1)
        if max_new_tokens > 1:
            seq = model.generate(
                input_ids=torch.cat([ids, first], 1),
                attention_mask=torch.cat([mask, torch.ones_like(first)], 1),
                past_key_values=cache,
                do_sample=True,
                max_new_tokens=max_new_tokens - 1,
                eos_token_id=rollout.eos,
                pad_token_id=tok.pad_token_id,
                temperature=temperature,
                top_p=1.0,
                top_k=None,
                **NEUTRAL_SAMPLING,
            )
            resp = seq[:, ids.shape[1] :].cpu()
        else:
            resp = first.cpu()
        if resp.shape[1] < max_new_tokens:
            resp = torch.cat([resp, torch.full((len(resp), max_new_tokens - resp.shape[1]), tok.pad_token_id, dtype=resp.dtype)], 1)
        return assemble(prompts, resp, rollout.eos, tok.pad_token_id)

    engine.forward = forward
    rollout.generate = generate


# ---------------------------------------------------------------------------
# Roofline: the FLOPs each phase must do, and the machine's matmul ceiling measured in the same run
# ---------------------------------------------------------------------------


def model_dims(config) -> dict:
    """A Llama/Qwen-shaped decoder's sizes from its Hugging Face config: hidden h, layers, query heads x head_dim
    (attention width a), key/value width kv, MLP width (gated: 3 matrices), vocabulary."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return dict(
        h=h,
        layers=config.num_hidden_layers,
        a=heads * head_dim,
        kv=kv_heads * head_dim,
        ff=config.intermediate_size,
        vocab=config.vocab_size,
    )


def linear_shapes(dims: dict) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight of one decoder layer: q, k, v, o, gate, up, down."""
    h, a, kv, ff = dims["h"], dims["a"], dims["kv"], dims["ff"]
    return [(h, a), (h, kv), (h, kv), (a, h), (h, ff), (h, ff), (ff, h)]


def body_params(dims: dict) -> int:
    """N: the matmul weights of the decoder layers (embeddings, norms, biases and the LM head excluded)."""
    return dims["layers"] * sum(i * o for i, o in linear_shapes(dims))


def group_counts(prompt_len: int, responses: list[int]) -> tuple[int, int, int]:
    """(positions, logits read, attention keys) one GRPO group of a prompt and its n responses needs, prompt once:

    positions = P + sum_i (R_i - 1)      the prompt once, each response but its last token (it predicts nothing)
    reads     = 1 + sum_i (R_i - 1)      the prompt's last position (serves every response's first token) + the rest
    keys      = sum_{t<P} (t + 1) + sum_i sum_{j<R_i - 1} (P + j + 1)    causal, each response sees its prompt
    """
    P = prompt_len
    positions = P + sum(max(r - 1, 0) for r in responses)
    reads = (1 if responses else 0) + sum(max(r - 1, 0) for r in responses)
    keys = P * (P + 1) // 2 + sum(m * P + m * (m + 1) // 2 for m in (max(r - 1, 0) for r in responses))
    return positions, reads, keys


def forward_flops(dims: dict, positions: int, reads: int, keys: int) -> int:
    """One forward pass: 2 N per position (the layers' matmuls), 2 h V per logit read (the LM head), and attention's
    own 4 a per (query, key) pair per layer (q.k and the weighted sum of values, 2 a each)."""
    return 2 * body_params(dims) * positions + 2 * dims["h"] * dims["vocab"] * reads + 4 * dims["a"] * dims["layers"] * keys


def phase_flops(config, groups: list[tuple[int, list[int]]], old_log_prob: bool = True) -> dict[str, int]:
    """The FLOPs a GRPO step's phases must do, for groups [(prompt length, [response lengths])], prompts once:

    gen           forward FLOPs of the prompts and the sampled tokens (each fed once; the same arithmetic as
                  scoring them, at a decode step's small matmuls)
    ref, old      one forward pass over the same positions (old: 0 when the update reuses its own log-probs)
    update        3x the forward (forward + backward: 6 N per trained position); AdamW's O(N) is not counted
    """
    dims = model_dims(config)
    fwd = sum(forward_flops(dims, *group_counts(p, rs)) for p, rs in groups)
    return {"gen": fwd, "ref": fwd, "old_log_prob": fwd if old_log_prob else 0, "update": 3 * fwd}


def mean_groups(prompts: int, n: int, prompt_mean: float, response_mean: float) -> list[tuple[int, list[int]]]:
    """A step's groups rebuilt from its logged means (prompt_length/mean, response_length/mean): `prompts` groups of
    a prompt of round(prompt_mean) tokens and n responses of round(response_mean), for benchmarks that read only
    the recipe's metrics. Exact in the linear terms up to rounding; attention's quadratic term is that of the means."""
    return [(round(prompt_mean), [round(response_mean)] * n) for _ in range(prompts)]


def groups_of(prompt_lens: list[int], response_lens: list[int], uids: list) -> list[tuple[int, list[int]]]:
    """Rows -> [(prompt length, [response lengths])] per run of equal uid (GRPO's rows of a group are consecutive)."""
    out, last = [], object()
    for p, r, u in zip(prompt_lens, response_lens, uids):
        if u != last:
            out.append((p, []))
            last = u
        out[-1][1].append(r)
    return out


def matmul_ceiling(config, rows: int, reps: int = 3, head: bool = True) -> float:
    """The machine's matmul throughput (FLOP/s) on this model's shapes, measured now on torch's current threads:
    a (rows, in) @ (in, out) float32 product for each of one layer's weights (and the LM head), the fastest of
    `reps` rounds; FLOPs of the round / its seconds. rows: the positions a pass multiplies at once (a packed
    pass: its positions; a decode step: the rows generating)."""
    import torch

    dims = model_dims(config)
    shapes = linear_shapes(dims) + ([(dims["h"], dims["vocab"])] if head else [])
    g = torch.Generator().manual_seed(0)
    mats = [(torch.randn(rows, i, generator=g), torch.randn(i, o, generator=g)) for i, o in shapes]
    flops = sum(2 * rows * i * o for i, o in shapes)
    best = float("inf")
    with torch.no_grad():
        for x, w in mats:  # warm-up: first-call allocation and kernel selection
            x @ w
        for _ in range(reps):
            t = now()
            for x, w in mats:
                x @ w
            best = min(best, now() - t)
    return flops / best


class Ceiling:
    """matmul_ceiling sampled between the timed steps, so that it runs under the same load as they do (a shared
    machine's throughput moves by 2x within minutes): sample(groups) after each step, at the decode step's rows
    (generation) and at the pass's positions (at most 2048, the others); rates() the medians. decode_rows 0: no
    generation is timed, only the passes' ceiling is sampled; passes False: only generation's."""

    def __init__(self, config, decode_rows: int, passes: bool = True):
        self.config, self.decode_rows, self.pass_rows, self.with_passes = config, decode_rows, None, passes
        self.gen, self.passes = [], []

    def sample(self, groups) -> None:
        if self.pass_rows is None:
            self.pass_rows = max(1, min(sum(group_counts(p, rs)[0] for p, rs in groups), 2048))
        if self.decode_rows:
            self.gen.append(matmul_ceiling(self.config, self.decode_rows, reps=2))
        if self.with_passes:
            self.passes.append(matmul_ceiling(self.config, self.pass_rows, reps=2))

    def rates(self) -> dict[str, float]:
        g, p = median(self.gen), median(self.passes)
        return {"gen": g, "ref": p, "old_log_prob": p, "update": p}

    def describe(self) -> str:
        r, parts = self.rates(), []
        if self.gen:
            parts.append(f"{r['gen'] / 1e9:.1f} GFLOP/s at {self.decode_rows} rows for generation")
        if self.passes:
            parts.append(f"{r['ref'] / 1e9:.1f} GFLOP/s at {self.pass_rows} rows for the passes")
        return (
            f"float32 matmuls of this model's shapes on {threads()} thread(s), sampled after each step "
            f"(median of {max(len(self.gen), len(self.passes))}): " + ", ".join(parts)
        )


def roofline_table(
    config,
    steps: list[list[tuple[int, list[int]]]],
    sides: dict[str, list[dict]],
    ceiling: Ceiling,
    old_log_prob: bool = True,
    side_steps: dict[str, list] | None = None,
) -> str:
    """The roofline of one workload, one line per (side, phase): the phase's FLOPs (phase_flops: the work the step
    must do, the same for every side), the side's seconds, the achieved GFLOP/s and its % of the matmul ceiling
    (Ceiling, sampled in the same run). steps: each timed step's groups; sides: {side: [{phase: seconds} per step]}
    (a phase absent or at 0 s is skipped); side_steps: {side: its own steps' groups}, for a side that did other
    tokens (one that samples its own). Medians over the steps: FLOPs, seconds, and the rate (of the per-step rates)."""
    ceilings = ceiling.rates()
    flops = [phase_flops(config, g, old_log_prob) for g in steps]
    rows = []
    for side, per_step in sides.items():
        own = [phase_flops(config, g, old_log_prob) for g in side_steps[side]] if side in (side_steps or {}) else flops
        for phase in per_step[0]:
            pairs = [(f[phase], t[phase]) for f, t in zip(own, per_step) if f.get(phase) and t.get(phase)]
            if not pairs:
                continue
            rate = median([f / t for f, t in pairs])
            rows.append(
                [
                    side,
                    phase,
                    f"{median([f for f, _ in pairs]) / 1e9:.3f}",
                    f"{median([t for _, t in pairs]):.3f}",
                    f"{rate / 1e9:.2f}",
                    f"{100 * rate / ceilings[phase]:.0f}%",
                ]
            )
    head = (
        "roofline (FLOPs the step must do: 2N per position, 6N trained, prompts once, LM head on the logits read, attention's "
        f"q.k and values; ceiling: {ceiling.describe()})"
    )
    return head + "\n" + fmt_table(rows, ["side", "phase", "GFLOP", "median s", "GFLOP/s", "% of ceiling"])


def metrics_roofline(
    config, sides: dict[str, list[dict]], n: int, ceiling: Ceiling, phases=("gen", "ref", "old_log_prob", "update")
) -> str:
    """roofline_table for benchmarks that read only the recipe's metrics.jsonl: sides {side: [metric rows of its
    timed steps]}; each step's groups rebuilt by mean_groups (rows = the step's attention-mask tokens
    perf/throughput x timing/step over the mean prompt + response length; rows / n groups). A phase is charged
    only where the step ran it: its timing/* is there, over 1 ms and over 2 % of the step (the recipe's timers also
    wrap passes it skips, and with --trainer.async-steps the reference pass of the generation worker: those read
    microseconds to a few ms; a pass that ran is a forward or more, far over 2 % of a step)."""

    def groups(row):
        p, r = row["prompt_length/mean"], row["response_length/mean"]
        rows = round(row["perf/throughput"] * row["timing/step"] / max(p + r, 1e-9))
        return mean_groups(max(rows // n, 1), n, p, r)

    ran = lambda t, row: t if t > max(1e-3, 0.02 * row["timing/step"]) else 0.0  # noqa: E731
    timed = {side: [{ph: ran(row.get(f"timing/{ph}", 0.0), row) for ph in phases} for row in rs] for side, rs in sides.items()}
    steps = {side: [groups(row) for row in rs] for side, rs in sides.items()}
    first = next(iter(sides))
    return roofline_table(config, steps[first], timed, ceiling, side_steps=steps) + (
        "\n(FLOPs from each step's logged mean prompt and response lengths, common.mean_groups: attention's quadratic term approximate)"
    )


def threads() -> int:
    import torch

    return torch.get_num_threads()


# prototyped optimisations, by name (see docs/performance.md): RlkitGRPO keyword arguments
VARIANTS = {
    "skip_old_lp": dict(skip_old_log_prob=True),
    "logits_to_keep": dict(logits_to_keep=True),
    "prefix": dict(prefix_sharing=True),
    "padded": dict(padded=True),
    "mask": dict(shared_prompt_attention="mask"),  # the dense block mask instead of split attention (issue #25)
    "all": dict(skip_old_log_prob=True, prefix_sharing=True),
}


def arms(variants: str | None) -> dict[str, dict]:
    """{'rlkit': {}} plus 'rlkit+NAME' for each comma-separated name of VARIANTS."""
    out = {"rlkit": {}}
    for name in filter(None, (variants or "").split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        out[f"rlkit+{name}"] = VARIANTS[name]
    return out


def names(p, flag: str, value: str, valid) -> list[str]:
    """The comma-separated names of `value`, or argparse's one-line error naming the unknown ones and the valid ones."""
    out = [v for v in value.split(",") if v]
    unknown = [v for v in out if v not in valid]
    if unknown or not out:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no name given"
        p.error(f"{flag}: {what}; choose from {', '.join(valid)}")
    return out


def ints(value: str) -> list[int]:
    """argparse type: comma-separated integers ('1,2'), each >= 0."""
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated whole numbers, e.g. 1,2") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated whole numbers >= 0, e.g. 1,2")
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def fmt_table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
