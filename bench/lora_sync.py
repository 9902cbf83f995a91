"""LoRA weight sync to vLLM: the adapter only (`--rollout.lora-adapter-sync`, the default) vs the merged base.

One vLLM engine per arm (built one after the other in this process), the trainer's model a random-weight Llama
(--hidden/--layers) with a rank --rank adapter on every linear layer. Each round times, per arm:
  sync      rollout.sync_weights(): adapter = save the adapter to a folder + new LoRARequest;
            merged = stream W + scale * B @ A for every weight into vLLM's in-place reload_weights
  next      the next generate (4 prompts, 1 token), where vLLM loads a new adapter from its folder
  after     the generate after that (the same work, nothing to load): sync cost = sync + next - after
Prints medians over --rounds after one warm-up round, then the roofline of "after" (bench/common.py: the prompts'
forward FLOPs, % of a matmul ceiling at the prompts' positions sampled every round).

    python bench/lora_sync.py                          # hidden 512 x 8 layers (~25M), rank 8
    python bench/lora_sync.py --hidden 256 --layers 4  # the 4.3M model of vs_trl.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def arm(model_path: str, adapter: bool, rank: int, rounds: int) -> dict:
    import torch

    from rlkit.config import ActorConfig, DataConfig, DataSystem, ModelConfig, RolloutConfig, RolloutSystem, System
    from rlkit.data import build_prompts
    from rlkit.workers import ActorRolloutRefWorker

    data_cfg, data_sys = DataConfig(max_prompt_length=64, max_response_length=8), DataSystem()
    rollout, system = RolloutConfig(n=1), System(rollout=RolloutSystem(name="vllm", lora_adapter_sync=adapter))
    with common.quiet():
        w = ActorRolloutRefWorker(
            ModelConfig(path=model_path, lora_rank=rank), ActorConfig(), rollout, data_cfg, device="cpu", seed=1, system=system
        )
    tok = w.tokenizer
    prompts = build_prompts(data_sys.val_files, tok, data_cfg, data_sys, 4).batch(list(range(4)), tok.pad_token_id)
    sync, first, again = [], [], []
    # roofline of the plain generate ("after"): 4 prompts x 1 token is the prompts' forward (each its own group)
    groups = [(p, [1]) for p in prompts["attention_mask"].sum(-1).tolist()]
    ceiling = common.Ceiling(w.engine.model.config, decode_rows=sum(p for p, _ in groups), passes=False)
    for _ in range(rounds + 1):
        with torch.no_grad():  # move the adapter a little, as an update would
            for name, p in w.engine.model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 1e-3)
        t0 = common.now()
        w.rollout.sync_weights()
        t1 = common.now()
        w.rollout.generate(prompts, 1)
        t2 = common.now()
        w.rollout.generate(prompts, 1)
        sync.append(t1 - t0)
        first.append(t2 - t1)
        again.append(common.now() - t2)
        ceiling.sample(groups)
    mode = "adapter" if w.rollout.lora_request is not None else "merged"
    params = sum(p.numel() for p in w.engine.model.parameters())
    lora = sum(p.numel() for n, p in w.engine.model.named_parameters() if "lora_" in n)
    w.rollout.close()
    return {
        "mode": mode,
        "sync": common.median(sync[1:]),
        "first": common.median(first[1:]),
        "again": common.median(again[1:]),
        "params": params,
        "lora": lora,
        "groups": groups,
        "after": again[1:],
        "ceiling": ceiling.gen[1:],
        "config": w.engine.model.config,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="rlkit-bench-"))
    model_path = common.make_random_model(work / "random-llama", args.hidden, args.layers, sampled_eos=True)
    rows, runs = [], {}
    for adapter in (True, False):
        r = arm(model_path, adapter, args.rank, args.rounds)
        runs[r["mode"]] = r
        rows.append(
            [
                r["mode"],
                f"{r['sync'] * 1e3:.1f}",
                f"{r['first'] * 1e3:.1f}",
                f"{r['again'] * 1e3:.1f}",
                f"{(r['sync'] + r['first'] - r['again']) * 1e3:.1f}",
            ]
        )
    print(
        f"random Llama hidden {args.hidden} x {args.layers} layers: {r['params'] / 1e6:.1f}M parameters, LoRA rank {args.rank}: {r['lora'] / 1e6:.2f}M"
    )
    print(
        common.fmt_table(
            rows, ["sync", "sync_weights ms", "next generate (4 x 1 token) ms", "the one after ms", "sync cost ms (sync + next - after)"]
        )
    )
    ceiling = common.Ceiling(r["config"], decode_rows=sum(p for p, _ in r["groups"]), passes=False)
    ceiling.gen = [c for x in runs.values() for c in x["ceiling"]]
    sides = {mode: [{"gen": t} for t in x["after"]] for mode, x in runs.items()}
    print("the generate after the sync (the prompts' forward; LoRA's own FLOPs not counted):")
    print(common.roofline_table(r["config"], [r["groups"]] * args.rounds, sides, ceiling))


if __name__ == "__main__":
    main()
