"""RM: a Bradley-Terry reward model trained on preference pairs, in one file.

A reward model r(x, y) is the policy's network with a one-output head read at the last token
(AutoModelForSequenceClassification). For each pair -- prompt x, chosen y_c, rejected y_r --
maximise the Bradley-Terry likelihood that the chosen response wins:

    L = mean_pairs [ -log sigmoid(r(x, y_c) - r(x, y_r) - m) + eta * (r(x, y_c) + r(x, y_r))^2 ]

m: the pair's margin (--margin-key, a column; 0 without one). eta: --center-coef (0 = off): the
loss sees only differences, so rewards drift; the squared sum keeps them centred on 0.

Run it:

    python recipes/rm.py                   # embedded model and pairs, 150 steps: ~1.5 min, 2 cores
    python recipes/rm.py --help            # every option, documented
    python recipes/rm.py --model Qwen/Qwen2.5-0.5B-Instruct --model.lora-rank 16 \\
        --data.train-files prefs/train.parquet --data.val-files prefs/test.parquet \\
        --data.max-prompt-length 1024 --data.max-response-length 1024 --actor.lr 1e-5

then train a policy on it (the export is a plain Hugging Face folder, tokenizer included):

    python recipes/grpo.py --reward.model-path outputs/rm/checkpoints/global_step_150/hf

Data (TRL/verl preference parquet): columns prompt (--data.prompt-key: a string or chat
messages), chosen and rejected (--chosen-key, --rejected-key: a string, or chat messages ending
with the assistant's turn; without a prompt column they are whole conversations), and optionally
a margin column (--margin-key). Each response is rendered as the reward model scores it
(rlkit.reward_model.render: the prompt's messages + the response as the assistant turn).

Batch-size arithmetic, per training step:

    data.train_batch_size pairs              B  = 64      one optimizer step
    each accumulated over micro-batches of   actor.ppo_micro_batch_size pairs (2 rows each;
                                             0 = auto: 64 on CPU, 4 on a GPU), each cut to its
                                             longest sequence; float32 weights, compute in
                                             --model.dtype (bf16 on GPU), optional checkpointing

Validation: val/pair_acc (share of held-out pairs with r(x, y_c) > r(x, y_r)) and val/loss.
"""

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rlkit import demos, recipe
from rlkit.config import (
    BaseDataConfig,
    BaseDataSystem,
    ModelConfig,
    OptimConfig,
    RMSystem,
    RunSystem,
    TrainerConfig,
)
from rlkit.data import PromptLoader, read_table
from rlkit.errors import ConfigError, NonFinite
from rlkit.protocol import DataProto
from rlkit.reward_model import render
from rlkit.workers import CheckpointFiles

PAIRS = demos.PREFS_DATA  # the embedded pairs: correct vs the embedded model's wrong answers


@dataclass
class Config:  # sections by use: what this recipe reads (rlkit/config.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: BaseDataConfig = field(
        default_factory=lambda: BaseDataConfig(
            train_files=[str(PAIRS / "train.parquet")],
            train_batch_size=64,
            max_prompt_length=64,
            max_response_length=16,
        )
    )
    actor: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(total_training_steps=150))
    chosen_key: str = "chosen"
    """the column of preferred responses (a string, or chat messages ending with the answer)"""
    rejected_key: str = "rejected"
    """the column of dispreferred responses (same form as the chosen ones)"""
    margin_key: str = ""
    """a column of per-pair margins m (how much chosen must win by); empty = no margin"""
    center_coef: float = 0.0
    """eta of the centring term eta * (r_c + r_r)^2 (TRL's center_rewards_coefficient; 0 = off)"""
    rl_rows = False  # not a flag: recipe.setup skips the RL prompt-row checks (read_pairs checks)
    train_layers: int = 0
    """train only the top N decoder layers and the head, the rest frozen (0 = all; not with LoRA):
    an RM grown from a policy by fresh layers on top keeps what the policy knows"""
    system: RMSystem = field(
        default_factory=lambda: RMSystem(
            data=BaseDataSystem(val_files=[str(PAIRS / "val.parquet")]),
            trainer=RunSystem(test_freq=50),
        )
    )
    """how and where the run executes (dtype, micro-batches, validation, output)"""


# -- the data: preference parquet -> rendered texts -> token ids ----------------------------------
def read_pairs(files: list[str], cfg: Config) -> list[tuple]:
    """Each row as (prompt messages or text, chosen text, rejected text, margin)."""
    files_flag = "--data.val-files" if files is cfg.system.data.val_files else "--data.train-files"
    table = read_table(files, files_flag)
    cols = table.column_names
    for flag, key in (("--chosen-key", cfg.chosen_key), ("--rejected-key", cfg.rejected_key)):
        if key not in cols:
            raise ConfigError(f"{files}: no column {key!r} (columns: {cols}); set {flag}")
    if cfg.margin_key and cfg.margin_key not in cols:
        raise ConfigError(
            f"{files}: no column {cfg.margin_key!r} (columns: {cols}); set --margin-key"
        )
    n = table.num_rows
    key = cfg.system.data.prompt_key
    prompts = table.column(key).to_pylist() if key in cols else [None] * n
    margins = table.column(cfg.margin_key).to_pylist() if cfg.margin_key else [0.0] * n
    out = []
    for i, (p, c, r, m) in enumerate(
        zip(
            prompts,
            *(table.column(k).to_pylist() for k in (cfg.chosen_key, cfg.rejected_key)),
            margins,
        )
    ):
        if c is None or r is None or not isinstance(m, (int, float)) or not math.isfinite(m):
            raise ConfigError(
                f"{files} row {i}: a null chosen/rejected or a margin {m!r} that is not a "
                "finite number; fix the data's --margin-key column"
            )
        (p1, c), (p2, r) = split_turn(p, c, i, files), split_turn(p, r, i, files)
        if p1 != p2:
            raise ConfigError(f"{files} row {i}: chosen and rejected continue different prompts")
        out.append((p1, c, r, float(m)))
    same = sum(c == r for _, c, r, _ in out)  # r_c - r_r = 0 whatever the weights: nothing to learn
    if same == len(out):
        raise ConfigError(f"{files}: chosen = rejected in every pair; nothing to learn")
    if same:
        warnings.warn(
            f"{files}: {same} of {len(out)} pairs have chosen = rejected (no gradient)",
            stacklevel=2,
        )
    return out


def split_turn(prompt, response, row: int, files) -> tuple:
    """(prompt, response text): a string response continues the prompt; a message list's last
    message is the response, the ones before it continue the prompt (no prompt: all of it)."""
    if isinstance(response, str):
        if prompt is None:
            raise ConfigError(
                f"{files}: no prompt column; set --data.prompt-key (or store messages)"
            )
        return prompt, response
    if not response or response[-1].get("role") != "assistant" or isinstance(prompt, str):
        raise ConfigError(
            f"{files} row {row}: chosen/rejected as messages must end with an assistant turn "
            "and follow a message-list prompt"
        )
    return list(prompt or []) + list(response[:-1]), response[-1]["content"]


class Pairs:
    """Tokenized pairs; batch(rows) stacks the chosen rows then the rejected rows, right-padded."""

    def __init__(self, pairs: list[tuple], tok, cfg: BaseDataConfig, max_samples: int = -1):
        pairs = pairs[:max_samples] if max_samples > 0 else pairs
        limit = cfg.max_prompt_length + cfg.max_response_length
        self.ids, self.margins = [], [m for *_, m in pairs]
        for i, (p, c, r, _) in enumerate(pairs):
            enc = tok([render(tok, p, c), render(tok, p, r)], add_special_tokens=False)
            if max(map(len, enc["input_ids"])) > limit:
                raise ConfigError(
                    f"pair {i} renders to {max(map(len, enc['input_ids']))} tokens, over "
                    f"--data.max-prompt-length + --data.max-response-length = {limit}; raise them"
                )
            self.ids.append(enc["input_ids"])

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, rows, pad_id: int) -> DataProto:
        seqs = [self.ids[i][0] for i in rows] + [self.ids[i][1] for i in rows]  # chosen, rejected
        width = max(map(len, seqs))
        input_ids = torch.full((len(seqs), width), pad_id)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, s in enumerate(seqs):
            input_ids[j, : len(s)], attn[j, : len(s)] = torch.tensor(s), 1
        return DataProto.from_dict(
            tensors={
                "input_ids": input_ids,  # (2b, L): rows [0, b) chosen, [b, 2b) rejected
                "attention_mask": attn,
                "margin": torch.tensor([self.margins[i] for i in rows] * 2),  # (2b,)
            }
        )


# -- the model: a sequence classifier with one output, its optimizer, its checkpoint -------------
class RewardTrainer(CheckpointFiles):
    """AutoModelForSequenceClassification (num_labels=1) + AdamW; LoRA with --model.lora-rank."""

    def __init__(self, cfg: Config):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSequenceClassification

        from rlkit import engine
        from rlkit.workers import resolved

        m, a, s = resolved(cfg.model), cfg.actor, cfg.system
        self.device, self.actor_cfg = engine.resolve_device(s.trainer.device), a
        self.dtype = engine.resolve_dtype(s.model.dtype, self.device)  # bf16 on GPU, fp32 on CPU
        self.tokenizer = engine.load_tokenizer(m.path, m.trust_remote_code)
        self.tokenizer.padding_side = "right"  # as rlkit.reward_model.RewardModel reads
        torch.manual_seed(cfg.trainer.seed)  # the fresh head (and LoRA) start the same every run
        model = AutoModelForSequenceClassification.from_pretrained(  # float32 masters (engine.py)
            m.path, num_labels=1, trust_remote_code=m.trust_remote_code, dtype=torch.float32
        )
        model.config.pad_token_id = self.tokenizer.pad_token_id  # the last real token is read
        n = engine.num_params(model)[1]
        self.checkpointing = engine.resolve_gradient_checkpointing(
            s.model.gradient_checkpointing, self.device, n
        )
        if self.checkpointing:  # non-reentrant: gradients reach LoRA adapters behind frozen layers
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if cfg.train_layers:
            freeze_below(model, cfg.train_layers, m.lora_rank)
        self.lora = m.lora_rank > 0
        if self.lora:  # SEQ_CLS: the head ("score") trains in full beside the adapters
            targets = m.target_modules
            model = get_peft_model(
                model,
                LoraConfig(
                    task_type="SEQ_CLS",
                    r=m.lora_rank,
                    lora_alpha=m.lora_alpha,
                    target_modules=targets if targets == "all-linear" else targets.split(","),
                ),
            )
        self.model = model.to(self.device).eval()  # eval: no dropout; gradients still flow
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay)
        warm = max(a.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        auto = 4 if self.device.type == "cuda" else 64  # pairs per forward/backward
        self.micro_batch = s.actor.ppo_micro_batch_size or auto

    def rewards(self, mb: DataProto) -> torch.Tensor:
        """r(x, y) of every row, (2b,): the head's output at the last non-pad token. The rows are
        cut to their longest (right padding) and run in the compute dtype over float32 weights."""
        width = int(mb["attention_mask"].sum(-1).max())
        ids = mb["input_ids"][:, :width].to(self.device)
        attn = mb["attention_mask"][:, :width].to(self.device)
        half = self.dtype != torch.float32
        with torch.autocast(self.device.type, self.dtype) if half else nullcontext():
            return self.model(input_ids=ids, attention_mask=attn).logits[:, 0].float()

    @torch.no_grad()
    def score(self, batch: DataProto) -> torch.Tensor:
        """r of every row, in forwards of 2 x micro-batch rows (validation: no 1,024-row pass)."""
        n = 2 * self.micro_batch
        return torch.cat(
            [self.rewards(batch.index(slice(s, s + n))).cpu() for s in range(0, len(batch), n)]
        )

    def update(self, pairs: DataProto, loss_fn) -> dict:
        """One optimizer step on B pairs, the gradient accumulated over micro-batches of pairs."""
        b = len(pairs) // 2
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        # Hugging Face checkpoints a layer only in training mode: just those modules (no dropout)
        layers = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False)]
        for layer in layers:
            layer.training = True
        for s in range(0, b, self.micro_batch):
            rows = list(range(s, min(s + self.micro_batch, b)))
            mb = pairs.index(rows + [b + i for i in rows])  # its chosen, then its rejected
            loss, metrics = loss_fn(self.rewards(mb), mb["margin"].to(self.device), b)
            if not torch.isfinite(loss):
                raise NonFinite(f"non-finite loss ({loss.item()}) in the update; lower --actor.lr")
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        for layer in layers:
            layer.training = False
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.actor_cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {**sums, "actor/grad_norm": grad_norm.item(), "actor/lr": lr}

    def num_params(self) -> tuple[int, int]:
        from rlkit.engine import num_params

        return num_params(self.model)

    def save_pretrained(self, path) -> None:
        """The export --reward.model-path loads: a plain Hugging Face folder (LoRA merged)."""
        import copy

        model = copy.deepcopy(self.model).merge_and_unload() if self.lora else self.model
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def state_dict(self) -> dict:
        keep = (lambda k: "lora_" in k or "modules_to_save" in k) if self.lora else (lambda k: True)
        return {
            "model": {k: v for k, v in self.model.state_dict().items() if keep(k)},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"], strict=not self.lora)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def freeze_below(model, n: int, lora_rank: int) -> None:
    """requires_grad only for the top n decoder layers and the head (what is not the base model)."""
    layers = getattr(model.base_model, "layers", None)
    if lora_rank > 0 or layers is None or not 0 < n <= len(layers):
        raise ConfigError(
            f"--train-layers {n}: give 1..{len(layers or [])} decoder layers, "
            "without --model.lora-rank"
        )
    train = {id(p) for layer in layers[len(layers) - n :] for p in layer.parameters()}
    prefix = model.base_model_prefix + "."
    for name, p in model.named_parameters():
        p.requires_grad_(id(p) in train or not name.startswith(prefix))


# ALGO LOGIC: the Bradley-Terry loss of a micro-batch, summed over its pairs / B (the step's pairs)
def bt_loss(rewards, margin, num_pairs: int, center_coef: float = 0.0):
    """-log sigmoid(r_c - r_r - m) + eta (r_c + r_r)^2 per pair; rewards (2b,): chosen | rejected"""
    r_c, r_r = rewards.chunk(2)  # (b,), (b,)
    diff = r_c - r_r
    loss = -F.logsigmoid(diff - margin[: len(r_c)])  # (b,)
    if center_coef:
        loss = loss + center_coef * (r_c + r_r) ** 2
    metrics = {
        "rm/loss": loss.sum().item() / num_pairs,
        "rm/acc": (diff > 0).float().sum().item() / num_pairs,  # train pairs ranked right
        "rm/margin": diff.sum().item() / num_pairs,  # mean r_c - r_r
        "rm/chosen": r_c.sum().item() / num_pairs,
        "rm/rejected": r_r.sum().item() / num_pairs,
    }
    return loss.sum() / num_pairs, metrics


@torch.no_grad()
def evaluate(rm: RewardTrainer, pairs: Pairs, batch_size: int, center_coef: float) -> dict:
    """val/pair_acc (share of pairs with r_c > r_r; a tie counts as wrong) and val/loss."""
    n, sums = len(pairs), {}
    for s in range(0, n, batch_size):
        b = pairs.batch(range(s, min(s + batch_size, n)), rm.tokenizer.pad_token_id)
        _, m = bt_loss(rm.score(b), b["margin"], n, center_coef)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    return {"val/pair_acc": sums["rm/acc"], "val/loss": sums["rm/loss"]}


def main(cfg: Config) -> dict:
    # TRY NOT TO MODIFY: setup -- threads, seed, model, data, logging, resume
    recipe.setup(cfg)  # threads, seed, batch-size and flag checks (the pairs: read_pairs below)
    if cfg.center_coef < 0:  # (NaN and inf: recipe.setup's config.check_values, first)
        raise ConfigError(f"--center-coef {cfg.center_coef}: must be a number >= 0 (0 = off)")
    v = cfg.system.data  # the validation pairs, how many, in batches of
    train_pairs = read_pairs(cfg.data.train_files, cfg)  # file errors first
    val_pairs = read_pairs(v.val_files, cfg) if v.val_files else None
    rm = RewardTrainer(cfg)
    tok = rm.tokenizer
    train_set = Pairs(train_pairs, tok, cfg.data)
    train = PromptLoader(
        train_set, cfg.data.train_batch_size, tok.pad_token_id, cfg.data.shuffle, cfg.trainer.seed
    )
    val_set = Pairs(val_pairs, tok, cfg.data, v.val_max_samples) if val_pairs else None

    def validate() -> dict:  # held-out pairs: logged, and remembered for the summary (Run)
        return evaluate(rm, val_set, v.val_batch_size, cfg.center_coef)

    run = recipe.Run(cfg, rm, train, val_set, None, validate=validate, val_metric="val/pair_acc")
    for step in run.steps():
        timings = {}
        with recipe.timer("step", timings):
            batch = train.next_batch()  # B pairs: input_ids (2B, L), chosen rows then rejected
            with recipe.timer("update", timings):  # ALGO LOGIC: the loss of bt_loss, one step

                def loss_fn(rewards, margin, num_pairs):
                    return bt_loss(rewards, margin, num_pairs, cfg.center_coef)

                metrics = rm.update(batch, loss_fn)

        # TRY NOT TO MODIFY: metrics, checkpoints (hf/: the export --reward.model-path loads)
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, Config)
