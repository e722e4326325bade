"""Attention forward: ``attention_fwd``, the one kernel op behind ``mslk_dsl.attention``.

Layout as in MSLK (``mslk.attention.fmha``): q [B, Mq, Hq, K], k [B, Mk, Hkv, K], v [B, Mk, Hkv,
Kv], out [B, Mq, Hq, Kv] in q's dtype, and the log-sum-exp of each query row's scaled scores, lse
fp32 [B, Hq, Mq] (natural log). Head dims (K, Kv): the kernels are built for (d, d) with d in 64,
96, 128, 192, 256 and for (192, 128), DeepSeek-V2/V3's MLA prefill; any other K and Kv up to 256
run at the smallest of those that holds them, on copies padded with zeros of the tensors whose
head dim that changes (q and k, or v and out; zero columns add nothing to q . k and give zero
output columns), at the cost of the copies and of the padded columns' FLOPs. GQA / MQA: Hq a multiple of Hkv; query head h reads
key/value head h // (Hq // Hkv), and k and v are never expanded in memory.

Packed variable-length sequences ("varlen", MSLK's BlockDiagonal biases): B = 1, q [1, total_q,
Hq, K], k and v [1, total_k, Hkv, K or Kv], and ``seqstart_q`` / ``seqstart_k`` int32 device tensors of
n + 1 cumulative offsets (sequence s holds rows seqstart[s]:seqstart[s + 1]); masks apply per
sequence. ``max_seqlen_q`` / ``max_seqlen_k`` are optional hints (the longest sequence) that
kernels sized by them may use; the prefill kernel reads the offsets on the device.

Masks, per sequence, with i a query row, j a key row, Mq / Mk the sequence's lengths and
d = j - i - (Mk - Mq if bottom_right else 0): key j is visible to row i when
    (not causal or d <= 0) and (window_left < 0 or d >= -window_left)
                           and (window_right < 0 or d <= window_right).
``bottom_right=False`` aligns the diagonal with the top-left corner (MSLK's LowerTriangularMask),
True with the bottom-right one (LowerTriangularFromBottomRightMask, and the local masks). A row
with no visible key gets out = 0 and lse = -inf. ``scale`` defaults to 1 / sqrt(K).

Launch plans are off for this op: the kernel depends on the mask arguments' values, which plans
do not look at (a plan matches layouts only), and a launch costs microseconds next to the kernel.
"""
from __future__ import annotations

import math

import torch

from mslk_dsl.errors import InputError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Fixed, Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name, placeholder, sm_count
from mslk_dsl.templates import _attention_limits as limits

OP = "attention_fwd"
MASK_NONE, MASK_CAUSAL, MASK_LOCAL = (limits.MASKS.index(m) for m in ("none", "causal", "local"))


def kernel_head_dims(op: str, K: int, Kv: int) -> tuple[int, int]:
    """The head dims of the kernel that runs q / k rows of K and v rows of Kv: (K, Kv) itself, or
    the pair the op pads them to; InputError past the largest."""
    dims = limits.covering_head_dims(K, Kv) if K > 0 and Kv > 0 else None
    if dims is None:
        raise InputError(f"{op}: head dims {K} (q, k) and {Kv} (v) are not supported: each must be 1 to "
                         f"{max(limits.HEAD_DIMS)}; kernels are built for (q / k, v) "
                         f"{', '.join(f'({d}, {dv})' for d, dv in limits.HEAD_DIM_PAIRS)}, other dims run padded")
    return dims


def _check_qkv(op: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check.tensor(op, name, t, check.HALF_DTYPES, ndim=4)
    check.same_dtype(op, "k", k, q.dtype, "q")
    check.same_dtype(op, "v", v, q.dtype, "q")
    check.same_device(op, "q", q, k=k, v=v)
    B, Mq, Hq, K = q.shape
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise InputError(f"{op}: k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must have the "
                         f"same batch, key rows and heads")
    dims = kernel_head_dims(op, K, v.shape[3])
    if k.shape[0] != B or k.shape[3] != K:
        raise InputError(f"{op}: k has shape {tuple(k.shape)}; expected [B={B}, Mk, Hkv, K={K}] for q of "
                         f"shape {tuple(q.shape)}")
    Hkv = k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"{op}: q has {Hq} heads and k / v {Hkv}; the query heads must be a multiple of the "
                         f"key/value heads (GQA / MQA)")
    if max(Mq, k.shape[1]) >= limits.MAX_SEQLEN:
        raise InputError(f"{op}: sequences longer than {limits.MAX_SEQLEN - 1} rows are not supported")
    per = limits.STRIDE_ALIGN_BYTES // q.element_size()
    # A tensor whose head dim the op pads is copied for the kernel (any strides do); the others
    # reach it as they are.
    for name, t in _as_given(dims, (K, v.shape[3]), q, k, v):
        # TMA reads rows of K elements: each stride but the last must keep rows 16-byte aligned.
        if any(s % per for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1) or \
                t.data_ptr() % limits.STRIDE_ALIGN_BYTES:
            raise InputError(f"{op}: {name} must start on a 16-byte boundary and have strides that are "
                             f"multiples of {per} elements (16 bytes) in its first three dimensions, got "
                             f"strides {t.stride()}; pass a contiguous copy")


def _as_given(dims, given, q, k, v) -> list:
    """(name, tensor) of q, k and v that reach the kernel as they are: those whose head dim the
    kernel's ``dims`` equal (the others are zero-padded copies)."""
    return [(name, t) for name, t, d, g in (("q", q, dims[0], given[0]), ("k", k, dims[0], given[0]),
                                            ("v", v, dims[1], given[1])) if d == g]


def _check_seqstarts(op: str, q, k, seqstart_q, seqstart_k) -> None:
    if (seqstart_q is None) != (seqstart_k is None):
        raise InputError(f"{op}: seqstart_q and seqstart_k go together (packed variable-length sequences)")
    if seqstart_q is None:
        return
    for name, t in (("seqstart_q", seqstart_q), ("seqstart_k", seqstart_k)):
        check.tensor(op, name, t, (torch.int32,), ndim=1)
        check.same_device(op, "q", q, **{name: t})
    if seqstart_q.shape != seqstart_k.shape or seqstart_q.shape[0] < 2:
        raise InputError(f"{op}: seqstart_q {tuple(seqstart_q.shape)} and seqstart_k {tuple(seqstart_k.shape)} "
                         f"must both hold n + 1 >= 2 offsets (n sequences)")
    if q.shape[0] != 1:
        raise InputError(f"{op}: packed sequences (seqstart_q / seqstart_k) take B = 1, got q of shape "
                         f"{tuple(q.shape)}")


def _check_attention(q, k, v, seqstart_q=None, seqstart_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, bottom_right=False, window_left=-1, window_right=-1, scale=None):
    op = OP
    _check_qkv(op, q, k, v)
    _check_seqstarts(op, q, k, seqstart_q, seqstart_k)
    masked = causal or window_left >= 0 or window_right >= 0
    if seqstart_q is not None and masked and not bottom_right:
        raise InputError(f"{op}: for packed sequences a mask's diagonal is aligned bottom-right "
                         f"(bottom_right=True); top-left is the same where each sequence's q and k "
                         f"lengths are equal (the mslk_dsl.attention biases decide that on the host)")
    if scale is not None and not math.isfinite(scale):
        raise InputError(f"{op}: scale must be finite, got {scale}")


def _attention_outputs(q, k, v, seqstart_q=None, seqstart_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       causal=False, bottom_right=False, window_left=-1, window_right=-1, scale=None):
    B, Mq, Hq, _ = q.shape
    return [((B, Mq, Hq, v.shape[3]), q.dtype), ((B, Hq, Mq), torch.float32)]


def kernel_window(causal: bool, bottom_right: bool, window_left: int, window_right: int,
                  Mq: int, Mk: int) -> tuple[int, int, int]:
    """(mask family index, left, right) as the kernels take them: the band
    -left <= j - i - (Mk - Mq) <= right around the bottom-right diagonal, a side without a bound
    as UNBOUNDED_WINDOW. A top-left diagonal shifts the band by Mk - Mq."""
    big = limits.UNBOUNDED_WINDOW
    left = big if window_left < 0 else window_left
    right = big if window_right < 0 else window_right
    if causal:
        right = min(right, 0)
    if not bottom_right:  # a bounded side moves with the diagonal; an unbounded one stays so
        left = left if left >= big else left + (Mk - Mq)
        right = right if right >= big else right - (Mk - Mq)
    if left >= big and right >= big:
        return MASK_NONE, big, big
    if left >= big and right == 0:
        return MASK_CAUSAL, big, 0
    return MASK_LOCAL, left, right


def _prepare_attention(select, outputs, q, k, v, seqstart_q=None, seqstart_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, causal=False, bottom_right=False, window_left=-1, window_right=-1,
                       scale=None):
    out, lse = outputs
    B, Mq, Hq, K = q.shape
    Mk, Hkv, Kv = k.shape[1], k.shape[2], v.shape[3]
    if out.numel() == 0:
        return None
    if Mk == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return None
    varlen = seqstart_q is not None
    # Packed sequences are masked bottom-right (checked): no shift by the packed lengths.
    mask, left, right = kernel_window(causal, bottom_right or varlen, window_left, window_right, Mq, Mk)
    sm_scale = 1.0 / math.sqrt(K) if scale is None else float(scale)
    dims = kernel_head_dims(OP, K, Kv)
    kernel, _ = select((dtype_name(q.dtype), *dims), (B, Mq, Mk, Hq, Hkv, mask, int(varlen)))
    dev = q.device
    kernel_out = out
    if dims[0] != K:   # head dims no kernel is built for: zero-padded copies (see the module's docstring)
        q, k = (torch.nn.functional.pad(t, (0, dims[0] - K)) for t in (q, k))
    if dims[1] != Kv:
        v = torch.nn.functional.pad(v, (0, dims[1] - Kv))
        kernel_out = torch.empty(B, Mq, Hq, dims[1], dtype=out.dtype, device=dev)
    if varlen:
        args = (q[0], k[0], v[0], kernel_out[0], lse[0], seqstart_q, seqstart_k)
    else:
        args = (q, k, v, kernel_out, lse, placeholder(dev, torch.int32), placeholder(dev, torch.int32))
    # The scalars follow from the layout (K, Mq, Mk, packed or not) and the plan_values: see Fixed;
    # the SM count bounds the grid of persistent kernels.
    launch = Launch(kernel, (*args, Fixed(sm_scale), Fixed(left), Fixed(right), Fixed(sm_count(dev))))
    if dims == (K, Kv):
        return launch
    # The copies live for this call only (never in a plan); out is filled from the padded one.
    copies = (*((q, k) if dims[0] != K else ()), *((v, kernel_out) if dims[1] != Kv else ()))
    finish = None if kernel_out is out else (lambda: out.copy_(kernel_out[..., :Kv]))
    return launch._replace(scratch=copies, finish=finish, plannable=False)


def visible_keys(mq: int, mk: int, causal=False, bottom_right=False, window_left=-1, window_right=-1,
                 device="cpu") -> torch.Tensor:
    """[mq, mk] bool: which keys each query of one sequence sees under the op's mask arguments
    (the diagonal at the top-left or bottom-right corner; windows counted from it; -1: none)."""
    i = torch.arange(mq, device=device)[:, None]
    j = torch.arange(mk, device=device)[None, :]
    d = j - i - ((mk - mq) if bottom_right else 0)
    visible = torch.ones(mq, mk, dtype=torch.bool, device=device)
    if causal:
        visible &= d <= 0
    if window_left >= 0:
        visible &= d >= -window_left
    if window_right >= 0:
        visible &= d <= window_right
    return visible


def attention_reference(q, k, v, seqstart_q=None, seqstart_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        causal=False, bottom_right=False, window_left=-1, window_right=-1, scale=None):
    """The op in fp32 torch: (out in q's dtype, lse fp32), each sequence on its own."""
    B, Mq, Hq, K = q.shape
    sm_scale = 1.0 / math.sqrt(K) if scale is None else float(scale)
    if seqstart_q is None:
        bounds = [(b, 0, Mq, 0, k.shape[1]) for b in range(B)]
    else:
        sq, sk = seqstart_q.tolist(), seqstart_k.tolist()
        bounds = [(0, sq[s], sq[s + 1], sk[s], sk[s + 1]) for s in range(len(sq) - 1)]
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Mq), float("-inf"), dtype=torch.float32, device=q.device)
    group = Hq // k.shape[2]
    for b, q0, q1, k0, k1 in bounds:
        qs = q[b, q0:q1].float().transpose(0, 1)                                # [Hq, mq, K]
        ks = k[b, k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)    # [Hq, mk, K]
        vs = v[b, k0:k1].float().transpose(0, 1).repeat_interleave(group, 0)
        mq, mk = q1 - q0, k1 - k0
        visible = visible_keys(mq, mk, causal, bottom_right, window_left, window_right, q.device)
        s = (qs @ ks.transpose(1, 2)) * sm_scale
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)                                   # [Hq, mq]
        p = torch.exp(s - row_lse[..., None].clamp_min(torch.finfo(torch.float32).min))
        p = torch.nan_to_num(p, nan=0.0)
        out[b, q0:q1] = (p @ vs).transpose(0, 1)
        lse[b, :, q0:q1] = row_lse
    return out.to(q.dtype), lse


def _random_problem(rng) -> dict:
    """B to 8 sequences (packed or not) of Mq queries and Mk keys (each to 4096), Hkv of 1-8 key
    heads and 1-8 query heads per key head, any mask family; at most 2**27 scores."""
    def one(r):
        hkv = r.choice((1, 2, 4, 8))
        return {"B": draw.log_int(r, 1, 8), "Mq": draw.log_int(r, 1, 4096), "Mk": draw.log_int(r, 1, 4096),
                "Hkv": hkv, "Hq": hkv * r.choice((1, 2, 4, 8)), "mask": r.randrange(len(limits.MASKS)),
                "varlen": r.randrange(2)}
    return draw.within(rng, one, lambda p: p["B"] * p["Hq"] * p["Mq"] * p["Mk"], 1 << 27)


def _attention_example(problem: dict, sig: dict, device) -> tuple:
    """q, k, v for B x Mq / Mk rows, Hq / Hkv heads, N(0, 1) values (with problem["varlen"], B
    sequences of Mq / Mk rows packed); the mask from problem["mask"] (an index into the mask
    families: 1 bottom-right causal, 2 a 256-row sliding window)."""
    dtype = getattr(torch, sig.get("dtype", "bfloat16"))
    K = sig.get("head_dim", 128)
    Kv = sig.get("head_dim_v", K)
    B, Mq = problem.get("B", 1), problem.get("Mq", 128)
    Mk, Hq, Hkv = problem.get("Mk", Mq), problem.get("Hq", 4), problem.get("Hkv", problem.get("Hq", 4))
    packed = bool(problem.get("varlen", 0))
    rows = (1, B * Mq, B * Mk) if packed else (B, Mq, Mk)
    q = torch.randn(rows[0], rows[1], Hq, K, device=device, dtype=dtype)
    k = torch.randn(rows[0], rows[2], Hkv, K, device=device, dtype=dtype)
    v = torch.randn(rows[0], rows[2], Hkv, Kv, device=device, dtype=dtype)
    starts: tuple = (None, None, None, None)
    if packed:
        starts = (torch.arange(B + 1, device=device, dtype=torch.int32) * Mq,
                  torch.arange(B + 1, device=device, dtype=torch.int32) * Mk, Mq, Mk)
    mask = problem.get("mask", MASK_NONE)
    window = (256, 0) if mask == MASK_LOCAL else (-1, -1)
    return q, k, v, *starts, mask == MASK_CAUSAL, True, *window, None


attention_fwd = declare(OpDecl(
    name=OP,
    schema="(Tensor q, Tensor k, Tensor v, Tensor? seqstart_q=None, Tensor? seqstart_k=None, "
           "int? max_seqlen_q=None, int? max_seqlen_k=None, bool causal=False, bool bottom_right=False, "
           "int window_left=-1, int window_right=-1, float? scale=None) -> (Tensor, Tensor)",
    doc=__doc__.split("\n\n", 1)[1],
    check=_check_attention, outputs=_attention_outputs, prepare=_prepare_attention,
    signature=("dtype", "head_dim", "head_dim_v"), problem=("B", "Mq", "Mk", "Hq", "Hkv", "mask", "varlen"),
    example=_attention_example, reference=attention_reference, tolerance=(2e-2, 2e-2),
    # The mask arguments choose the kernel (its mask family) and its window scalars.
    plan_values=("causal", "bottom_right", "window_left", "window_right", "scale"),
    small_problem={"B": 2, "Mq": 17, "Mk": 33, "Hq": 4, "Hkv": 2, "mask": MASK_CAUSAL, "varlen": 0},
    random_problem=_random_problem, long_sums=True))
