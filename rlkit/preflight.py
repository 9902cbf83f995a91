"""Checks that run before any model loads (and before Ray starts): a flag or a data file that cannot work ends the
run in seconds with one line naming it and the fix (rlkit/errors.py), instead of after the model loads.

`run(cfg)` is called by `recipe.preflight` (from `recipe.setup`, the first line of every recipe), after the flag and
file checks there. One short function per check; each takes any recipe's Config and reads only the sections it
needs (`getattr` for the sections some recipes lack: critic, agent). The prompts check loads the tokenizer (never
the model) to tokenize the prompts as the recipe will. docs/errors.md lists every message.
"""

from __future__ import annotations

from rlkit.errors import ConfigError


def run(cfg) -> None:
    """Every check below, cheapest first."""
    check_grad_clip(cfg)
    check_critic(cfg)
    check_agent(cfg)
    check_async(cfg)
    check_moe(cfg)
    check_megatron(cfg)
    check_sequence_parallel(cfg)
    check_prompts(cfg)


def check_grad_clip(cfg) -> None:
    """--actor.grad-clip (and --critic.grad-clip) must be > 0: the update's gradient is scaled to a norm of at most this,
    so 0 zeroes every update and a negative value reverses it (as torch's clip_grad_norm_ and verl do; no special value)."""
    from rlkit.engine import check_grad_clip_value  # lazy: the engine imports torch

    sections = {"actor": cfg.actor, "critic": getattr(cfg, "critic", None)}
    for name, section in sections.items():
        check_grad_clip_value(name, getattr(section, "grad_clip", None))


def check_critic(cfg) -> None:
    """PPO's value model (--critic.path, default --model.path) must not be a vision-language model: transformers has no
    token-classification head for one (engine.load_model refuses it too, for an engine built directly)."""
    c = getattr(cfg, "critic", None)
    if c is None:
        return
    from rlkit.engine import VLM_VALUE_MODEL, is_vlm_folder
    from rlkit.workers import resolved

    path = c.path or resolved(cfg.model).path
    try:
        vlm = is_vlm_folder(path, cfg.model.trust_remote_code)
    except Exception:  # unreadable here: the model load reports it
        return
    if vlm:
        raise ConfigError(VLM_VALUE_MODEL)


def check_agent(cfg) -> None:
    """--agent.* (grpo_tools.py): known tools, at least one turn, no negative limits."""
    a = getattr(cfg, "agent", None)
    if a is None:
        return
    from rlkit.tools import tools_from_names

    tools_from_names(a.tools, max(a.max_tool_response_chars, 1))  # unknown names: one line listing the shipped tools
    from rlkit.envs import EnvFactory

    EnvFactory(getattr(a, "env", "tools"), self_play=getattr(a, "self_play", False))  # --agent.env: tools, guess or path.py:make_env
    if getattr(a, "self_play", False) and hasattr(cfg, "rollout"):
        from rlkit.agent import check_self_play

        check_self_play(cfg.rollout.n)  # --rollout.n: pairs of games, two or more per seat group
    if a.max_turns < 1:
        raise ConfigError(f"--agent.max-turns {a.max_turns}: must be at least 1 (the first turn is the model's answer or its first call)")
    if a.max_tool_calls < 0:
        raise ConfigError(f"--agent.max-tool-calls {a.max_tool_calls}: must be 0 (no tool calls) or more")
    if a.max_tool_response_chars < 1:
        raise ConfigError(f"--agent.max-tool-response-chars {a.max_tool_response_chars}: must be at least 1 (256 is usual)")
    if a.max_observation_chars < 1:
        raise ConfigError(f"--agent.max-observation-chars {a.max_observation_chars}: must be at least 1 (8192 is the default)")
    if not getattr(a, "max_step_seconds", 0) >= 0:  # NaN too
        raise ConfigError(f"--agent.max-step-seconds {a.max_step_seconds}: must be 0 (no limit) or more (120 is the default)")
    c = _model_config(cfg)
    if c is not None:
        from rlkit.vlm import is_vlm

        if is_vlm(c):  # the turn loop's samplers send token ids only: the rollout would not see the images the update sees
            raise ConfigError(
                f"the multi-turn turn loop (--agent.*) does not run on a vision-language model yet ({cfg.model.path}: its "
                "samplers send no images); train it with a single-turn recipe (recipes/grpo.py)"
            )


def check_async(cfg) -> None:
    """--trainer.async-steps k >= 1 with what cannot run beside it (the difficulty sampler, the Megatron engine); the
    flag's own ranges: config.AsyncConfig.check."""
    a, t = getattr(cfg.system, "async_rollout", None), getattr(cfg.system, "scale_out", None)
    if a is None or a.async_steps <= 0:  # (recipes/rm.py: no asynchronous rollout)
        return
    k = a.async_steps
    if getattr(cfg.data, "sampler", "uniform") == "difficulty":  # its weights need each batch's scores before the next draw
        raise ConfigError(
            f"--data.sampler difficulty does not run with --trainer.async-steps {k} (batches are drawn before the last ones "
            "are scored); use --trainer.async-steps 0 or --data.sampler uniform"
        )
    if t.backend == "ray" and t.engine == "megatron":
        raise ConfigError(f"--trainer.async-steps {k} does not run with --trainer.engine megatron yet; use --trainer.engine fsdp")
    if a.queue_groups and t.backend == "ray":
        raise ConfigError(
            f"--trainer.queue-groups {a.queue_groups} does not run with --trainer.backend ray (the queue is the local backend's "
            "worker processes); use --trainer.backend local or --trainer.queue-groups 0"
        )
    c = a.swap_every
    if c:  # in-flight weight updates: rlkit's fast loop in a worker process that can read a second queue mid-generation
        why = (
            "--rollout.name vllm (its engine decodes on its own; the fast HF loop polls)" if cfg.system.rollout.name != "hf"
            else "--rollout.hf-impl generate (only the fast loop polls)" if cfg.system.rollout.hf_impl != "fast"
            else "--trainer.backend ray (an actor runs one call at a time: use the local backend)" if t.backend == "ray"
            else "the multi-turn turn loop (grpo_tools.py generates turn by turn)" if getattr(cfg, "agent", None) is not None
            else None
        )  # fmt: skip
        if why:
            raise ConfigError(f"--trainer.swap-every {c} does not run with {why}; use --trainer.swap-every 0 (k-step) or change that flag")


def check_megatron(cfg) -> None:
    """--trainer.engine megatron: on Ray, megatron-core installed, T = --trainer.tp-size dividing --trainer.n-workers and the
    model's attention and key/value heads, a Llama/Qwen2-shaped model, full fine-tuning, hf rollout: all before Ray starts."""
    t = getattr(cfg.system, "scale_out", None)
    if t is None or t.engine != "megatron":  # (recipes/rm.py: no scale-out)
        return
    if t.backend != "ray":
        raise ConfigError(f"--trainer.engine {t.engine} runs on Ray workers: add --trainer.backend ray --trainer.n-workers N")
    from rlkit.megatron_workers import require_megatron

    require_megatron()
    if t.tp_size < 1 or t.n_workers % t.tp_size:
        raise ConfigError(
            f"--trainer.tp-size {t.tp_size} must divide --trainer.n-workers {t.n_workers} (n-workers = tp-size x data-parallel size)"
        )
    if cfg.system.rollout.name != "hf":
        raise ConfigError("--trainer.engine megatron generates with --rollout.name hf only (vLLM weight sync is not wired yet)")
    if cfg.model.lora_rank > 0:
        raise ConfigError("--trainer.engine megatron trains the full policy only (no LoRA, no critic yet): use the fsdp engine")
    if t.tp_size > 1 and getattr(cfg.actor, "loss_agg_mode", None) == "token-sum":
        raise ConfigError("--actor.loss-agg-mode token-sum is not supported with --trainer.engine megatron --trainer.tp-size > 1 yet")
    c = _model_config(cfg)
    if c is None:  # unreadable here: the workers report it
        return
    if getattr(c, "model_type", None) not in ("llama", "qwen2") or getattr(c, "mlp_bias", False):
        raise ConfigError(
            f"--trainer.engine megatron: model type {getattr(c, 'model_type', None)!r} is not mapped (Llama and Qwen2 are); "
            "use the fsdp engine"
        )
    heads, groups = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if heads % t.tp_size or groups % t.tp_size:
        raise ConfigError(f"--trainer.tp-size {t.tp_size} must divide the attention heads ({heads}) and key/value heads ({groups})")


def check_sequence_parallel(cfg) -> None:
    """--trainer.sp-size S > 1 (Ulysses, rlkit/ulysses.py): the FSDP engine on Ray, S dividing --trainer.n-workers and the
    model's attention heads, the padded layout, sdpa, no gradient checkpointing, no critic, no VLM: all before Ray starts."""
    t = getattr(cfg.system, "scale_out", None)
    s = t.sp_size if t is not None else 1  # (recipes/rm.py: no scale-out)
    if s == 1:
        return
    flag = f"--trainer.sp-size {s}"
    if s < 1:
        raise ConfigError(f"{flag}: must be at least 1 (1 = no sequence parallelism)")
    if t.backend != "ray":
        raise ConfigError(f"{flag} runs on Ray workers: add --trainer.backend ray --trainer.n-workers N (a multiple of {s})")
    if t.engine != "fsdp":
        raise ConfigError(f"{flag} runs with the FSDP engine only (Megatron has its own tensor parallelism): use --trainer.engine fsdp")
    if t.n_workers % s:
        raise ConfigError(f"{flag} must divide --trainer.n-workers {t.n_workers} (n-workers = sp-size x data-parallel size)")
    m = cfg.system.model
    if m.remove_padding:
        raise ConfigError(f"{flag} does not take packed rows yet (a block mask over the gathered sequence): add --model.no-remove-padding")
    if m.attn_implementation not in ("auto", "sdpa"):
        raise ConfigError(f"{flag} runs its own sdpa attention over the gathered sequence: use --model.attn-implementation sdpa")
    if m.gradient_checkpointing == "on":  # the backward's recompute would run plain sdpa on a shard (wrong gradients)
        raise ConfigError(f"{flag} does not run with gradient checkpointing yet: use --model.gradient-checkpointing off (or auto)")
    if getattr(cfg, "critic", None) is not None:
        raise ConfigError(
            f"{flag}: the critic's value head has no sequence-parallel pass yet; use --trainer.sp-size 1 or a critic-free recipe"
        )
    if getattr(cfg.system.actor, "router_replay", "none") != "none":  # forward_sp lays out no routing over the shards
        raise ConfigError(
            f"{flag} does not carry --actor.router-replay {cfg.system.actor.router_replay} yet (the routing is not split over the shards): "
            "use --trainer.sp-size 1 or --actor.router-replay none"
        )
    c = _model_config(cfg)
    if c is None:  # unreadable here: the workers report it
        return
    from rlkit.vlm import is_vlm

    if is_vlm(c):
        raise ConfigError(f"{flag} does not run on a vision-language model (M-RoPE positions, image tokens): use --trainer.sp-size 1")
    heads = getattr(c, "num_attention_heads", None)
    if heads and heads % s:
        raise ConfigError(f"{flag} must divide the model's {heads} attention heads (each worker takes H/S heads): use a divisor of {heads}")


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's expert count: Qwen3-MoE, Mixtral, DeepSeek


def has_experts(config) -> bool:
    """Whether a transformers config (a VLM's text config too) describes a mixture-of-experts model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(c, k, 0) for c in (config, text) for k in EXPERT_KEYS)


def check_moe(cfg) -> None:
    """A mixture-of-experts model (config.json's expert count) with what cannot serve it, and --actor.router-replay on a
    model without experts. The flag-only r3 refusals are config.check_router_replay's."""
    s = cfg.system
    replay = getattr(s.actor, "router_replay", "none")  # (recipes/rm.py, sft.py: no replay)
    t, device = getattr(s, "scale_out", None), s.trainer.device
    megatron = t is not None and t.backend == "ray" and t.engine == "megatron"
    on_cpu = device == "cpu" or (device == "auto" and not (t is not None and t.ray_address) and not _cuda())
    vllm_cpu = getattr(getattr(s, "rollout", None), "name", "hf") == "vllm" and on_cpu
    if replay == "none" and not megatron and not vllm_cpu:
        return
    c = _model_config(cfg)
    if c is None:  # unreadable here: the model load reports it
        return
    moe = has_experts(c)
    if replay != "none" and not moe:
        raise ConfigError(
            f"--actor.router-replay {replay}: {cfg.model.path} has no experts (its config.json names no "
            f"{' / '.join(EXPERT_KEYS)}); router replay is for mixture-of-experts models: drop the flag"
        )
    if moe and megatron:
        raise ConfigError(
            f"--trainer.engine megatron does not map mixture-of-experts models ({getattr(c, 'model_type', None)}); use --trainer.engine fsdp"
        )
    if moe and vllm_cpu:
        # measured (docs/moe.md): vllm-cpu 0.32 serves tiny-moe's first weights exactly, but reloading even the
        # same weights in place leaves its log-probs 4.5 off the trainer's: RL would sample from a broken model
        raise ConfigError(
            "--rollout.name vllm on CPU cannot serve a mixture-of-experts model past the first weight sync "
            "(vllm-cpu's in-place reload corrupts its experts); use --rollout.name hf"
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_config(cfg):
    """The model's transformers config (config.json only, no weights), or None when it cannot be read here."""
    try:
        import transformers

        from rlkit.workers import resolved

        return transformers.AutoConfig.from_pretrained(resolved(cfg.model).path, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:
        return None


def _tokenizer(cfg):
    """The model's tokenizer as the recipe loads it, or None when it cannot be loaded here (the model load then says why)."""
    try:
        from rlkit.engine import load_tokenizer
        from rlkit.workers import resolved

        return load_tokenizer(resolved(cfg.model).path, cfg.model.trust_remote_code)
    except Exception:
        return None


def check_prompts(cfg) -> None:
    """The train and val prompts rendered and tokenized with the model's tokenizer, as the recipe will: string prompts for
    a chat model, a prompt over --data.max-prompt-length (by --data.truncation), prompt + response over the model's
    context; with --agent.tools, the prompts offer the tools and the chat template must append tool messages."""
    from rlkit.data import build_prompts

    if not getattr(cfg, "rl_rows", True):  # sft.py, rm.py: conversations, pairs -- not prompt rows (they check theirs)
        return
    tok = _tokenizer(cfg)
    if tok is None:
        return
    schemas = None
    a = getattr(cfg, "agent", None)
    if a is not None:
        from rlkit.tools import tools_from_names

        schemas = tools_from_names(a.tools, a.max_tool_response_chars).schemas
        from rlkit.workers import resolved

        check_tool_template(tok, resolved(cfg.model).path)  # the local folder: a built-in name is not a hub id
    d, v = cfg.data, cfg.system.data
    if d.train_files or v.task:
        build_prompts(d.train_files, tok, d, v, tools=schemas, split="train")
    if v.val_files:
        build_prompts(v.val_files, tok, d, v, v.val_max_samples, tools=schemas, split="val")


def check_tool_template(tok, model_path: str) -> None:
    """The multi-turn loop appends tool messages after an assistant turn's end token (agent.tool_suffix_ids): the chat
    template must render them by appending, for at least one of the model's end-of-turn tokens."""
    from rlkit.agent import tool_suffix_ids

    ends = [tok.eos_token] if tok.eos_token else []
    try:
        import transformers

        ids = transformers.GenerationConfig.from_pretrained(model_path).eos_token_id
        ends += [tok.convert_ids_to_tokens(i) for i in ([ids] if isinstance(ids, int) else ids or [])]
    except Exception:
        pass
    error = None
    for end in dict.fromkeys(ends):
        try:
            tool_suffix_ids(tok, [{"role": "tool", "name": "calculator", "content": "4"}], end)
            return
        except ConfigError as e:
            error = e
    if error is not None:
        raise error
