"""Prompts in, batches out: verl-format parquet -> chat template -> token ids -> left-padded batches.

A verl parquet row has `data_source`, `prompt` (a list of chat messages), `ability`,
`reward_model` ({"style", "ground_truth"}) and `extra_info`. Files are read unchanged (read_table, then
`datasets`); the tokenizer's chat template turns messages into text; prompts are left-padded so that
every generated token is appended at the same position.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlkit.config import DataSystem
from rlkit.errors import ConfigError, MissingFile
from rlkit.protocol import DataProto

REQUIRED_COLUMNS = ("data_source", "reward_model")


def read_table(files: list[str], flag: str):
    """Parquet file(s) as one pyarrow Table, after the checks every reader of the user's data makes, each message
    naming the flag the files came from: a file that does not exist (MissingFile), one that is not parquet, files
    whose columns differ, and no rows at all (ConfigError)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise MissingFile(f"{flag}: no such file {', '.join(missing)}")
    tables = []
    for f in files:
        try:
            tables.append(pq.ParquetFile(f).read())  # (pq.read_table's errors start with the path)
        except (pa.ArrowInvalid, OSError) as e:
            raise ConfigError(
                f"{flag} {f}: not a parquet file ({str(e).splitlines()[0][:100]}); rlkit reads parquet "
                "(see scripts/ for converters, or datasets.Dataset.to_parquet)"
            ) from e
    where = f"{flag} {', '.join(map(str, files))}"
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise ConfigError(f"{where}: the files' columns differ ({str(e).splitlines()[0][:100]}); give them one schema") from e
    if table.num_rows == 0:
        raise ConfigError(f"{where}: no rows; pass a file with at least one row")
    return table


def load_parquet(files: list[str], prompt_key: str = "prompt", flag: str = "--data.train-files"):
    """Read verl-format parquet file(s) (read_table's checks, under `flag`) as a `datasets` Dataset; check the columns
    rlkit needs."""
    import datasets

    ds = datasets.Dataset(read_table(files, flag))
    for col in (prompt_key, *REQUIRED_COLUMNS):
        if col not in ds.column_names:
            raise ConfigError(
                f"{files}: missing column {col!r}; found {ds.column_names}. rlkit reads verl-format parquet: "
                "data_source (str), prompt (list of {role, content}), ability, reward_model ({style, ground_truth}), extra_info (dict)"
                + (". If your prompts are in another column, pass --data.prompt-key NAME" if col == prompt_key else "")
            )
    rm = ds.features["reward_model"]
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise ConfigError(f"{files}: column 'reward_model' must be a struct with a 'ground_truth' field, got {rm}")
    return ds


def check_rows(cols: dict, files, prompt_key: str = "prompt") -> None:
    """Each row has a ground truth and its prompt is a list of chat messages (or, in every row, a string)."""
    where = ", ".join(map(str, files)) if isinstance(files, (list, tuple)) else str(files)
    null = [i for i, rm in enumerate(cols["reward_model"]) if rm is None or rm.get("ground_truth") is None]
    if null:
        more = f" and {len(null) - 10} more" if len(null) > 10 else ""
        raise ConfigError(
            f"{where}: reward_model.ground_truth is null in row(s) {', '.join(map(str, null[:10]))}{more}; "
            "fill them in or drop those rows (a null would be compared with the string 'None')"
        )
    kinds = {type(p).__name__ for p in cols[prompt_key]}
    if len(kinds) > 1 or not kinds <= {"list", "str"}:
        bad = next(i for i, p in enumerate(cols[prompt_key]) if not isinstance(p, list))
        raise ConfigError(
            f"{where}: column {prompt_key!r} mixes {' and '.join(sorted(kinds))} values (row {bad}: {str(cols[prompt_key][bad])[:60]!r}); "
            'every prompt must be a list of chat messages [{"role": "user", "content": ...}]'
        )


def check_files(cfg, system) -> None:
    """Read the train and val files (cfg: a DataConfig, system: its DataSystem) and check their rows, before any model loads."""
    if system.task:
        return
    key = system.prompt_key
    for files, flag in ((cfg.train_files, "--data.train-files"), (system.val_files, "--data.val-files")):
        if files:
            ds = load_parquet(files, key, flag)
            check_rows(ds.select_columns([key, "reward_model"]).to_dict(), files, key)


def model_context(path: str) -> int | None:
    """The model's context length (max_position_embeddings) from its config, or None if unknown."""
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(path)
    except Exception:
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def render_prompts(tokenizer, prompts: list, tools: list | None = None) -> list[str]:
    """Chat messages -> text with the tokenizer's chat template (plain strings pass through).

    tools: JSON schemas of tools to offer (rlkit.tools.render_prompt: the template's own tool format, or a system message)."""
    if all(isinstance(p, str) for p in prompts):
        return list(prompts)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer ({tokenizer.name_or_path}) has no chat template, but the prompts are chat messages. "
            "Use an instruct/chat model, set tokenizer.chat_template in its tokenizer_config.json, or store plain-string prompts"
        )
    if tools:
        from rlkit.tools import render_prompt

        return [render_prompt(tokenizer, list(p), tools) for p in prompts]
    return [tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in prompts]


def truncate(ids: list[int], max_len: int, mode: str, row: int, where: str = "") -> list[int]:
    """Fit one prompt's token ids into max_len: keep its end (left), start (right) or both ends (middle)."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    raise ConfigError(
        f"prompt in row {row}{' of ' + where if where else ''} has {len(ids)} tokens, over --data.max-prompt-length {max_len}. Fix: raise "
        f"--data.max-prompt-length to at least {len(ids)}, drop such rows with --data.filter-overlong-prompts, "
        "or cut them with --data.truncation left|right|middle"
    )


@dataclass
class PromptSet:
    """Tokenized prompts plus the per-row fields rewards need."""

    input_ids: list[list[int]]
    data_source: np.ndarray
    ground_truth: np.ndarray
    extra_info: np.ndarray
    raw_prompt: np.ndarray
    multi_modal_inputs: np.ndarray | None = None  # images: per row {"pixel_values", "image_grid_thw"} (rlkit/vlm.py)

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, rows, pad_id: int) -> DataProto:
        """Left-pad the prompts of `rows` into a DataProto (input_ids, attention_mask, position_ids)."""
        ids = [self.input_ids[i] for i in rows]
        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for j, x in enumerate(ids):
            input_ids[j, width - len(x) :] = torch.tensor(x)
            mask[j, width - len(x) :] = 1
        rows = np.asarray(rows)
        non_tensors = {
            "data_source": self.data_source[rows],
            "ground_truth": self.ground_truth[rows],
            "extra_info": self.extra_info[rows],
            "raw_prompt": self.raw_prompt[rows],
            "index": rows,
        }
        if self.multi_modal_inputs is not None:  # the row's own pixels travel with it through repeat/index/split
            non_tensors["multi_modal_inputs"] = self.multi_modal_inputs[rows]
        return DataProto.from_dict(
            tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
            non_tensors=non_tensors,
        )


def _objects(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def task_columns(cfg, split: str) -> dict[str, list]:
    """The columns of a generated task (cfg: a DataSystem; cfg.task, e.g. reasoning_gym:chain_sum) for split 'train' or 'val'."""
    from rlkit import tasks
    from rlkit.demos import TASKS  # the generated tasks of the shipped demos

    if cfg.task in TASKS:
        return TASKS[cfg.task](split, cfg.task_train_size, cfg.task_val_size, cfg.task_seed)
    train, val = tasks.train_val_rows(
        cfg.task, cfg.task_train_size, cfg.task_val_size if split == "val" else 0, cfg.task_seed, cfg.task_options, cfg.task_format
    )
    rows = val if split == "val" else train
    if not rows:
        raise ConfigError(
            f"--data.task {cfg.task}: no {split} items (raise --data.task-{split}-size, or use a task with more distinct problems)"
        )
    return tasks.columns(rows)


def build_prompts(
    files: list[str], tokenizer, cfg, system=None, max_samples: int = -1, split: str | None = None, tools: list | None = None
) -> PromptSet:
    """Load parquet (or generate system.task), render + tokenize prompts, apply truncation / overlong filtering.

    cfg: a DataConfig (the lengths); system: its DataSystem (the prompt column, truncation, a generated task; default
    DataSystem()). With
    system.task set the files are ignored; the split is `split`, or 'val' when `files` is system.val_files itself
    (what recipes pass), else 'train'. tools: JSON schemas of tools the prompts offer (see render_prompts).
    """
    s = system or DataSystem()
    if s.task:
        cols = task_columns(s, split or ("val" if files is s.val_files else "train"))
        if max_samples > 0:
            cols = {k: v[:max_samples] for k, v in cols.items()}
        if s.prompt_key != "prompt":
            cols[s.prompt_key] = cols["prompt"]
    else:
        val = split == "val" or (split is None and files is s.val_files)
        ds = load_parquet(files, s.prompt_key, "--data.val-files" if val else "--data.train-files")
        if max_samples > 0:
            ds = ds.select(range(min(max_samples, len(ds))))
        cols = ds.to_dict()  # plain lists, read once (indexing a `datasets` column row by row is very slow)
    for source in set(cols["data_source"]):  # reasoning-gym data (generated or from parquet): its verifier
        if str(source).startswith("reasoning_gym/"):
            from rlkit import tasks

            tasks.register(str(source)[len("reasoning_gym/") :])
    where = s.task or ", ".join(map(str, files))
    check_rows(cols, [where], s.prompt_key)
    prompts = cols[s.prompt_key]
    if isinstance(prompts[0], str) and getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{where}: column {s.prompt_key!r} holds strings ({prompts[0][:40]!r}), but the model is a chat model: store each prompt as "
            '[{"role": "user", "content": "..."}] so that its chat template applies (strings are only for models without one)'
        )
    mm = None
    if "image" in cols and "images" not in cols:
        raise ConfigError(f"{where}: column 'image' is not read; name it 'images' (per row a list of images, verl's format)")
    if "images" in cols:  # verl's multimodal rows: the model's processor renders text and pixels (rlkit/vlm.py)
        from rlkit import vlm

        ids, mm = vlm.render(vlm.load_processor(tokenizer.name_or_path), prompts, cols["images"])
        if not s.filter_overlong_prompts and s.truncation != "error":
            raise ConfigError(
                f"{where}: --data.truncation {s.truncation} would cut image tokens out of prompts with images; "
                "use --data.filter-overlong-prompts or raise --data.max-prompt-length"
            )
    else:
        texts = render_prompts(tokenizer, prompts, tools)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    keep = list(range(len(ids)))
    if s.filter_overlong_prompts:
        keep = [i for i in keep if len(ids[i]) <= cfg.max_prompt_length]
        if not keep:
            raise ConfigError(f"{files}: every prompt is over --data.max-prompt-length {cfg.max_prompt_length}; raise it")
    else:
        ids = [truncate(x, cfg.max_prompt_length, s.truncation, i, where) for i, x in enumerate(ids)]
    context = model_context(tokenizer.name_or_path)
    longest = max(len(ids[i]) for i in keep)
    if context is not None and longest + cfg.max_response_length > context:
        raise ConfigError(
            f"{where}: the longest prompt ({longest} tokens) + --data.max-response-length {cfg.max_response_length} = "
            f"{longest + cfg.max_response_length} tokens, over the model's context of {context} (max_position_embeddings). "
            f"Lower --data.max-prompt-length to {max(context - cfg.max_response_length, 1)} with --data.truncation left or "
            "--data.filter-overlong-prompts, or lower --data.max-response-length"
        )
    extra = cols.get("extra_info", [None] * len(prompts))
    rm = cols["reward_model"]
    return PromptSet(
        input_ids=[ids[i] for i in keep],
        data_source=_objects([cols["data_source"][i] for i in keep]),
        ground_truth=_objects([rm[i]["ground_truth"] for i in keep]),
        extra_info=_objects([extra[i] for i in keep]),
        raw_prompt=_objects([prompts[i] for i in keep]),
        multi_modal_inputs=None if mm is None else mm[keep],
    )


class DifficultySampler:
    """`--data.sampler difficulty`: each prompt's pass rate, remembered from its latest group, weights how often it is drawn.

    After the reward, the recipe's `train.record(batch, scores)` (PromptLoader.record) sets each group's prompt's
    pass rate p to the group's mean score (verifiable scores in [0, 1]). Pools and their weights
    (--data.sampler-weights HARD NORMAL EASY, prime-rl's rule):

        hard    p < 0.25            weight 0.2   its groups are mostly all wrong: little to learn
        normal  0.25 <= p <= 0.75   weight 1.0   mixed groups: the GRPO signal
        easy    p > 0.75            weight 0.2   mostly all right: little to learn
        unseen                      weight 1.0 (as normal)

    A step's B prompts are drawn without replacement with probability proportional to the weights, by a generator
    seeded with (seed, draw number): the pass rates and the draw count are the whole state (state_dict), so a
    resumed run draws what the uninterrupted one would. Metrics (record): sampler/zero_var_share (the step's groups
    whose scores are all equal: they give GRPO no gradient), sampler/hard|normal|easy (shares of the seen prompts
    in each pool), sampler/seen (prompts with a pass rate).
    """

    HARD, EASY = 0.25, 0.75

    def __init__(self, size: int, weights: tuple[float, float, float] = (0.2, 1.0, 0.2), seed: int = 0):
        if len(weights) != 3 or min(weights) < 0 or max(weights) <= 0:
            raise ConfigError(f"--data.sampler-weights {weights}: three weights (hard normal easy), >= 0, one of them > 0")
        self.size, self.weights, self.seed = size, tuple(float(w) for w in weights), seed
        self.pass_rate: dict[int, float] = {}
        self.draws, self.recorded = 0, 0

    def pool(self, p: float) -> int:
        """0 hard, 1 normal, 2 easy."""
        return 0 if p < self.HARD else (2 if p > self.EASY else 1)

    def draw(self, batch_size: int) -> list[int]:
        """The next batch's prompt indices: weighted, without replacement."""
        if self.draws > self.recorded:
            raise ConfigError(
                "--data.sampler difficulty: the previous batch got no scores (no train.record(batch, scores) after it: this "
                "recipe scores no rollouts, e.g. sft.py or rm.py); use --data.sampler uniform"
            )
        w = torch.full((self.size,), self.weights[1], dtype=torch.float64)
        for i, p in self.pass_rate.items():
            w[i] = self.weights[self.pool(p)]
        if int((w > 0).sum()) < batch_size:  # too few prompts keep a weight: top up from the rest, uniformly
            w = w + (w == 0) * 1e-12
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.draws)
        self.draws += 1
        return torch.multinomial(w, batch_size, replacement=False, generator=g).tolist()

    def record(self, index, scores: torch.Tensor) -> dict:
        """Each group's mean score becomes its prompt's pass rate (index: the prompt of each row, rows of a group
        sharing one); returns the sampler/ metrics."""
        groups = group_scores(index, scores)
        for i, g in groups.items():
            self.pass_rate[i] = sum(g) / len(g)
        self.recorded = self.draws
        return {**zero_var_share(groups), **self.pool_shares()}

    def pool_shares(self) -> dict:
        seen = len(self.pass_rate)
        counts = [0, 0, 0]
        for p in self.pass_rate.values():
            counts[self.pool(p)] += 1
        shares = {f"sampler/{name}": c / max(seen, 1) for name, c in zip(("hard", "normal", "easy"), counts)}
        return {**shares, "sampler/seen": seen}

    def state_dict(self) -> dict:
        return {"pass_rate": dict(self.pass_rate), "draws": self.draws, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        pass_rate = {int(k): float(v) for k, v in state["pass_rate"].items()}
        outside = [i for i in pass_rate if not 0 <= i < self.size]
        size = state.get("size", self.size)  # (a checkpoint from before the size was saved: its keys are checked alone)
        if size != self.size or outside:  # the data changed: its indices name other prompts, or none
            saved = f"{size} prompts" if size != self.size else f"a pass rate of prompt {max(outside)}"
            raise ConfigError(
                f"cannot resume --data.sampler difficulty: the checkpoint holds {saved}, the training set has {self.size} "
                "prompts (the data changed since it was saved); resume with the same --data.train-files, or start a new run"
            )
        self.pass_rate = pass_rate
        self.draws = self.recorded = state["draws"]


def group_scores(index, scores: torch.Tensor) -> dict[int, list[float]]:
    """The rows' scores by prompt: index[k] is row k's prompt (the rows of a group share one)."""
    groups: dict[int, list[float]] = {}
    for i, s in zip(np.asarray(index).tolist(), scores.float().tolist()):
        groups.setdefault(int(i), []).append(s)
    return groups


def zero_var_share(groups: dict) -> dict:
    """sampler/zero_var_share: the share of groups (of 2+ samples) whose scores are all equal."""
    multi = [g for g in groups.values() if len(g) > 1]
    return {"sampler/zero_var_share": sum(max(g) == min(g) for g in multi) / len(multi)} if multi else {}


class PromptLoader:
    """Yields batches of `batch_size` prompts, epoch after epoch, in a seeded order; resumable.

    The order of epoch e is a permutation drawn from `seed + e`, so (epoch, position) is all the
    state there is: `state_dict()` / `load_state_dict()` restore it exactly. With a DifficultySampler
    (`use_sampler`) the prompts are drawn by its weights instead; (epoch, position) still count the batches, and
    `record(batch, scores)`, called by the recipe after the reward, feeds the sampler the batch's pass rates.
    """

    def __init__(self, prompts: PromptSet, batch_size: int, pad_id: int, shuffle: bool = True, seed: int = 0):
        if len(prompts) < batch_size:
            raise ConfigError(f"--data.train-batch-size {batch_size} is larger than the dataset ({len(prompts)} prompts); lower it")
        self.prompts, self.batch_size, self.pad_id, self.shuffle, self.seed = prompts, batch_size, pad_id, shuffle, seed
        self.epoch, self.position = 0, 0
        self.sampler: DifficultySampler | None = None
        self.key = f"{os.getpid()}-{id(self)}"  # in the meta of the batches it draws: record() takes only its own

    def use_sampler(self, weights: tuple[float, float, float]) -> None:
        """Draw batches by difficulty (--data.sampler difficulty; recipe.Run calls this before resuming)."""
        self.sampler = DifficultySampler(len(self.prompts), weights, self.seed)

    def __len__(self) -> int:
        """Batches per epoch (the last incomplete batch is dropped)."""
        return len(self.prompts) // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        return torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_batch(self) -> DataProto:
        """The next batch; moves to the next epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        if self.sampler is not None:
            rows = self.sampler.draw(self.batch_size)
        else:
            rows = self._order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        batch = self.prompts.batch(rows, self.pad_id)
        batch.meta["epoch"] = self.epoch
        batch.meta["loader"] = self.key
        return batch

    def record(self, batch: DataProto, scores: torch.Tensor) -> dict:
        """After the reward, a batch this loader drew (rows sharing batch["index"] form a group): with --data.sampler
        difficulty each group's mean score becomes its prompt's pass rate, which weighs the next draws. Returns
        sampler/zero_var_share (and the sampler's pool shares)."""
        if batch.meta.get("loader") != self.key:
            raise ValueError("PromptLoader.record: the batch was drawn by another loader (pass the one it came from)")
        if self.sampler is not None:
            return self.sampler.record(batch["index"], scores)
        return zero_var_share(group_scores(batch["index"], scores))

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "position": self.position}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        if (self.sampler is not None) != ("sampler" in state):
            raise ConfigError("cannot resume: the checkpoint was saved with another --data.sampler; resume with the same one")
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
