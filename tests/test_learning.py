"""The default run learns: `python recipes/grpo.py` with no arguments lifts held-out accuracy by >= 20 points.

This is the full default run (296 steps, about 3 minutes on 2 CPU cores), validated only before
and after to save time. Deterministic on CPU for a given torch build.
"""

from test_grpo_recipe import load_recipe


def test_default_grpo_run_gains_twenty_points(tmp_path):
    grpo = load_recipe("grpo")
    cfg = grpo.Config()
    cfg.system.trainer.default_local_dir = str(tmp_path)
    cfg.system.trainer.test_freq = 0  # validate at step 0 and at the end only
    summary = grpo.main(cfg)
    gain = summary["val_acc_after"] - summary["val_acc_before"]
    assert summary["val_acc_before"] < 0.35, summary  # the embedded model starts weak ...
    assert gain >= 0.20, summary  # ... and GRPO lifts it by at least 20 points
