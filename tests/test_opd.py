"""recipes/opd.py, on-policy distillation: the advantage on fixed values, a teacher equal to the student changes
nothing, a different teacher pulls the student toward it (the reverse KL falls), and the one-line refusals."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_grpo_recipe import ROOT, load_recipe, read_jsonl, small_config

from rlkit import algos
from rlkit.errors import ConfigError

STUDENT = ROOT / "rlkit" / "assets" / "tiny-arith"


def test_distill_advantage_on_hand_derived_values():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, d = algos.distill_advantage(lp, teacher, mask, kl_coef=2.0)
    assert d.tolist() == [[0.5, -1.0, 0.0, 0.0]]  # d_t = student - teacher, 0 off the mask
    assert adv.tolist() == [[-1.0, 2.0, 0.0, 0.0]]  # A_t = -2 d_t
    # discount 0.5 with a hole (a tool-output token, m = 0) at t = 1: d = [0.5, -, 0, -2]; backwards:
    # t=3: -2; t=2: 0 + 0.5*(-2) = -1; t=1: masked (0; the carry stays -1); t=0: 0.5 + 0.5*(-1) = 0 -> A = -sum
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    adv, _ = algos.distill_advantage(lp, teacher, mask, kl_coef=1.0, discount=0.5)
    assert adv.tolist() == [[0.0, 0.0, 1.0, 2.0]]


def perturbed_teacher(folder, noise: float = 0.05):
    """The embedded model with seeded noise on its (tied) embeddings: a teacher with the student's tokenizer."""
    shutil.copytree(STUDENT, folder)
    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    key = "model.embed_tokens.weight"
    weights[key] = weights[key] + noise * torch.randn(weights[key].shape, generator=g)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def opd_config(opd, tmp_path, teacher, steps=1):
    cfg = small_config(opd, tmp_path / "out", steps=steps, save_freq=0, test_freq=0, val_before_train=False)
    cfg.teacher = str(teacher)
    cfg.rollout.n = 4
    cfg.system.data.val_files = []
    return cfg


def test_a_teacher_equal_to_the_student_changes_nothing(tmp_path):
    """Same weights: d_t = 0 exactly (the same passes on the same weights), so every advantage is 0, the gradient is 0
    (no KL or entropy term) and AdamW's step is 0: the exported weights are the starting ones, bit for bit."""
    opd = load_recipe("opd")
    cfg = opd_config(opd, tmp_path, STUDENT)
    cfg.actor.weight_decay = 0.0  # decoupled weight decay would shrink the weights without any gradient
    opd.main(cfg)
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
    assert row["distill/reverse_kl"] == 0.0 and row["actor/grad_norm"] == 0.0
    assert row["distill/teacher_log_prob"] == row["distill/student_log_prob"] < 0
    before = load_file(STUDENT / "model.safetensors")
    after = load_file(next((tmp_path / "out" / "checkpoints").glob("global_step_*/hf/model.safetensors")))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_student_moves_toward_a_different_teacher(tmp_path):
    """A teacher with the student's tokenizer and perturbed (tied) embeddings: the reverse KL per token, measured on the
    student's own samples, falls over a few steps (measured here: 0.80, 0.74 -> 0.65, 0.48, 0.55 at steps 9-11 of
    a 12-step run). One sample per token is a noisy estimate: 32 prompts x 4 samples per step keep it readable."""
    teacher = perturbed_teacher(tmp_path / "teacher")
    opd = load_recipe("opd")
    cfg = opd_config(opd, tmp_path, teacher, steps=12)
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 32
    cfg.actor.lr = 3e-4
    opd.main(cfg)
    kl = [r["distill/reverse_kl"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "distill/reverse_kl" in r]
    assert len(kl) == 12 and kl[0] > 0.3, kl
    assert sum(kl[-3:]) / 3 < 0.85 * sum(kl[:2]) / 2, kl  # the last three steps' mean below the first two's


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: setattr(c, "teacher", ""), "needs --teacher"),
        (lambda c: setattr(c.rollout, "temperature", 0.7), "--rollout.temperature 0.7"),
        (lambda c: (setattr(c, "task_reward_coef", 1.0), setattr(c.rollout, "n", 1)), "--task-reward-coef needs --rollout.n >= 2"),
        (lambda c: setattr(c, "teacher", str(ROOT / "rlkit" / "assets" / "tiny-calc")), "has another vocabulary"),
        (lambda c: setattr(c, "kl_coef", float("nan")), "--kl-coef nan: must be a finite number"),  # config.check_values, first
        (lambda c: setattr(c, "kl_coef", -1.0), "--kl-coef -1.0: must be a number from 0"),
        (lambda c: setattr(c, "discount", 1.5), "--discount 1.5: must be a number from 0 to 1"),
        (lambda c: setattr(c, "task_reward_coef", float("inf")), "--task-reward-coef inf: must be a finite number"),
    ],
)
def test_bad_teacher_settings_stop_with_one_line(tmp_path, change, words):
    opd = load_recipe("opd")
    cfg = opd_config(opd, tmp_path, STUDENT)
    change(cfg)
    with pytest.raises(ConfigError) as info:
        opd.main(cfg)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_the_teacher_on_ray_scores_as_the_local_teacher_and_a_ray_run_distills(tmp_path):
    """--trainer.backend ray: one teacher replica per bundle, beside the policy's worker, each scoring its share of the
    batch. (1) A group of 2 replicas returns the local teacher's log-probs row for row (3 rows: padded to 4, split,
    unpadded; rows of different lengths, so a row out of place would show). (2) A Ray OPD step with the teacher
    equal to the student gives d_t ~ 0: the FSDP student's and the replicas' passes are the same fp32 arithmetic on
    the same weights, in other micro-batch shapes, so they differ by round-off only (~1e-6 per log-prob of size ~3);
    1e-4 bounds the mean while a misaligned row would give ~1 (the per-token log-probs are -0.1 to -10)."""
    ray = pytest.importorskip("ray")
    from rlkit.config import ModelConfig, RolloutConfig
    from rlkit.protocol import DataProto
    from rlkit.ray_group import RayWorkerGroup, init_ray
    from rlkit.workers import TeacherWorker

    g = torch.Generator().manual_seed(0)
    lengths = [(5, 3), (2, 4), (4, 1)]  # (prompt, response) tokens per row
    P, R = 5, 4
    ids = torch.randint(3, 200, (3, P + R), generator=g)
    attn, resp_mask = torch.zeros(3, P + R, dtype=torch.long), torch.zeros(3, R, dtype=torch.long)
    for i, (p, r) in enumerate(lengths):
        attn[i, P - p : P + r], resp_mask[i, :r] = 1, 1
    batch = DataProto.from_dict(
        tensors={
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "input_ids": ids,
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "response_mask": resp_mask,
        }
    )
    args = (ModelConfig(path=str(STUDENT)), RolloutConfig())
    want = TeacherWorker(*args).compute_log_prob(batch)["teacher_log_prob"]
    init_ray(num_cpus=2)
    try:
        group = RayWorkerGroup(TeacherWorker, 2, *args, cpus_per_worker=0.5)
        try:
            got = group.compute_log_prob(batch)["teacher_log_prob"]
        finally:
            group.close()
        assert got.shape == want.shape == (3, R)
        torch.testing.assert_close(got * resp_mask, want * resp_mask, atol=1e-5, rtol=0)

        opd = load_recipe("opd")
        cfg = opd_config(opd, tmp_path, STUDENT)
        cfg.system.scale_out.backend, cfg.system.scale_out.n_workers, cfg.system.scale_out.cpus_per_worker = "ray", 2, 1
        opd.main(cfg)
        row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
        assert abs(row["distill/reverse_kl"]) < 1e-4 and row["distill/teacher_log_prob"] < -0.05, row
        assert row["distill/teacher_log_prob"] == pytest.approx(row["distill/student_log_prob"], abs=1e-4)
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # all pools freed
    finally:
        ray.shutdown()


def test_a_missing_or_too_small_teacher_stops_in_one_line_before_the_student_loads(tmp_path, monkeypatch):
    """Issue #34 FAILs 9, 10: a --teacher path that does not exist (was four OSError tracebacks after the student
    loaded), and a teacher with the student's tokenizer but fewer embedding rows (was an IndexError at its first
    forward: the student samples ids it has no row for): one line each, before any model loads."""
    import json

    from rlkit.errors import MissingFile

    opd = load_recipe("opd")
    monkeypatch.setattr(opd, "build_policy", lambda *a, **k: pytest.fail("the student loaded before the teacher was checked"))
    with pytest.raises(MissingFile, match=r"--teacher .*nope: no model there"):
        opd.main(opd_config(opd, tmp_path, tmp_path / "nope"))
    small = perturbed_teacher(tmp_path / "small")
    config = json.loads((small / "config.json").read_text())
    weights = load_file(small / "model.safetensors")
    rows = config["vocab_size"] - 8
    weights = {k: v[:rows] if v.shape[0] == config["vocab_size"] else v for k, v in weights.items()}
    save_file(weights, small / "model.safetensors", metadata={"format": "pt"})
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    with pytest.raises(ConfigError, match=rf"has {rows} embedding rows, fewer than the student's {rows + 8}"):
        opd.main(opd_config(opd, tmp_path, small))


def test_the_task_reward_adds_its_group_advantage_with_its_sign(tmp_path, monkeypatch):
    """--task-reward-coef c: A_t = -lambda d_t + c * (GRPO advantage of the task score). With the teacher equal to the
    student d_t = 0 exactly, so the advantages the update sees are c times the group-centred, std-scaled scores: a row
    scored above its group's mean is pushed up (a wrong sign would push it down)."""
    from rlkit import recipe

    opd = load_recipe("opd")
    cfg = opd_config(opd, tmp_path, STUDENT)
    cfg.task_reward_coef = 2.0
    seen = {}
    real_score, real_build = recipe.score, opd.build_policy

    def score(batch, tok, reward_fn):
        _, metrics = real_score(batch, tok, reward_fn)
        seen["scores"] = torch.tensor([0.0, 1.0, 1.0, 3.0] * (len(batch) // 4))  # every group of 4: mean 1.25
        return seen["scores"], metrics

    def build(*a, **k):
        policy = real_build(*a, **k)
        update = policy.update
        policy.update = lambda batch, loss_fn: seen.setdefault("batch", batch) and update(batch, loss_fn)
        return policy

    monkeypatch.setattr(recipe, "score", score)
    monkeypatch.setattr(opd, "build_policy", build)
    opd.main(cfg)
    batch, mask = seen["batch"], seen["batch"]["response_mask"]
    want = 2.0 * algos.grpo_advantage(seen["scores"], batch["uid"], True)[:, None] * mask
    assert batch["uid"][0] == batch["uid"][3] != batch["uid"][4]  # the rows of a group sit together
    torch.testing.assert_close(batch["advantages"], want)
    assert (batch["advantages"][3] * mask[3] >= 0).all() and batch["advantages"][3].sum() > 0  # the 3 beats its group
