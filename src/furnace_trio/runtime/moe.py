"""The mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE) and its counters.

A router scores every expert for every token; each token runs only its ``top_k`` experts.
The work is batched per expert, not per token::

    router  logits [T, E] -> softmax (float32) -> top_k weights w [T, k], experts i [T, k]
            (w renormalized to sum 1 where the model does: Mixtral, Qwen3-MoE)
    group   the T * k (token, expert) pairs sorted by expert (stable: tokens in order)
    run     per expert with tokens: gather its rows of x, one gate/up product, SiLU, one
            down product, times w, scatter-added into the output rows
    shared  (Qwen2-MoE) out += sigmoid(x . g) * shared_mlp(x), for every token

So a decode step of ``n`` sequences reads at most ``min(E, n * k)`` experts' weights, and
each expert read once, however many of the step's tokens chose it. The experts are the
builder's linear layers (:meth:`~furnace_trio.runtime.layers.WeightSource.linear`): native
quantized ones under ``FURNACE_QUANT`` (a GGUF's blocks kept where a kernel takes them),
float ones otherwise. The router and the shared expert's gate stay float: a rounded router
would pick other experts than the model's own.

Counting: every layer adds its ``bincount`` of the chosen experts (already computed to
group the tokens) to a row of one ``[layers, experts]`` tensor on the model's device
(:class:`ExpertCounter`); the runner folds it into a host copy after each served step,
which is what ``/metrics`` reads (``furnace_expert_tokens_total{layer,expert}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from furnace_trio.loading.model_config import ModelConfig

if TYPE_CHECKING:
    from furnace_trio.runtime.layers import WeightSource

__all__ = ["ExpertCounter", "GatedMLP", "SparseMoE"]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up fused: one expert, or the shared one."""

    def __init__(self, weights: WeightSource, prefix: str, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        self.gate_up_proj = weights.linear("gate_up_proj", names)
        self.down_proj = weights.linear("down_proj", [f"{prefix}.down_proj.weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """One layer's sparse feed-forward (see the module docstring); ``counts``: the row of
    :class:`ExpertCounter` this layer adds its tokens per expert to (``None``: uncounted)."""

    def __init__(self, config: ModelConfig, weights: WeightSource, prefix: str) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoE needs a config with experts")
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.router = nn.Parameter(weights.tensor(f"{prefix}.mlp.gate.weight"), requires_grad=False)
        self.experts = nn.ModuleList(
            GatedMLP(weights, f"{prefix}.mlp.experts.{e}", moe.intermediate_size)
            for e in range(moe.num_experts)
        )
        self.shared: GatedMLP | None = None
        self.shared_gate: nn.Parameter | None = None
        if moe.shared_intermediate_size:
            self.shared = GatedMLP(
                weights, f"{prefix}.mlp.shared_expert", moe.shared_intermediate_size
            )
            gate = weights.tensor(f"{prefix}.mlp.shared_expert_gate.weight").reshape(1, -1)
            self.shared_gate = nn.Parameter(gate, requires_grad=False)
        self.counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts ``[T, k]`` (int64) and their weights ``[T, k]`` (x's dtype)."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        flat = chosen.reshape(-1)
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        if self.counts is not None:
            self.counts.add_(per_expert)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # the token of each (token, expert) pair, by expert
        scale = weights.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(per_expert.tolist()):  # one host copy of E counts per layer
            if n == 0:
                continue
            at = rows[start : start + n]
            h = self.experts[e](x.index_select(0, at)) * scale[start : start + n]
            out.index_add_(0, at, h)
            start += n
        if self.shared is not None and self.shared_gate is not None:
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out


class ExpertCounter:
    """Tokens routed to each expert of each sparse layer, over the steps a server ran.

    ``live`` ``[layers, experts]`` (int64, the model's device) is where the layers add
    their per-step counts; :meth:`collect` folds it into ``total``, a host tensor that no
    one writes in place (a fresh one per fold), so another thread may read the last one
    whole while the next step runs; :meth:`discard` drops counts of steps that served no
    one (warm-up, logits for tests). Dense layers' rows stay zero.
    """

    def __init__(self, layers: Sequence[SparseMoE | None], device: torch.device) -> None:
        experts = max(layer.num_experts for layer in layers if layer is not None)
        self.live = torch.zeros((len(layers), experts), dtype=torch.int64, device=device)
        self.sparse = tuple(layer is not None for layer in layers)
        for i, layer in enumerate(layers):
            if layer is not None:
                layer.counts = self.live[i, : layer.num_experts]
        self.total = torch.zeros((len(layers), experts), dtype=torch.int64)

    @staticmethod
    def attach(model: nn.Module) -> ExpertCounter | None:
        """A counter over ``model``'s sparse layers (``None`` when it has none)."""
        layers = [getattr(layer, "mlp", None) for layer in getattr(model, "layers", ())]
        sparse = [m if isinstance(m, SparseMoE) else None for m in layers]
        if not any(sparse):
            return None
        device = next(m for m in sparse if m is not None).router.device
        return ExpertCounter(sparse, device)

    def collect(self) -> None:
        self.total = self.total + self.live.cpu()
        self.live.zero_()

    def discard(self) -> None:
        self.live.zero_()

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """Tokens per (layer, expert), one tuple per layer (empty for dense layers)."""
        total = self.total.tolist()
        return tuple(tuple(row) if s else () for row, s in zip(total, self.sparse, strict=True))
