"""A mixture-of-experts feed-forward layer built from mslk_dsl's ops, with the single-GPU semantics
of MSLK's BaselineMoE (mslk/moe/layers.py):

    scores  = sigmoid(tokens @ router)                                   [T, E]
    experts = the top_k experts of each token by score (ties to the lower expert)
    out     = shared(tokens) + sum over a token's experts e of  expert_e(scores[t, e] * tokens[t])
    expert(x) = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T           (SwiGLU)

Note that, as in MSLK, the router score scales the expert's input, not its output. The shared
expert is optional. Two precisions: bf16 weights, or FP8 row-wise weights (one scale per output
row; the activations are quantized per row on the fly: MSLK's f8f8bf16_rowwise recipe).

The forward pass, with no host synchronization (torch.compile fullgraph and CUDA-graph capture
work; every shape depends only on T, E, top_k, D, H):

    index_shuffling -> gather_scale_dense_tokens            -> grouped gate, grouped up (bf16)
                    -> silu_mul                             -> grouped down
                    -> scatter_add_dense_tokens into the shared expert's output
    FP8: gather_scale_quant_dense_tokens (gather, score, quantize in one pass) and silu_mul_quant
         feed the FP8 grouped GEMMs, so no bf16 activation is written between the GEMMs.

The grouped GEMMs are bf16bf16bf16_grouped_stacked(x, w [G, N, K], M_sizes) and
f8f8bf16_rowwise_grouped_stacked(xq, wq, x_scale, w_scale [G, N], M_sizes), called like every
other op of the layer (``_op``: the eager functions, served by their launch plans, and the torch
ops while torch.compile traces); M_sizes are the per-expert counts index_shuffling leaves on the
GPU. Gate and up are two grouped GEMMs rather
than one over MSLK's concatenated w13: silu_mul takes two compact [A, H] inputs, and the halves of
one [A, 2H] output are strided views (a copy each). MSLK's w13 [E, 2H, D] splits as
w13[:, :H] = w_gate, w13[:, H:] = w_up; its w2 [E, D, H] is w_down.
"""
from __future__ import annotations

import math

import torch

from mslk_dsl import ops
from mslk_dsl.errors import InputError, InputTypeError, StateError

BF16, FP8_ROWWISE = "bf16", "fp8_rowwise"


_op = ops.traceable


def _grouped_bf16(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    return _op("bf16bf16bf16_grouped_stacked")(x, w, m_sizes)


def _grouped_fp8(xq, wq, x_scale, w_scale, m_sizes) -> torch.Tensor:
    return _op("f8f8bf16_rowwise_grouped_stacked")(xq, wq, x_scale, w_scale, m_sizes)


class MoE(torch.nn.Module):
    """Routed SwiGLU experts (plus an optional shared one) over tokens [..., dim].

    Parameters (bf16): ``router`` [dim, E]; ``w_gate``, ``w_up`` [E, hidden, dim]; ``w_down``
    [E, dim, hidden]; with ``shared_expert``: ``shared_w_gate``, ``shared_w_up`` [hidden, dim],
    ``shared_w_down`` [dim, hidden]. ``quantize_fp8_rowwise_()`` turns the expert weights into
    FP8 with per-row scales (``<name>_scale``, [E, N] or [N]); the router stays bf16."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, shared_expert: bool = True,
                 device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if dtype != torch.bfloat16:
            raise InputTypeError(f"MoE: dtype {dtype} is not supported; the expert GEMMs take bf16 (or FP8)")
        if not 1 <= top_k <= num_experts:
            raise InputError(f"MoE: top_k={top_k} must be in 1..num_experts={num_experts}")
        for name, size in (("dim", dim), ("hidden_dim", hidden_dim)):
            if size <= 0 or size % 16:
                raise InputError(f"MoE: {name}={size} must be a positive multiple of 16 (the FP8 GEMMs' K)")
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, num_experts, top_k
        self.precision = BF16
        kw = {"device": device, "dtype": dtype}
        E, D, H = num_experts, dim, hidden_dim
        self.router = torch.nn.Parameter(torch.empty(D, E, **kw))
        self.w_gate = torch.nn.Parameter(torch.empty(E, H, D, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(E, H, D, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(E, D, H, **kw))
        self.has_shared_expert = shared_expert
        if shared_expert:
            self.shared_w_gate = torch.nn.Parameter(torch.empty(H, D, **kw))
            self.shared_w_up = torch.nn.Parameter(torch.empty(H, D, **kw))
            self.shared_w_down = torch.nn.Parameter(torch.empty(D, H, **kw))
        self.reset_parameters()

    def expert_weight_names(self) -> list[str]:
        names = ["w_gate", "w_up", "w_down"]
        return names + (["shared_w_gate", "shared_w_up", "shared_w_down"] if self.has_shared_expert else [])

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform in +-1/sqrt(fan_in) (every GEMM's output then has about the input's scale)."""
        if self.precision != BF16:
            raise StateError("MoE: reset_parameters on FP8 weights; build a new layer instead")
        for name in ["router", *self.expert_weight_names()]:
            p = getattr(self, name)
            fan_in = p.shape[0] if name == "router" else p.shape[-1]
            p.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    @torch.no_grad()
    def quantize_fp8_rowwise_(self) -> MoE:
        """Replace the expert weights by FP8 (the device's flavour) with one fp32 scale per output
        row (quantize_fp8_row over each row of K); forward then runs the FP8 path. In place."""
        if self.precision == FP8_ROWWISE:
            return self
        for name in self.expert_weight_names():
            wq, scale = ops.quantize_fp8_row(getattr(self, name).detach())
            delattr(self, name)
            self.register_buffer(name, wq)
            self.register_buffer(name + "_scale", scale)
        self.precision = FP8_ROWWISE
        return self

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise InputError(f"MoE: x has last dimension {x.shape[-1]}, expected dim={self.dim}")
        if x.dtype != torch.bfloat16:
            raise InputTypeError(f"MoE: x has dtype {x.dtype}; expected torch.bfloat16")
        tokens = x.reshape(-1, self.dim)
        if tokens.shape[0] == 0:
            return torch.zeros_like(x)
        scores = torch.sigmoid(tokens @ self.router)
        counts, expert_indices, token_indices = _op("index_shuffling")(scores, top_k=self.top_k)
        m_sizes = counts[: self.num_experts]  # per-expert row counts, left on the GPU
        if self.precision == FP8_ROWWISE:
            routed = self._routed_fp8(tokens, scores, token_indices, expert_indices, m_sizes)
            out = self._shared_fp8(tokens) if self.has_shared_expert else torch.zeros_like(tokens)
        else:
            routed = self._routed_bf16(tokens, scores, token_indices, expert_indices, m_sizes)
            out = self._shared_bf16(tokens) if self.has_shared_expert else torch.zeros_like(tokens)
        _op("scatter_add_dense_tokens")(out, routed, token_indices)
        return out.view(x.shape)

    def _routed_bf16(self, tokens, scores, token_indices, expert_indices, m_sizes) -> torch.Tensor:
        rows = _op("gather_scale_dense_tokens")(tokens, token_indices, expert_indices, scores)
        z = _op("silu_mul")(_grouped_bf16(rows, self.w_gate, m_sizes), _grouped_bf16(rows, self.w_up, m_sizes))
        return _grouped_bf16(z, self.w_down, m_sizes)

    def _routed_fp8(self, tokens, scores, token_indices, expert_indices, m_sizes) -> torch.Tensor:
        xq, xs = _op("gather_scale_quant_dense_tokens")(tokens, token_indices, expert_indices, scores)
        gate = _grouped_fp8(xq, self.w_gate, xs, self.w_gate_scale, m_sizes)
        up = _grouped_fp8(xq, self.w_up, xs, self.w_up_scale, m_sizes)
        zq, zs = _op("silu_mul_quant")(gate, up)
        return _grouped_fp8(zq, self.w_down, zs, self.w_down_scale, m_sizes)

    def _shared_bf16(self, tokens) -> torch.Tensor:
        z = _op("silu_mul")(_op("bf16_gemm")(tokens, self.shared_w_gate), _op("bf16_gemm")(tokens, self.shared_w_up))
        return _op("bf16_gemm")(z, self.shared_w_down)

    def _shared_fp8(self, tokens) -> torch.Tensor:
        xq, xs = _op("quantize_fp8_row")(tokens)
        gate = _op("f8f8bf16_rowwise")(xq, self.shared_w_gate, xs, self.shared_w_gate_scale)
        up = _op("f8f8bf16_rowwise")(xq, self.shared_w_up, xs, self.shared_w_up_scale)
        zq, zs = _op("silu_mul_quant")(gate, up)
        return _op("f8f8bf16_rowwise")(zq, self.shared_w_down, zs, self.shared_w_down_scale)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, shared_expert={self.has_shared_expert}, precision={self.precision}")
