"""A whole decoder layer through mslk-dsl's ops: rmsnorm -> QKV GEMM -> attention -> output GEMM
-> rmsnorm_add -> MoE (routed SwiGLU experts and a shared one), first as a prefill of packed
sequences, then as decode steps against a paged KV cache, and the decode step again as a CUDA
graph replay. What the op tests do not see: ops fed by each other's outputs, q / k / v as strided
views of one QKV GEMM output, a cache written by the caller between calls.

Each block is checked against an fp32 torch reference fed the same input (the MoE block on the
layer's own bf16 activations: a rounding difference upstream could flip a near-tied top-k pick and
make the comparison meaningless). Tolerance: relative Frobenius error 2e-2 (bf16 outputs at every
op; P rounded to bf16 inside attention). Head dims 64 and 96 (Phi-3's); RoPE, a plain elementwise
op, is left out.
"""
import math

import pytest
import torch

from mslk_dsl import ops
from mslk_dsl.attention import memory_efficient_attention_forward
from mslk_dsl.attention.attn_bias import BlockDiagonalCausalMask, PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
from mslk_dsl.moe import MoE
from mslk_dsl.ops.attention import attention_reference
from mslk_dsl.ops.attention_decode import decode_reference
from mslk_dsl.ops.norm import _rmsnorm_reference
from mslk_dsl.testing import skipUnlessCudaCapability
from test_moe_layer import _need_grouped_ops, _rel, _same_up_to_atomic_order, reference_layer

SM90 = skipUnlessCudaCapability((9, 0))
bf16 = torch.bfloat16
DIM, HQ, HKV, EXPERTS, TOP_K, HIDDEN = 1024, 16, 4, 8, 2, 512
LENGTHS = [1, 17, 300]   # packed prefill sequences
PAGE, CAPACITY = 16, 320  # the cache: pages of 16 keys, room for 320 keys per sequence
REL_TOL = 2e-2


class DecoderLayer:
    """The layer's weights and its forward through mslk-dsl ops, in two halves around the
    attention call of a step (prefill or decode), which the test makes."""

    def __init__(self, head_dim: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.head_dim = head_dim
        qkv_rows = (HQ + 2 * HKV) * head_dim

        def uniform(*shape, fan_in):
            return ((torch.rand(*shape, device="cuda", generator=g) * 2 - 1) / math.sqrt(fan_in)).to(bf16)

        self.attn_norm = (1 + 0.1 * torch.randn(DIM, device="cuda", generator=g)).to(bf16)
        self.ffn_norm = (1 + 0.1 * torch.randn(DIM, device="cuda", generator=g)).to(bf16)
        self.w_qkv = uniform(qkv_rows, DIM, fan_in=DIM)
        self.w_o = uniform(DIM, HQ * head_dim, fan_in=HQ * head_dim)
        torch.manual_seed(seed)
        self.moe = MoE(DIM, HIDDEN, num_experts=EXPERTS, top_k=TOP_K, shared_expert=True, device="cuda")
        self.moe_weights = {n: p.detach().clone() for n, p in self.moe.named_parameters()}

    def qkv(self, x):
        """q [1, T, HQ, d], k / v [1, T, HKV, d]: views of one GEMM output (rows of
        (HQ + 2 HKV) d elements, so no view is contiguous)."""
        d, T = self.head_dim, x.shape[0]
        qkv = ops.bf16_gemm(ops.rmsnorm(x, self.attn_norm), self.w_qkv)
        q, k, v = qkv.split([HQ * d, HKV * d, HKV * d], dim=-1)
        return q.view(1, T, HQ, d), k.view(1, T, HKV, d), v.view(1, T, HKV, d)

    def finish(self, x, attn):
        """The rest of the layer after attention: (output, the MoE block's input y, the residual)."""
        a = ops.bf16_gemm(attn.reshape(x.shape[0], -1), self.w_o)
        y, residual = ops.rmsnorm_add(a, x, self.ffn_norm)
        return residual + self.moe(y), y, residual


def _check_rest(layer, x, attn, got):
    """The blocks after attention, each against fp32 torch fed the layer's own inputs."""
    out, y, residual = got
    a = attn.reshape(x.shape[0], -1).float() @ layer.w_o.float().T
    assert _rel(residual, a + x.float()) < REL_TOL
    assert _rel(y, _rmsnorm_reference(a + x.float(), layer.ffn_norm)) < REL_TOL
    assert _rel(out, residual.float() + reference_layer(layer.moe_weights, y, TOP_K, fp8=False)) < REL_TOL


def _paged_cache(layer, k, v, starts, generator):
    """A paged cache (shuffled pages, spares included) holding the k / v of each packed sequence
    (rows ``starts[b]:starts[b + 1]``), and its block table [B, CAPACITY / PAGE]."""
    d, B, per_seq = layer.head_dim, len(starts) - 1, CAPACITY // PAGE
    pages = B * per_seq + 5
    k_cache = torch.zeros(pages, PAGE, HKV, d, device="cuda", dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(pages, generator=generator)[: B * per_seq].view(B, per_seq).to("cuda", torch.int32)
    for b in range(B):
        _write(k_cache, v_cache, table, b, 0, k[0, starts[b]:starts[b + 1]], v[0, starts[b]:starts[b + 1]])
    return k_cache, v_cache, table


def _write(k_cache, v_cache, table, b, at, k, v):
    """Keys / values [n, HKV, d] of sequence b into its cache positions at, at + 1, ..."""
    pos = torch.arange(at, at + k.shape[0], device="cuda")
    page, slot = table[b, pos // PAGE].long(), pos % PAGE
    k_cache[page, slot], v_cache[page, slot] = k, v


@SM90
@pytest.mark.parametrize("head_dim", [64, 96])
def test_decoder_layer_prefill_then_decode(head_dim):
    _need_grouped_ops()
    layer = DecoderLayer(head_dim, seed=head_dim)
    g = torch.Generator(device="cuda").manual_seed(1)
    T = sum(LENGTHS)
    x = torch.randn(T, DIM, device="cuda", generator=g).to(bf16)

    # prefill: the packed sequences under one block-diagonal causal mask
    q, k, v = layer.qkv(x)
    assert not q.is_contiguous()
    bias = BlockDiagonalCausalMask.from_seqlens(LENGTHS)
    attn = memory_efficient_attention_forward(q, k, v, bias)
    seqs = bias.q_seqinfo   # the packed sequences' row offsets
    want, _ = attention_reference(q, k, v, seqs.seqstart, seqs.seqstart, causal=True)
    assert _rel(attn, want) < REL_TOL
    _check_rest(layer, x, attn, layer.finish(x, attn))

    # decode: two steps, one new token per sequence, against the paged cache
    k_cache, v_cache, table = _paged_cache(layer, k, v, seqs.seqstart_py, torch.Generator().manual_seed(2))
    lengths = list(LENGTHS)
    B = len(lengths)
    for step in range(2):
        xt = torch.randn(B, DIM, device="cuda", generator=g).to(bf16)
        qt, kt, vt = layer.qkv(xt)
        for b in range(B):
            _write(k_cache, v_cache, table, b, lengths[b], kt[0, b:b + 1], vt[0, b:b + 1])
        lengths = [n + 1 for n in lengths]
        kv_seqlen = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        bias = PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1] * B, kv_seqlen, table, PAGE)
        attn = memory_efficient_attention_forward(qt, k_cache, v_cache, bias)
        want, _ = decode_reference(qt.reshape(B, 1, HQ, layer.head_dim), k_cache, v_cache, kv_seqlen, table)
        assert _rel(attn, want.reshape(attn.shape)) < REL_TOL, (head_dim, step)
        _check_rest(layer, xt, attn, layer.finish(xt, attn))


@SM90
def test_decoder_layer_decode_step_replays_in_a_cuda_graph():
    """One decode step (every op of the layer) captured once; replays with new tokens and the
    device-side lengths changed in place give eager's results (up to the order of the MoE
    scatter's atomic adds)."""
    _need_grouped_ops()
    layer = DecoderLayer(96, seed=5)
    B, d = 4, 96
    g = torch.Generator(device="cuda").manual_seed(3)
    pages = B * (CAPACITY // PAGE)
    k_cache = torch.randn(pages, PAGE, HKV, d, device="cuda", generator=g).to(bf16)
    v_cache = torch.randn(pages, PAGE, HKV, d, device="cuda", generator=g).to(bf16)
    table = torch.randperm(pages, device="cuda", generator=g).view(B, -1).to(torch.int32)
    kv_seqlen = torch.tensor([5, 100, 1, 300], dtype=torch.int32, device="cuda")
    xt = torch.randn(B, DIM, device="cuda", generator=g).to(bf16)

    def step():
        qt, _, _ = layer.qkv(xt)
        bias = PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1] * B, kv_seqlen, table, PAGE)
        return layer.finish(xt, memory_efficient_attention_forward(qt, k_cache, v_cache, bias))[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):   # compiles / loads every kernel and makes the plans outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([17, 1, 320, 64], [300, 299, 2, 33]):
        kv_seqlen.copy_(torch.tensor(lengths, dtype=torch.int32))
        xt.copy_(torch.randn(B, DIM, device="cuda", generator=g).to(bf16))
        graph.replay()
        eager = step()
        _same_up_to_atomic_order(out, eager)
