"""SFT: supervised fine-tuning on chat conversations, one file, on the engine of the RL recipes.

Minimise the mean negative log-likelihood of the assistant's tokens (user/tool turns: context):

    L = -(1 / N) * sum_{rows} sum_t m_t * log pi(y_t | x, y_<t),     N = sum m_t over the mini-batch

m_t = 1 on tokens the assistant wrote (every assistant turn of a conversation), 0 elsewhere.
The mask and the ids: each turn tokenized as generation sees it, turn by turn (assistant_mask).

Run it:

    python recipes/sft.py                  # embedded model, SFT on the arithmetic traces
    python recipes/sft.py --help           # every option, documented
    python recipes/sft.py --model Qwen/Qwen2.5-0.5B-Instruct --model.lora-rank 16 \\
        --data.train-files sft/train.parquet --data.val-files sft/test.parquet \\
        --data.prompt-key prompt --response-key response --actor.lr 1e-5

Data (verl's SFT parquet): a prompt column (--data.prompt-key: a string or a list of chat
messages) and a response column (--response-key: a string; a dotted key reads inside a dict
column, e.g. reward_model.ground_truth), or one messages column (--messages-key, verl's
data.multiturn.messages_key).

Batch-size arithmetic, per training step:

    data.train_batch_size conversations      B  = 64      one optimizer step (mini-batch = B)
    each accumulated over micro-batches of   actor.ppo_micro_batch_size rows
                                             (or actor.max_token_len_per_micro_batch tokens)

Validation: val/loss (the same NLL on the validation conversations) and, when the file also
holds RL rows (chat-message prompts, reward_model), held-out accuracy by greedy generation
(val/acc, recipe.Run's validation). The data is read and checked before the model loads.
"""

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlkit import algos, recipe
from rlkit.config import (
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    SFTSystem,
    TrainerConfig,
    TrainerSystem,
    UpdateConfig,
)
from rlkit.data import PromptLoader, build_prompts, read_table
from rlkit.engine import load_tokenizer, pack_weights
from rlkit.errors import ConfigError
from rlkit.placement import build_policy, build_reward
from rlkit.protocol import DataProto
from rlkit.tools import tools_from_names
from rlkit.workers import resolved


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(train_batch_size=64))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=1))
    actor: UpdateConfig = field(  # the optimiser and update loop, no policy loss (rlkit/config.py)
        default_factory=lambda: UpdateConfig(lr=1e-3, warmup_steps=100, ppo_mini_batch_size=64)
    )
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(total_training_steps=300))
    response_key: str = "reward_model.ground_truth"
    """the response column (verl data.response_key); a dotted key reads a field of a dict column"""
    messages_key: str = ""
    """a column of whole conversations (verl data.multiturn.messages_key); overrides the others"""
    init_from_scratch: bool = False
    """re-initialise the model's weights (seeded) before training: SFT from a fresh model"""
    rl_rows = (
        False  # not a flag: recipe.setup skips the RL prompt-row checks (main checks its data)
    )
    tools: str = ""
    """built-in tools for the chat template (as grpo_tools.py's --agent.tools), e.g. calculator"""
    system: SFTSystem = field(
        default_factory=lambda: SFTSystem(trainer=TrainerSystem(test_freq=100))
    )
    """how and where the run executes (dtypes, batching, validation, output, Ray)"""


def column(table, key: str, flag: str, where: str) -> list:
    """A parquet column by name, or a dict column's field by dotted name ('reward_model.x')."""
    head, *rest = key.split(".")
    if head not in table.column_names:
        raise ConfigError(
            f"{where}: no column {head!r} (columns: {table.column_names}); set {flag}"
        )
    values = table.column(head).to_pylist()
    for k in rest:
        bad = next((i for i, v in enumerate(values) if not isinstance(v, dict) or k not in v), None)
        if bad is not None:
            raise ConfigError(
                f"{where} row {bad}: no field {key!r} ({values[bad]!r:.60}); set {flag}"
            )
        values = [v[k] for v in values]
    return values


def conversations(files: list[str], cfg: Config, flag: str) -> list[list[dict]]:
    """Each row as a list of chat messages ending with the assistant's answer(s)."""
    where = f"{flag} {', '.join(files)}"
    table = read_table(files, flag)
    if cfg.messages_key:
        convs = column(table, cfg.messages_key, "--messages-key", where)
    else:
        convs = []
        prompts = column(table, cfg.system.data.prompt_key, "--data.prompt-key", where)
        for p, r in zip(prompts, column(table, cfg.response_key, "--response-key", where)):
            p = [{"role": "user", "content": p}] if isinstance(p, str) else p
            r = str(r) if isinstance(r, (int, float)) else r  # a number column: its text
            convs.append(p + [{"role": "assistant", "content": r}] if isinstance(p, list) else p)
    for i, conv in enumerate(convs):  # every row a list of {role, content: str} messages
        if not (isinstance(conv, list) and conv and all(map(is_message, conv))):
            raise ConfigError(
                f"{where} row {i}: not a list of chat messages with string content ({conv!r:.80}); "
                "store lists of {role, content} (a JSON string: json.loads it first), no nulls"
            )
    return [list(c) for c in convs]


def has_rl_rows(file: str, prompt_key: str) -> bool:
    """Whether a file also holds RL rows (chat prompts + reward_model): held-out accuracy."""
    schema = pq.read_schema(file)
    prompts = schema.field(prompt_key).type if prompt_key in schema.names else None
    return "reward_model" in schema.names and prompts is not None and pa.types.is_list(prompts)


def is_message(m) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    )


def assistant_mask(tok, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """Token ids of the conversation, turn by turn as the turn loop sees it, and a 0/1 mask of the
    assistant's tokens.

    Before assistant turn i the model reads render(messages[:i], generation prompt): its text not
    yet tokenized (the prompt; after an earlier turn, the tool results and the next generation
    prompt, as agent.tool_suffix_ids) is tokenized alone, then the turn's text is tokenized alone,
    as the model sampled it: [len(render(messages[:i], gen)), len(render(messages[:i+1]))), cut
    after its last end-of-turn token (eos; text a template adds after it, ChatML's "\n", is not
    sampled). Tokenizing the whole text at once would let BPE merge the generation prompt's last
    "\n" with a response that starts with whitespace: a token the model never reads there.
    Exact for any template that renders a conversation's prefixes as prefixes of it (checked)."""

    def render(msgs, gen=False):
        return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    ids, mask, done = [], [], ""  # done: the text tokenized so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (start.startswith(done) and end.startswith(start)):
            raise ConfigError(
                "the chat template renders a conversation's prefixes differently: no assistant mask"
            )
        stop = end.rfind(tok.eos_token, len(start)) if tok.eos_token else -1
        stop = stop + len(tok.eos_token) if stop >= 0 else len(end)
        context, turn = enc(start[len(done) :]), enc(end[len(start) : stop])
        ids, mask, done = (
            ids + context + turn,
            mask + [0] * len(context) + [1] * len(turn),
            end[:stop],
        )
    return ids, mask


class Examples:
    """Tokenized conversations cut at the first assistant token: prompt | response (+ its mask)."""

    def __init__(self, convs: list[list[dict]], tok, cfg: DataConfig, tools=None):
        self.rows = []
        for i, conv in enumerate(convs):
            ids, mask = assistant_mask(tok, conv, tools)
            if 1 not in mask:
                raise ConfigError(f"SFT row {i} has no assistant tokens to train on")
            # the response ends at the last trained token: text after the last eos is never sampled
            cut, end = mask.index(1), len(mask) - mask[::-1].index(1)
            ids, mask = ids[:end], mask[:end]
            if cut > cfg.max_prompt_length or len(ids) - cut > cfg.max_response_length:
                raise ConfigError(
                    f"SFT row {i}: {cut} prompt / {len(ids) - cut} response tokens exceed "
                    f"--data.max-prompt-length {cfg.max_prompt_length} / "
                    f"--data.max-response-length {cfg.max_response_length}; raise them"
                )
            self.rows.append((ids[:cut], ids[cut:], mask[cut:]))

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, rows, pad_id: int) -> DataProto:
        """Prompts left-padded, responses right-padded: the layout the engine's forward reads."""
        rows = [self.rows[i] for i in rows]
        P, R = max(len(p) for p, _, _ in rows), max(len(r) for _, r, _ in rows)
        prompts = torch.full((len(rows), P), pad_id)
        responses = torch.full((len(rows), R), pad_id)
        attn = torch.zeros((len(rows), P + R), dtype=torch.long)
        resp_mask = torch.zeros((len(rows), R), dtype=torch.long)
        for j, (p, r, m) in enumerate(rows):
            prompts[j, P - len(p) :], responses[j, : len(r)] = torch.tensor(p), torch.tensor(r)
            attn[j, P - len(p) : P + len(r)] = 1
            resp_mask[j, : len(r)] = torch.tensor(m)
        return DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], 1),  # (b, P+R)
                "attention_mask": attn,
                "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                "response_mask": resp_mask,  # (b, R): 1 on the assistant's tokens
            }
        )


# ALGO LOGIC: the loss on a micro-batch: token-mean NLL over the mini-batch's assistant tokens
def sft_loss(mb, log_prob, entropy, norm):  # log_prob: (b, R); norm: the mini-batch's token count
    nll = algos.agg_loss(-log_prob, mb["response_mask"], "token-mean", norm=norm)
    return nll, {"nll": nll}, {}


def val_loss(policy, examples: Examples, batch_size: int) -> float:
    """The mean NLL per assistant token over the validation conversations (no gradients)."""
    total, count = 0.0, 0
    for s in range(0, len(examples), batch_size):
        b = examples.batch(
            range(s, min(s + batch_size, len(examples))), policy.tokenizer.pad_token_id
        )
        lp = policy.compute_log_prob(b)["old_log_probs"]
        total += float(-(lp * b["response_mask"]).sum())
        count += int(b["response_mask"].sum())
    return total / count


def fresh_weights(policy, cfg: Config) -> None:
    """--init-from-scratch: the config's own init (seeded), in every worker and in vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(cfg.trainer.seed)
    remote = cfg.model.trust_remote_code
    config = AutoConfig.from_pretrained(resolved(cfg.model).path, trust_remote_code=remote)
    fresh = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    policy.load_weights(*pack_weights(fresh.named_parameters()))  # every worker (local or Ray)


def main(cfg: Config) -> dict:
    # TRY NOT TO MODIFY: setup -- threads, seed, data, model, validation, logging, resume
    recipe.setup(cfg)  # threads, seed, batch-size and flag checks (SFT's data: checked below)
    v = cfg.system.data  # the validation files, the prompt column
    if v.task:  # (its generated rows are prompts to sample, not conversations to imitate)
        raise ConfigError(f"--data.task {v.task}: SFT trains on --data.train-files conversations")
    if cfg.rollout.temperature != 1.0:  # the engine divides the logits by it
        raise ConfigError("SFT trains log pi at temperature 1: use --rollout.temperature 1")
    if cfg.actor.ppo_mini_batch_size != cfg.data.train_batch_size or cfg.actor.ppo_epochs != 1:
        raise ConfigError(
            "SFT takes one optimizer step per batch: --actor.ppo-mini-batch-size = train size, "
            "--actor.ppo-epochs 1"
        )
    # the conversations read and tokenized before the model loads: a bad row stops in seconds
    tok = load_tokenizer(resolved(cfg.model).path, cfg.model.trust_remote_code)
    schemas = (
        tools_from_names(cfg.tools, flag="--tools").schemas if cfg.tools else None
    )  # rendered by the template
    convs = conversations(cfg.data.train_files, cfg, "--data.train-files")
    train_set = Examples(convs, tok, cfg.data, schemas)
    val_files = v.val_files
    val_set = None
    if val_files:
        convs = conversations(val_files, cfg, "--data.val-files")
        val_set = Examples(convs, tok, cfg.data, schemas)
    graded = val_files and has_rl_rows(val_files[0], v.prompt_key)
    val = build_prompts(val_files, tok, cfg.data, v, v.val_max_samples) if graded else None

    policy = build_policy(cfg, need_ref=False)
    if cfg.init_from_scratch:  # a fresh model: the embedded warm start reproduced from nothing
        fresh_weights(policy, cfg)
    train = PromptLoader(
        train_set, cfg.data.train_batch_size, tok.pad_token_id, cfg.data.shuffle, cfg.trainer.seed
    )
    reward_fn = build_reward(cfg, policy) if graded else None
    run = recipe.Run(cfg, policy, train, val, reward_fn)
    t = cfg.system.trainer

    for step in run.steps():
        timings = {}
        with recipe.timer("step", timings):
            batch = train.next_batch()  # B conversations: prompts | responses, response_mask (B, R)
            with recipe.timer("update", timings):  # ALGO LOGIC: the loss of sft_loss, one step
                metrics = policy.update(batch, sft_loss)
        if val_set is not None and (
            t.test_freq > 0 and step % t.test_freq == 0 or step == run.total_steps
        ):
            metrics["val/loss"] = val_loss(policy, val_set, v.val_batch_size)

        # TRY NOT TO MODIFY: metrics, validation, checkpoints
        run.end_of_step(step, metrics, timings, batch)
    return run.finish()


if __name__ == "__main__":
    recipe.cli(main, Config)
