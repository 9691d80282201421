"""FP8 GEMMs in a `transformers` model: the embedded engine's rollout.quantization.

    layers = quantize_model(model, "fp8_block")   # swaps the GEMM modules in place
    load_checkpoint_tensors(model, ...)           # a weight sync writes the high-precision weights
    for layer in layers: layer.requantize()       # ... and the engine quantizes them again

Every `nn.Linear` of the decoder and every fused experts module (`gate_up_proj [E, 2I, H]`,
`down_proj [E, H, I]`, transformers 5) is replaced by a module that keeps the same parameters
(same names, the engine's dtype: a weight sync loads them as before) and holds their FP8
quantization (precision/fp8.py), made by `requantize`. Its forward quantizes the input
dynamically, runs the block-scaled FP8 GEMM in fp32 (`scaled_gemm`) and returns the engine's
dtype, as vLLM's FP8 linear and fused-MoE methods do (bias added in fp32 before the cast).

Kept in the engine's dtype, as vLLM serves FP8 models (its Fp8Config quantizes linear layers,
the fused experts and optionally the KV cache; FP8 checkpoints such as DeepSeek-V3's and
Qwen3's leave the router out): the LM head and the embeddings (not linear layers in vLLM), the
norms, the attention's own products (QK^T, softmax, PV), and every router or gate that picks
experts (a linear module named `gate` or `*_gate`: MoE routers, Qwen2-MoE's shared-expert gate).

In the experts, the hidden states are quantized once for all tokens and the gate/up outputs
once for all (token, expert) rows, as vLLM's fused MoE quantizes its two inputs; with per-token
or per-block formats this is the same as quantizing per expert, with fp8_tensor the scale is
that of the whole batch (as in vLLM, samples then depend on what else is in the batch, padding
included). Memory: the FP8 copy beside the high-precision weights (+50% for bf16 weights).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_rl.precision.fp8 import FP8_FORMATS, Fp8Format, Quantized, scaled_gemm


def fp8_linear(x: torch.Tensor, w: Quantized, fmt: Fp8Format, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any dtype) -> [..., N] fp32: the FP8 GEMM of dynamically quantized x and w."""
    lead = x.shape[:-1]
    y = scaled_gemm(fmt.quantize_activation(x.reshape(-1, x.shape[-1])), w)
    if bias is not None:
        y = y + bias.float()
    return y.view(*lead, y.shape[-1])


class Fp8Linear(nn.Module):
    """An nn.Linear whose GEMM runs in FP8 (`weight` [N, K] and `bias` are the original parameters)."""

    def __init__(self, linear: nn.Linear, fmt: Fp8Format):
        super().__init__()
        self.fmt = fmt
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        self.qweight = self.fmt.quantize_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qweight, self.fmt, self.bias).to(x.dtype)


class Fp8Experts(nn.Module):
    """transformers 5's fused experts (forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]) with FP8 GEMMs; the same parameters and expert loop."""

    def __init__(self, experts: nn.Module, fmt: Fp8Format):
        super().__init__()
        self.fmt = fmt
        self.num_experts = experts.num_experts
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        self.qgate_up = [self.fmt.quantize_weight(w) for w in self.gate_up_proj]
        self.qdown = [self.fmt.quantize_weight(w) for w in self.down_proj]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dtype = hidden_states.dtype
        out = torch.zeros_like(hidden_states)
        xq = self.fmt.quantize_activation(hidden_states)
        hits = []  # (expert, top-k slot, token rows)
        inter = []
        for e in top_k_index.unique().tolist():
            if e >= self.num_experts:  # transformers' marker of a slot no local expert takes
                continue
            token_idx, top_k_pos = torch.where(top_k_index == e)
            gate, up = scaled_gemm(_rows(xq, token_idx), self.qgate_up[e]).to(dtype).chunk(2, dim=-1)
            inter.append(self.act_fn(gate) * up)
            hits.append((e, top_k_pos, token_idx))
        if not hits:
            return out
        hq = self.fmt.quantize_activation(torch.cat(inter))
        start = 0
        for e, top_k_pos, token_idx in hits:
            rows = torch.arange(start, start + len(token_idx), device=token_idx.device)
            start += len(token_idx)
            h = scaled_gemm(_rows(hq, rows), self.qdown[e]).to(dtype)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(dtype))
        return out


def _rows(q: Quantized, idx: torch.Tensor) -> Quantized:
    """The rows idx of a quantized activation (per-row scales follow; a per-tensor scale is shared)."""
    if q.scale.shape[0] == 1 and q.rows >= q.values.shape[0]:
        return Quantized(q.values[idx], q.scale, max(len(idx), 1), q.group)
    return Quantized(q.values[idx], q.scale[idx], 1, q.group)


def _is_router(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last == "gate" or last.endswith("_gate")


def quantize_model(model: nn.Module, fmt: str) -> list[nn.Module]:
    """Swap the GEMM modules of `model` for FP8 ones in format `fmt` (FP8_FORMATS), in place;
    returns them (call `requantize` on each after the weights change)."""
    spec = FP8_FORMATS.get(fmt)
    head = model.get_output_embeddings()
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is head or _is_router(name):
            continue
        if type(module) is nn.Linear:
            swaps.append((name, Fp8Linear(module, spec)))
        elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3:
            if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False):
                raise ValueError(f"{name}: rollout.quantization handles experts without bias in [E, 2I, H] layout, "
                                 f"not {type(module).__name__}")
            swaps.append((name, Fp8Experts(module, spec)))
    for name, new in swaps:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return [m for _, m in swaps]
