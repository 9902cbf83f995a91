"""The builders of the demo assets shipped in rlkit/assets/ (rlkit/demos.py says what a run reads of them).

Each module rebuilds one demo from nothing, deterministically, run from a source checkout:

    python scripts/assets/tiny_arith.py  # tiny-arith + arith/ (the default run)
    python scripts/assets/tiny_calc.py  # tiny-calc + mult/ (recipes/grpo_tools.py)
    python scripts/assets/tiny_guess.py  # tiny-guess + guess/ (recipes/grpo_tools.py --agent.env guess)
    python scripts/assets/tiny_judge.py  # tiny-judge (--reward.custom-fn rlkit.demos:judge_score)
    python scripts/assets/tiny_vlm.py  # tiny-vlm + colours/ (--model embedded-vlm --data.task colour_codeword)

common.py holds what they share: the tokenizer, the model, the supervised warm start (recipes/sft.py) and saving.
"""
