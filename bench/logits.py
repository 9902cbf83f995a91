"""The log-prob + entropy of the engine's passes: the fused, chunked algos.token_logprob_entropy (one log-sum-exp,
recomputing backward) against the unfused formulas it replaced (float32 log_softmax gather + softmax entropy,
autograd), alternated in one process: median seconds of forward + backward (memory: tests/test_gpu_construction.py).

    python bench/logits.py                          # 2048 positions at V = 275 (embedded) and 512 at V = 49,152 (SmolLM2)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    import torch

    from rlkit import algos

    def fused(z, pos, lab):
        lp, ent = algos.token_logprob_entropy(z, pos, lab, 1.0, True)
        (lp.sum() + ent.sum()).backward()

    def unfused(z, pos, lab):
        logp = torch.log_softmax(z.float(), -1)
        lp = logp[pos, lab]
        ent = algos.entropy_from_logits(z)
        (lp.sum() + ent.sum()).backward()

    rows = []
    for n, vocab in ((2048, 275), (512, 49152)):
        g = torch.Generator().manual_seed(0)
        z = (4 * torch.randn(n, vocab, generator=g)).requires_grad_()
        pos, lab = torch.arange(n), torch.randint(0, vocab, (n,), generator=g)
        times = {"fused": [], "unfused": []}
        for r in range(args.rounds + 1):
            for name, fn in (("fused", fused), ("unfused", unfused)):
                z.grad = None
                t = common.now()
                fn(z, pos, lab)
                if r:
                    times[name].append(common.now() - t)
        ratio = common.median([a / b for a, b in zip(times["fused"], times["unfused"])])
        rows.append(
            [f"{n} x {vocab}", f"{common.median(times['fused']) * 1e3:.1f}", f"{common.median(times['unfused']) * 1e3:.1f}", f"{ratio:.2f}"]
        )
    print(f"forward + backward of log-probs and entropy, {torch.get_num_threads()} thread(s), medians of {args.rounds}")
    print(common.fmt_table(rows, ["positions x vocab", "fused ms", "unfused ms", "fused / unfused (paired)"]))


if __name__ == "__main__":
    main()
