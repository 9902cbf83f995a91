"""reasoning-gym tasks as a data source: `--data.task reasoning_gym:NAME`.

reasoning-gym (`pip install reasoning-gym==0.1.25`) generates 100+ verifiable tasks offline
(chain_sum, basic_arithmetic, countdown, gsm_symbolic, ...), each with its own `score_answer`
verifier. rlkit turns a task into rows of the verl parquet format, so the rest of the pipeline
(chat template, tokenization, batches, rewards) is the one parquet data goes through::

    data_source   "reasoning_gym/NAME"              -> scored by `reasoning_gym_score` (registered here)
    prompt        [system?, {"role": "user", "content": question}]
    ability       "reasoning"
    reward_model  {"style": "rule", "ground_truth": answer}
    extra_info    {"split", "index", "task", "options" (JSON), "entry" (JSON), "format"}

Options (DataSystem): `task_options` ("min_terms=2,max_terms=2" or JSON) go to the task's config;
`task_train_size` / `task_val_size` items are generated with seeds `task_seed` and `task_seed + task_train_size`
(reasoning-gym seeds item i with seed + i, so the two never share a generator)
(validation items whose question also occurs in the training set are dropped, so it is held out);
`task_format` picks how the model is asked to answer and how the answer is read back:

    direct   reasoning-gym's "direct" system prompt; the answer is the last <answer>...</answer>
    default  reasoning-gym's "default" system prompt (think step by step, then <answer>...</answer>)
    plain    no system prompt; the whole response (stripped) is the answer
    number   no system prompt; the answer is the last number in the response (numeric tasks; small
             models that ignore the <answer> format, e.g. SmolLM2-135M, still get scored on their answer)

The score is the task's own `score_answer(answer, entry)` (partial credit where the task gives it);
`acc` counts full marks. `scripts/make_reasoning_gym_parquet.py` writes the same rows to parquet.
"""

from __future__ import annotations

import functools
import json
import re

from rlkit.errors import ConfigError, MissingPackage
from rlkit.rewards import register_scorer

PREFIX = "reasoning_gym:"
DATA_SOURCE_PREFIX = "reasoning_gym/"
FORMATS = ("direct", "default", "plain", "number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
PIP = "pip install reasoning-gym==0.1.25"


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingPackage(f"--data.task reasoning_gym:... needs reasoning-gym: {PIP} (or `bash scripts/install.sh gym`)") from e
    return reasoning_gym


def task_name(spec: str) -> str:
    """'reasoning_gym:chain_sum' -> 'chain_sum' (ValueError naming the form otherwise)."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise ConfigError(f"--data.task {spec!r}: expected reasoning_gym:NAME, e.g. reasoning_gym:chain_sum")
    return spec[len(PREFIX) :]


def parse_options(text: str) -> dict:
    """'a=1,b=x' or a JSON object -> dict; values are read as JSON when they parse (numbers, true, lists)."""
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        return json.loads(text)
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--data.task-options {text!r}: expected key=value,key=value or a JSON object")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def _dataset(name: str, size: int, seed: int, options: dict):
    rg = _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ConfigError(f"reasoning-gym has no task {name!r}; some of its tasks: {', '.join(sorted(DATASETS)[:40])}, ...")
    try:
        return rg.create_dataset(name, size=size, seed=seed, **options)
    except TypeError as e:
        fields = sorted(getattr(DATASETS[name][1], "__dataclass_fields__", {}))
        raise ConfigError(
            f"--data.task-options for {name}: {e}; its options are {', '.join(f for f in fields if f not in ('size', 'seed'))}"
        ) from e


def _messages(question: str, fmt: str) -> list[dict]:
    if fmt not in FORMATS:
        raise ConfigError(f"--data.task-format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt in ("plain", "number"):
        return [{"role": "user", "content": question}]
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return [{"role": "system", "content": SYSTEM_PROMPTS[fmt]}, {"role": "user", "content": question}]


def task_rows(
    spec: str,
    size: int,
    seed: int,
    options: dict | str = "",
    fmt: str = "direct",
    split: str = "train",
    exclude_questions: set[str] | None = None,
) -> list[dict]:
    """`size` verl-format rows of task `spec` generated with `seed` (minus questions in exclude_questions)."""
    name = task_name(spec)
    options = parse_options(options) if isinstance(options, str) else dict(options)
    ds = _dataset(name, size, seed, options)
    rows = []
    for i in range(len(ds)):
        entry = ds[i]
        if exclude_questions is not None:  # keep each question once, and none of the excluded ones
            if entry["question"] in exclude_questions:
                continue
            exclude_questions.add(entry["question"])
        rows.append(
            {
                "data_source": DATA_SOURCE_PREFIX + name,
                "prompt": _messages(entry["question"], fmt),
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "task": name,
                    "options": json.dumps(options, sort_keys=True),
                    "entry": json.dumps(entry, default=str),
                    "format": fmt,
                },
            }
        )
    return rows


def train_val_rows(spec: str, train_size: int, val_size: int, seed: int, options: dict | str = "", fmt: str = "direct"):
    """(train rows with seed, held-out val rows with seed + train_size: questions not in train, each once)."""
    train = task_rows(spec, train_size, seed, options, fmt, "train")
    seen = {json.loads(r["extra_info"]["entry"])["question"] for r in train}  # grows with val's own questions
    # reasoning-gym seeds item i with `seed + i`: validation starts where training's seeds end
    val = task_rows(spec, val_size, seed + train_size, options, fmt, "val", exclude_questions=seen) if val_size > 0 else []
    return train, val


def columns(rows: list[dict]) -> dict[str, list]:
    """Rows -> the column dict that `datasets.Dataset.to_dict()` gives for parquet data."""
    keys = ("data_source", "prompt", "ability", "reward_model", "extra_info")
    return {k: [r[k] for r in rows] for k in keys}


# ----------------------------------------------------------------------------- the reward


@functools.lru_cache(maxsize=64)
def _scorer_dataset(name: str, options_json: str):
    """A dataset object of the task with the run's options: its score_answer is the verifier."""
    return _dataset(name, 1, 0, json.loads(options_json))


def extract(response: str, fmt: str) -> str | None:
    """The answer in a response: the last <answer>...</answer> (direct, default), the stripped response (plain),
    or the last number (number)."""
    if fmt == "plain":
        return response.strip()
    if fmt == "number":
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else None
    from reasoning_gym.utils import extract_answer

    return extract_answer(response)


def reasoning_gym_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The task's own verifier on the extracted answer; acc = 1 for full marks."""
    info = extra_info or {}
    name = info.get("task") or data_source[len(DATA_SOURCE_PREFIX) :]
    entry = json.loads(info["entry"]) if info.get("entry") else {"question": "", "answer": str(ground_truth), "metadata": {}}
    ds = _scorer_dataset(name, info.get("options") or "{}")
    answer = extract(solution_str, info.get("format") or "direct")
    score = float(ds.score_answer(answer, entry))
    return {"score": score, "acc": float(score >= 1.0)}


reasoning_gym_score.sandbox_warm = True  # sandbox workers call it once on an empty answer: the task is built before the forks


def register(name: str) -> str:
    """Register `reasoning_gym_score` for data_source reasoning_gym/NAME; returns the data_source."""
    source = DATA_SOURCE_PREFIX + name
    register_scorer(source)(reasoning_gym_score)
    return source
