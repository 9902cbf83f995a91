"""Regression anchors: the first two steps of every recipe, on a small CPU config, reproduce pinned metrics.

As torchtune's recipe tests do: a change that alters what a recipe computes (its advantage, its loss, the
update loop, sampling, the data order) moves these numbers, and the test names the metric that moved.
The tolerance covers only float rounding (another CPU, BLAS or thread schedule); 1 thread and a fixed seed
make the run deterministic. After an intended change, print the new values with
`python tests/test_anchors.py` and paste them here, saying why in the commit.
"""

import sys

import pytest
from test_grpo_recipe import load_recipe, read_jsonl, small_config

pytestmark = pytest.mark.numerics  # rerun with the scalar kernels by .ci/run (tests/numerics.py)

KEYS = ("critic/score/mean", "response_length/mean", "actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss")
KEYS += ("agent/turns/mean", "agent/tool_calls/mean", "agent/tool_tokens/mean")  # grpo_tools: the turn loop (its tool spans) pinned too
KEYS += ("distill/reverse_kl",)  # opd: the per-token reverse KL to its teacher
RECIPES = ["grpo", "rloo", "dapo", "reinforce_pp", "ppo", "grpo_tools", "gspo", "cispo", "gmpo", "remax", "opd"]
# The newest forks pin their clip fractions too: small_config's mini-batches of 4 of the 8 prompts make the second optimizer
# step of each update off-policy, so each fork's own clip acts (test_the_forks_anchors_show_their_clip_acting).
CLIP_KEYS = {"gspo": ("actor/pg_clipfrac",), "cispo": ("actor/pg_clipfrac",), "remax": ("actor/pg_clipfrac",)}
CLIP_KEYS["gmpo"] = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")

ANCHORS = {  # one dict per step; measured on x86-64, torch 2.13 CPU (the same before and after the loss-contract refactor)
    "grpo": [
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 0.0016478351317346096,
            "actor/pg_loss": 0.0016445331275463104,
            "actor/kl_loss": 0.00330204120837152,
            "actor/grad_norm": 3.0055079460144043,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.4375,
            "actor/loss": -0.0008913690289773513,
            "actor/pg_loss": -0.0009268720168620348,
            "actor/kl_loss": 0.035503007005900145,
            "actor/grad_norm": 0.739567160140723,
        },
    ],
    "rloo": [
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 0.0010514678433537483,
            "actor/pg_loss": 0.0010480496566742659,
            "actor/kl_loss": 0.003418212989345193,
            "actor/grad_norm": 2.0152289867401123,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.4375,
            "actor/loss": -0.0005576837506851007,
            "actor/pg_loss": -0.0005931553314439952,
            "actor/kl_loss": 0.03547159442678094,
            "actor/grad_norm": 0.4956138012930751,
        },
    ],
    "dapo": [
        {
            "critic/score/mean": 0.40625,
            "response_length/mean": 3.78125,
            "actor/loss": 0.0028374716639518738,
            "actor/pg_loss": 0.0028374716639518738,
            "actor/grad_norm": 3.232704997062683,
        },
        {
            "critic/score/mean": 0.25,
            "response_length/mean": 3.75,
            "actor/loss": 0.0018461218569427729,
            "actor/pg_loss": 0.0018461218569427729,
            "actor/grad_norm": 4.44060492515564,
        },
    ],
    "reinforce_pp": [
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 0.008119240403175354,
            "actor/pg_loss": 0.008119240403175354,
            "actor/grad_norm": 3.7423804998397827,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.4375,
            "actor/loss": -0.013660743832588196,
            "actor/pg_loss": -0.013660743832588196,
            "actor/grad_norm": 3.210271954536438,
        },
    ],
    "ppo": [
        {
            "critic/score/mean": 0.0625,
            "response_length/mean": 3.4375,
            "actor/loss": 0.017847679555416107,
            "actor/pg_loss": 0.017847679555416107,
            "actor/grad_norm": 7.9354143142700195,
            "critic/vf_loss": 0.03814062010496855,
        },
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.4375,
            "actor/loss": 0.0037320032715797424,
            "actor/pg_loss": 0.0037320032715797424,
            "actor/grad_norm": 6.007267236709595,
            "critic/vf_loss": 0.0718933753669262,
        },
    ],
    "grpo_tools": [  # the embedded tool model: 1 and 3 of 32 episodes call the calculator
        {
            "critic/score/mean": 0.03125,
            "response_length/mean": 6.46875,
            "actor/loss": 2.6901803518164513e-07,
            "actor/pg_loss": 3.2393827620325055e-09,
            "actor/kl_loss": 0.000265778653556481,
            "actor/grad_norm": 0.4500752299063606,
            "agent/turns/mean": 1.03125,
            "agent/tool_calls/mean": 0.03125,
            "agent/tool_tokens/mean": 0.4375,
        },
        {
            "critic/score/mean": 0.0625,  # the 2 correct episodes call the tool: 29 tokens each, A = 1.5; token-mean weighs
            "response_length/mean": 8.03125,  # each advantage by its tokens: -sum_i A_i L_i / sum_i L_i = -0.27 (mean L = 8)
            "actor/loss": -0.27020539343357086,
            "actor/pg_loss": -0.2702055424451828,
            "actor/kl_loss": 0.00014984885274316184,
            "actor/grad_norm": 0.45702507346868515,
            "agent/turns/mean": 1.09375,
            "agent/tool_calls/mean": 0.09375,
            "agent/tool_tokens/mean": 1.375,
        },
    ],
    "gspo": [  # GSPO's sequence clip (3e-4 / 4e-4) acts on 14-15 % of the tokens
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 0.0006265388801693916,
            "actor/pg_loss": 0.0006265388801693916,
            "actor/grad_norm": 2.112283080816269,
            "actor/pg_clipfrac": 0.14423076808452606,
        },
        {
            "critic/score/mean": 0.125,
            "response_length/mean": 3.46875,
            "actor/loss": -3.281049430370331e-05,
            "actor/pg_loss": -3.281049430370331e-05,
            "actor/grad_norm": 0.42251408100128174,
            "actor/pg_clipfrac": 0.15094339847564697,
        },
    ],
    "cispo": [  # the weight cap acts in step 2
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": -0.2507792692631483,
            "actor/pg_loss": -0.2507825717329979,
            "actor/kl_loss": 0.00330201699398458,
            "actor/grad_norm": 2.980858087539673,
            "actor/pg_clipfrac": 0.0,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.4375,
            "actor/loss": -0.025014224676397134,
            "actor/pg_loss": -0.02505042776465416,
            "actor/kl_loss": 0.03620363958179951,
            "actor/grad_norm": 0.7280453994171694,
            "actor/pg_clipfrac": 0.01923076994717121,
        },
    ],
    "gmpo": [  # clip e^+-0.05 (run_two_steps): both sides act
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": -0.00108315609395504,
            "actor/pg_loss": -0.0010862508788704872,
            "actor/kl_loss": 0.0030947516206651926,
            "actor/grad_norm": 2.7829986810684204,
            "actor/pg_clipfrac": 0.009615384973585606,
            "actor/pg_clipfrac_lower": 0.03846153989434242,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.4375,
            "actor/loss": -0.0004926062224512862,
            "actor/pg_loss": -0.000529831275343895,
            "actor/kl_loss": 0.03722507553175092,
            "actor/grad_norm": 0.1294291551457718,
            "actor/pg_clipfrac": 0.0,
            "actor/pg_clipfrac_lower": 0.009615384973585606,
        },
    ],
    "remax": [  # the PPO clip acts in step 1
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 0.21665437519550323,
            "actor/pg_loss": 0.21664989739656448,
            "actor/kl_loss": 0.004474809393286705,
            "actor/grad_norm": 3.69064998626709,
            "actor/pg_clipfrac": 0.03846153989434242,
        },
        {
            "critic/score/mean": 0.09375,
            "response_length/mean": 3.40625,
            "actor/loss": 0.4124167859554291,
            "actor/pg_loss": 0.4123944491147995,
            "actor/kl_loss": 0.022333005908876657,
            "actor/grad_norm": 2.8838539123535156,
            "actor/pg_clipfrac": 0.0,
        },
    ],
    "opd": [  # teacher: the embedded model with seeded noise on its embeddings (tests/test_opd.py perturbed_teacher)
        {
            "critic/score/mean": 0.1875,
            "response_length/mean": 3.59375,
            "actor/loss": 1.1431586742401123,
            "actor/pg_loss": 1.1431586742401123,
            "actor/grad_norm": 18.801780223846436,
            "distill/reverse_kl": 1.1051578521728516,
        },
        {
            "critic/score/mean": 0.03125,
            "response_length/mean": 3.46875,
            "actor/loss": 0.5256084054708481,
            "actor/pg_loss": 0.5256084054708481,
            "actor/grad_norm": 16.555908203125,
            "distill/reverse_kl": 0.5580846667289734,
        },
    ],
}


def run_two_steps(name: str, out_dir) -> list[dict]:
    recipe = load_recipe(name)
    cfg = small_config(recipe, out_dir, steps=2, num_threads=1, save_freq=0, seed=7)
    cfg.system.data.val_files = []  # no validation: the anchors are about training
    cfg.system.trainer.max_ckpt_to_keep = 1
    if name == "dapo":
        cfg.gen_batch_size = 8
    if name == "ppo":
        cfg.rollout.n = 2
    if name == "opd":  # a teacher that differs from the student, with its tokenizer (tests/test_opd.py)
        from test_opd import perturbed_teacher

        cfg.teacher = str(perturbed_teacher(out_dir / "teacher"))
    if name == "gmpo":  # the paper's log-space clip 0.4 never bites in 2 steps at lr 1e-4 (|log ratio| < 0.1): e^+-0.05 does
        cfg.actor.clip_ratio_low = cfg.actor.clip_ratio_high = 0.05
    recipe.main(cfg)
    rows = read_jsonl(out_dir / "metrics.jsonl")
    keys = KEYS + CLIP_KEYS.get(name, ())
    return [{k: r[k] for k in keys if k in r} for r in rows]


@pytest.mark.parametrize("name", RECIPES)
def test_first_two_steps_reproduce_the_pinned_metrics(tmp_path, name):
    got = run_two_steps(name, tmp_path)
    want = ANCHORS[name]
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for k in w:
            # Rounding only (tests/numerics.py): grad_norm's entries are within grad_tol (3.6e-5 of the largest, at ~2500
            # terms) after one step, and step 2 carries step 1's difference through AdamW; losses are token-means of
            # ~A * ratio near 0, so they get an absolute floor. Measured against these pins with the default, AVX2 and
            # AVX-512 kernels: at most 6e-6 relative (grad_norm) and 1.2e-7 absolute (losses), 16x and 8x inside.
            # The integer-valued metrics (scores, lengths, tool calls) are sampled tokens: equal on all three.
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), f"{name} step {step}: {k} is {g[k]!r}, pinned {w[k]!r}"


def test_the_forks_anchors_show_their_clip_acting():
    """Each fork's pinned run has a step where its clip (GSPO's sequence clip, CISPO's weight cap, GMPO's log-space clip,
    ReMax's PPO clip) is active, so a change to the clip moves the anchor."""
    for name, keys in CLIP_KEYS.items():
        assert any(step[k] > 0 for step in ANCHORS[name] for k in keys), name


if __name__ == "__main__":  # print the current values, to pin after an intended change
    import tempfile
    from pathlib import Path

    for name in sys.argv[1:] or RECIPES:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"    {name!r}: {run_two_steps(name, Path(tmp))!r},")
