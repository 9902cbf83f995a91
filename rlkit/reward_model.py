"""Model-based reward: a sequence-classification model scores (prompt, response) pairs.

Any `AutoModelForSequenceClassification` with one output works (e.g. a Bradley-Terry reward model
trained with TRL, or Skywork/ArmoRM-style checkpoints). It keeps its own tokenizer and chat template,
which may differ from the policy's: the prompt's chat messages plus the response as the assistant
turn are rendered with the *reward model's* template, so nothing depends on the policy's token ids.
"""

from __future__ import annotations

import torch

from rlkit.engine import resolve_device
from rlkit.errors import ConfigError
from rlkit.protocol import DataProto
from rlkit.ray_group import dispatch


def render(tokenizer, prompt, response: str) -> str:
    """The text a reward model reads: chat messages + the response as the assistant turn, in the reward model's own
    template (a plain-string prompt, or a tokenizer without a template: the texts joined). recipes/rm.py trains on
    exactly this text, so that training and scoring see the same tokens."""
    if isinstance(prompt, str) or not getattr(tokenizer, "chat_template", None):
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return text + response
    return tokenizer.apply_chat_template(list(prompt) + [{"role": "assistant", "content": response}], tokenize=False)


class RewardModel:
    """score(prompts, responses) -> (B,) float tensor, in micro-batches, without gradients.

    max_length: the longest text it reads, in its own tokens (recipes pass --data.max-prompt-length +
    --data.max-response-length, recipes/rm.py's limit). A longer text loses its start (the prompt's), not its end: the
    score is read at the response's last token, as in training, not at a token in the middle of the response."""

    def __init__(
        self, path: str, device: str = "auto", micro_batch_size: int = 32, max_length: int = 2048, trust_remote_code: bool = False
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # too long: the prompt's start is cut, the response's end kept
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=trust_remote_code).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ConfigError(
                f"reward model {path} has {self.model.config.num_labels} outputs; a reward model has exactly 1 (num_labels=1)"
            )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.micro_batch_size, self.max_length = micro_batch_size, max_length

    def render(self, prompt, response: str) -> str:
        """The text the reward model reads (module-level `render` with its tokenizer)."""
        return render(self.tokenizer, prompt, response)

    @torch.no_grad()
    def __call__(self, prompts, responses: list[str]) -> torch.Tensor:
        texts = [self.render(p, r) for p, r in zip(prompts, responses)]
        scores = []
        for start in range(0, len(texts), self.micro_batch_size):
            enc = self.tokenizer(
                texts[start : start + self.micro_batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(self.device)
            scores.append(self.model(**enc).logits[:, 0].float().cpu())
        return torch.cat(scores)


class RewardModelWorker:
    """One replica of the reward model in a Ray worker (`--trainer.backend ray`): scores its share of a batch.

    It does not train, so the replicas need no process group: each holds the whole model and the
    group splits every batch across them (data parallel).
    """

    def __init__(
        self,
        path: str,
        device: str = "auto",
        micro_batch_size: int = 32,
        trust_remote_code: bool = False,
        max_length: int = 2048,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ):
        import os

        from rlkit.engine import set_threads

        set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.model = RewardModel(
            path, "cuda:0" if resolve_device(device).type == "cuda" else "cpu", micro_batch_size, max_length, trust_remote_code
        )

    @dispatch("split")
    def score(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"scores": self.model(list(data["raw_prompt"]), list(data["response"]))})


class RayRewardModel:
    """RewardModel's interface, answered by a RayWorkerGroup of RewardModelWorker replicas."""

    def __init__(self, group):
        self.group = group

    def __call__(self, prompts, responses: list[str]) -> torch.Tensor:
        data = DataProto.from_dict(non_tensors={"raw_prompt": list(prompts), "response": list(responses)})
        return self.group.score(data)["scores"]

    def close(self) -> None:
        """Stop the replicas and free their pools."""
        self.group.close()
