"""Router replay for mixture-of-experts models (issue #38 item 2; docs/moe.md).

An MoE block sends each token x to the k experts its router picks and mixes their outputs:

    z = W_r x                      # router logits, one per expert (E)
    p = softmax(z)                 # the DENSE probabilities over all E experts, in float32
    S = top_k(p)                   # the chosen experts, k indices
    w_j = p_j (/ sum_{i in S} p_i when norm_topk_prob)   for j in S
    y = sum_{j in S} w_j * expert_j(x)

The rollout engine and the trainer can pick different S for the same token (other kernels, other batch shapes,
weights one step apart), so the trainer scores a token through experts that never produced it. Router replay
records S once and forces it in the training forwards: R2 records in the old-log-prob pass, R3 at rollout.
The weights w_j of the recorded experts are gathered from the dense p, so dL/dW_r flows through p even where the
router would now pick other experts; gathering them from the post-top-k scores (zero outside the current top-k)
would read exact zeros there and cut the router's gradient.

`RouterReplay(model, "record")` records, `RouterReplay(model, "replay", routing)` forces, `"compare"` measures
without forcing. Routing is a (rows, T, layers, k) integer tensor aligned with input_ids, so it is sliced by rows
like the batch's other tensors (DataProto.split, index); -1 marks a position with no record (the router picks).
Routers are the modules with `top_k`, `num_experts`, `norm_topk_prob` and a `weight`, returning
(router_logits, top-k weights, top-k indices): transformers 5's Qwen3-MoE `Qwen3MoeTopKRouter` and its kin.
"""

from __future__ import annotations

import torch

from .errors import ConfigError


def routers(model) -> list[torch.nn.Module]:
    """The model's routers in layer order (one per MoE layer); ConfigError when it has none."""
    found = [m for m in model.modules() if all(hasattr(m, a) for a in ("top_k", "num_experts", "norm_topk_prob", "weight"))]
    if not found:
        raise ConfigError(f"router replay: {type(model).__name__} has no MoE router (top-k router module); use an MoE model")
    return found


class RouterReplay:
    """Context manager that hooks every router of `model`.

    mode "record": each forward call appends its routing; `routing(rows, length)` returns (rows, T, layers, k),
        the calls concatenated along the sequence (a decode loop's prefill, then one column per step).
    mode "replay": every forward's layer l uses routing[:, :, l] (the rows and positions of this forward's input);
        the layer is found by the router module, not by call order, so checkpointing's recompute replays the same.
    mode "compare": the router picks; only the metrics are counted.
    Metrics per layer, over recorded positions (index >= 0): `disagreement()`, the share of tokens whose experts
    used in the forward differ (as a set) from the recorded ones (0 under replay); `drift()`, the share whose
    router's own top-k differs from the recorded set (what replay hides)."""

    def __init__(self, model, mode: str = "record", routing: torch.Tensor | None = None):
        if mode not in ("record", "replay", "compare"):
            raise ConfigError(f"router replay mode {mode!r}: choose record, replay or compare")
        if mode != "record" and routing is None:
            raise ConfigError(f"router replay mode {mode!r} needs the recorded routing")
        self.model, self.mode, self.routing_in = model, mode, routing
        self.layers = {id(r): i for i, r in enumerate(routers(model))}
        self.calls: list[list[torch.Tensor | None]] = []  # record: per forward call, per layer (b, s, k)
        self.used = torch.zeros(len(self.layers))
        self.drifted = torch.zeros(len(self.layers))
        self.counted = torch.zeros(len(self.layers))
        self.handles = []

    def __enter__(self):
        self.handles.append(self.model.register_forward_pre_hook(self._on_model_call, with_kwargs=True))
        for r in routers(self.model):
            self.handles.append(r.register_forward_hook(self._on_router))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _on_model_call(self, module, args, kwargs):
        if self.mode != "record":
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        self.shape = tuple(ids.shape[:2])  # (b, s) of this call
        self.calls.append([None] * len(self.layers))

    def _on_router(self, router, args, output):
        layer = self.layers[id(router)]
        logits, _, own = output  # logits (N, E) with their graph; own (N, k), the router's top-k
        if self.mode == "record":
            self.calls[-1][layer] = own.detach().reshape(*self.shape, -1).cpu()
            return None
        rec = self.routing_in[:, :, layer].reshape(-1, own.shape[1]).to(own.device)  # (N, k)
        if rec.shape[0] != own.shape[0]:
            raise ConfigError(f"router replay: routing has {rec.shape[0]} tokens, the forward {own.shape[0]}; slice it like input_ids")
        known = (rec >= 0).all(-1)  # (N,) positions with a record
        used = torch.where(known[:, None], rec, own) if self.mode == "replay" else own
        self._count(layer, known, used, own, rec)
        if self.mode == "compare":
            return None
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # the dense p over all E experts
        weights = probs.gather(1, used)  # p_j at the replayed experts: a gradient even where j is not in top_k(p)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), used

    def _count(self, layer, known, used, own, rec):
        def differs(a):
            return (a.sort(-1).values != rec.sort(-1).values).any(-1) & known

        self.used[layer] += differs(used).sum().item()
        self.drifted[layer] += differs(own).sum().item()
        self.counted[layer] += known.sum().item()

    def disagreement(self) -> torch.Tensor:
        """(layers,) share of recorded tokens whose experts used in the forward differ from the recorded set."""
        return self.used / self.counted.clamp(min=1)

    def drift(self) -> torch.Tensor:
        """(layers,) share of recorded tokens whose router's own top-k differs from the recorded set."""
        return self.drifted / self.counted.clamp(min=1)

    def routing(self, rows: int | None = None, length: int | None = None) -> torch.Tensor:
        """The recorded routing (rows, T, layers, k), int64: the forward calls concatenated along the sequence.
        A call on rows/n rows (rollout.py's shared prefill: one per group of n) is repeated n times per row;
        positions past the last call up to `length` are -1 (a decode loop never feeds its last sampled token)."""
        rows = rows or self.calls[0][0].shape[0]
        cols = []
        for call in self.calls:
            c = torch.stack(call, dim=2)  # (b, s, layers, k)
            if c.shape[0] != rows:
                if rows % c.shape[0]:
                    raise ConfigError(f"router replay: a forward on {c.shape[0]} of {rows} rows; record decode with drop_finished=None")
                c = c.repeat_interleave(rows // c.shape[0], dim=0)
            cols.append(c)
        out = torch.cat(cols, dim=1)
        if length is not None and length > out.shape[1]:
            out = torch.cat([out, out.new_full((rows, length - out.shape[1], *out.shape[2:]), -1)], dim=1)
        return out
