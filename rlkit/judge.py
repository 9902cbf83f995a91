"""A model as judge: a local causal LM asked, through a prompt template, whether a response is right.

    judge = Judge("path/to/judge-model")                  # a Hugging Face folder or hub id, loaded at first use
    judge.score(questions, responses, references)         # -> list of floats, in batches of batch_size
    reward = judge.reward_fn()                            # a @batched("batch") reward function (rlkit/rewards.py)

Two ways to read the verdict:

    mode "p_yes":  score = P(yes) / (P(yes) + P(no)) from the logits of the judge's next token after the prompt
                   (one forward pass, no sampling, no text to parse);
    mode "parse":  the judge writes (greedy, max_new_tokens); `parse_score` reads a score from that text in the
                   sandbox (rlkit/sandbox.py), like every scorer that parses model text, strictly: a leading yes/no,
                   else the last "x/N" or "x out of N", else the last number over `scale`; a score outside [0, 1]
                   or no verdict: NaN (an error RewardFn counts, or raises on).

Batches are left-padded with explicit position ids, so a row's score does not depend on its batch (tested:
batched == one by one); only the last position's logits are computed (logits_to_keep=1). The special tokens of
the judge's tokenizer (<|im_end|>, ...) written in a question, response or reference are broken with a zero-width
space before templating, so model-written text cannot close the judge's turn. The model runs in the trainer's
process (like a reward model), on `device` (CPU unless told: said once when it loads); only the text parsing is
sandboxed. To use it in a recipe, put it in a file and pass that file's function with --reward.custom-fn::

    # my_judge.py
    from rlkit.judge import Judge
    judge_score = Judge("path/to/judge").reward_fn()      # --reward.custom-fn my_judge.py:judge_score
"""

from __future__ import annotations

import math
import re

from rlkit.errors import ConfigError
from rlkit.rewards import batched

DEFAULT_TEMPLATE = "Question: {question}\nReference: {reference}\nResponse: {response}\nIs the response correct? yes or no"
_NUMBER = r"-?\d+(?:\.\d+)?"
_RATING = re.compile(rf"({_NUMBER})\s*(?:/|\bout of\b)\s*({_NUMBER})", re.IGNORECASE)
_VERDICT = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)
MAX_PARSE_CHARS = 2000  # numbers are read from the judge's last 2000 characters, the verdict from its first 100


def parse_score(text: str, scale: float = 10.0) -> float:
    """A judge's text -> a score in [0, 1], strictly: a leading "yes" (1.0) or "no" (0.0); else the last rating
    "x/N" or "x out of N" (x/N); else the last number over `scale`. ValueError when there is none, or the score
    is outside [0, 1] (not a score on this scale).

    "Yes." -> 1.0, "No. The correct answer is 42." -> 0.0, "Rating: 2 out of 10" -> 0.2, "8/10" -> 0.8,
    "4 out of 5 ... 3/4" -> 0.75, "Score: 7" -> 0.7, "12", "-3", "7/0" -> ValueError.
    """
    text = str(text)
    m = _VERDICT.match(text[:100])
    if m:
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    tail = text[-MAX_PARSE_CHARS:]
    ratings = [(float(x), float(n)) for x, n in _RATING.findall(tail)]
    numbers = re.findall(_NUMBER, tail)
    if not ratings and not numbers:
        raise ValueError(f"no score in the judge's text {text[:80]!r}")
    value, over = ratings[-1] if ratings else (float(numbers[-1]), scale)
    if not 0 <= value <= over:
        raise ValueError(f"no score in the judge's text {text[:80]!r}: {value:g} is outside [0, {over:g}]")
    return value / over


def question_of(prompt) -> str:
    """The question a judge is shown: a prompt's last user message (or the prompt itself when it is a string)."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class Judge:
    """A generative judge on a local Hugging Face causal LM (module docstring)."""

    def __init__(
        self,
        model_path: str,
        template: str = DEFAULT_TEMPLATE,
        mode: str = "p_yes",
        yes: str = "yes",
        no: str = "no",
        batch_size: int = 32,
        max_new_tokens: int = 16,
        scale: float = 10.0,
        chat: bool = True,
        device: str = "cpu",
    ):
        """template: a str.format string with {question}, {response}, {reference}; chat: wrap it as one user message
        with the tokenizer's chat template (and its generation prompt), when it has one. yes / no: the two answers
        compared in mode "p_yes", one token each."""
        if mode not in ("p_yes", "parse"):
            raise ConfigError(f"Judge mode {mode!r}: choose p_yes (next-token P(yes)) or parse (a score parsed from its text)")
        if batch_size < 1:
            raise ConfigError(f"Judge batch_size {batch_size}: must be at least 1")
        self.model_path, self.template, self.mode, self.yes, self.no = model_path, template, mode, yes, no
        self.batch_size, self.max_new_tokens, self.scale, self.chat, self.device = batch_size, max_new_tokens, scale, chat, device
        self.model = self.tokenizer = self.pool = self._special = None

    def load(self) -> Judge:
        """Load the model and tokenizer (once)."""
        if self.model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path).to(self.device).eval()
            print(f"judge: {self.model_path} on {self.device} (mode {self.mode}; Judge(device=...) to move it)", flush=True)
            special = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)  # <|im_end|>, <|im_start|>, ...
            self._special = re.compile("|".join(map(re.escape, special))) if special else None
            ids = [self.tokenizer(w, add_special_tokens=False)["input_ids"] for w in (self.yes, self.no)]
            if self.mode == "p_yes" and any(len(i) != 1 for i in ids):
                raise ConfigError(f"Judge yes={self.yes!r} / no={self.no!r} must be one token each for this tokenizer, got {ids}")
            self.yes_id, self.no_id = ids[0][0], ids[1][0]
        return self

    def escape(self, text) -> str:
        """`text` with every special token of the judge's tokenizer broken by a zero-width space after its first
        character: it reads the same, but tokenizes as text, not as the control token."""
        return self._special.sub(lambda m: m[0][0] + "\u200b" + m[0][1:], text) if isinstance(text, str) and self._special else text

    def render(self, question: str, response: str, reference) -> str:
        """The judge's prompt text for one response (the three fields escaped: `escape`)."""
        question, response, reference = map(self.escape, (question, response, reference))
        text = self.template.format(question=question, response=response, reference=reference)
        if self.chat and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return text

    def _batch(self, texts: list[str]):
        import torch

        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=self.device)
        return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)  # (b, W) left-padded, positions from 0 per row

    def p_yes(self, texts: list[str]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the next token after each prompt text, in batches of batch_size."""
        import torch

        from rlkit.engine import accepts_logits_to_keep

        self.load()
        out = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                ids, mask, pos = self._batch(texts[start : start + self.batch_size])
                last = {"logits_to_keep": 1} if accepts_logits_to_keep(self.model) else {}  # the LM head on the last position only
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **last).logits[:, -1].float()  # (b, V)
                two = torch.stack([logits[:, self.yes_id], logits[:, self.no_id]], dim=-1)  # (b, 2)
                out += torch.softmax(two, dim=-1)[:, 0].tolist()
        return out

    def generate(self, texts: list[str]) -> list[str]:
        """The judge's greedy text after each prompt (at most max_new_tokens), in batches of batch_size."""
        import torch

        self.load()
        out = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                ids, mask, _ = self._batch(texts[start : start + self.batch_size])
                gen = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                out += self.tokenizer.batch_decode(gen[:, ids.shape[1] :], skip_special_tokens=True)
        return out

    def parse(self, texts: list[str]) -> list[float]:
        """parse_score on each text in the sandbox (one job each, in parallel); NaN where it found no score."""
        from rlkit.sandbox import Limits, SandboxPool

        if self.pool is None:
            self.pool = SandboxPool(Limits(timeout_s=10.0), 2, preload=["rlkit.judge:parse_score"])
        results = self.pool.map([{"fn": "rlkit.judge:parse_score", "kwargs": {"text": t, "scale": self.scale}} for t in texts])
        return [float(r.value) if r.ok else math.nan for r in results]

    def score(self, questions: list[str], responses: list[str], references) -> list[float]:
        """One score in [0, 1] per response (NaN in mode "parse" where the judge's text holds no score)."""
        self.load()
        texts = [self.render(q, r, ref) for q, r, ref in zip(questions, responses, references)]
        return self.p_yes(texts) if self.mode == "p_yes" else self.parse(self.generate(texts))

    def reward_fn(self):
        """This judge as a reward function: @batched("batch"), the question from each row's prompt (its last user
        message), the reference from its ground truth; it runs in the trainer's process (in_process)."""

        @batched("batch")
        def judge_score(data_sources, solution_strs, ground_truths, extra_infos, groups, prompts):
            return self.score([question_of(p) for p in prompts], solution_strs, ground_truths)

        judge_score.in_process = True
        judge_score.judge = self
        return judge_score

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
