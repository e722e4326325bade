"""MoE routing ops on Hopper (CuTe): index_shuffling, gather_scale_dense_tokens,
scatter_add_dense_tokens, against torch references written here (sm_90 GPUs).

Op signatures (MSLK's, plus ``config=``):
  index_shuffling(scores, expert_index_start=None, expert_index_end=None, valid_token_count=None,
                  top_k=1) -> (counts [E + 2] int32, expert_indices [T * top_k] int32,
                               token_indices [T * top_k] int32)
  gather_scale_dense_tokens(x, token_indices, expert_indices, scores, valid_token_count=None) -> out
  scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count=None) -> None

Checks:
  index_shuffling: counts against torch.topk; each expert's tokens as a set against torch.topk
    (scores have no ties, so the top-k is unique); then the exact order (the kernel sorts each
    expert's tokens ascending, deterministically).
  gather: bit-exact (one fp32 multiply, rounded once, as the reference).
  scatter: exact in fp32 on small-integer data (order-independent sums); otherwise, for the
    atomic method, within the atomics' rounding: each of the k additions into a token rounds to
    the dtype, so |out - ref| <= (k + 1) * u * (|out0| + sum |y|), u = 2^-8 (bf16), 2^-11 (fp16),
    2^-24 (fp32); for the sorted method (fp32 sums, rounded once) within half an ulp of the result
    plus the fp32 summation error. Both methods run every scatter test.
Every config of every template runs on a few shapes (one signature each, to keep compiles few);
the other signatures (dtypes, unaligned rows, valid_token_count, strided scores) run with the
default config; the default config also runs over
T in {1, 3, 1000, 16384}, hidden in {5120, 7168, 8192}, E in {8, 16, 128}, top_k in {1, 2, 4, 8}.
"""
import itertools

import pytest
import torch

from mslk_dsl import ops, registry
from mslk_dsl.template import config_name
from mslk_dsl.testing import skipUnlessCudaCapability

hopper = skipUnlessCudaCapability((9, 0))

TOKENS = (1, 3, 1000, 16384)
HIDDEN = (5120, 7168, 8192)
EXPERTS = (8, 16, 128)
TOP_K = (1, 2, 4, 8)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _cases(op, sigs):
    (t,) = registry.get_templates(op=op, backend="cute")
    return [(sig, c) for sig in sigs for c in t.valid_configs("sm90a", sig)]


def _case_id(case):
    sig, config = case
    return "-".join(str(v) for v in sig.values()) + "-" + config_name(config)


# ------------------------------------------------------------------ index_shuffling
def _scores(t, e, dtype, seed, column_major=False):
    """Every row a random permutation of distinct multiples of 1/8 (exact in bf16): no ties."""
    g = _gen(seed)
    perm = torch.argsort(torch.rand(t, e, device="cuda", generator=g), dim=1)
    s = ((perm - e // 2).float() / 8).to(dtype)
    return s.t().contiguous().t() if column_major else s


def _check_index_shuffling(t, e, k, dtype=torch.bfloat16, start=None, end=None, n_valid=None,
                           column_major=False, config=None):
    scores = _scores(t, e, dtype, seed=t * 7 + e * 3 + k, column_major=column_major)
    valid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32, device="cuda")
    counts, exp_idx, tok_idx = ops.index_shuffling(scores, start, end, valid, top_k=k, config=config)
    lo, hi, n = start or 0, e if end is None else end, t if n_valid is None else n_valid
    what = f"index_shuffling T={t} E={e} k={k} {dtype} [{lo},{hi}) n={n} {config}"
    assert counts.shape == (e + 2,) and counts.dtype == torch.int32, what
    assert exp_idx.shape == (t * k,) and tok_idx.shape == (t * k,), what

    top = torch.topk(scores[:n].float(), k, dim=1).indices.flatten()
    tok = torch.arange(n, device="cuda").repeat_interleave(k)
    keep = (top >= lo) & (top < hi)
    ref_counts = torch.bincount(top[keep], minlength=e)
    ref_keys = torch.sort(top[keep] * t + tok[keep]).values
    total = int(ref_keys.numel())
    assert torch.equal(counts[:e].long(), ref_counts), what
    assert counts[e].item() == t and counts[e + 1].item() == total, what
    got_e = exp_idx[:total].long() + lo
    got_keys = got_e * t + tok_idx[:total].long()
    # Grouped by expert, segment sizes = counts; then the tokens of each expert as a set.
    assert torch.equal(got_e, torch.repeat_interleave(torch.arange(e, device="cuda"), ref_counts)), what
    assert torch.equal(torch.sort(got_keys).values, ref_keys), what
    assert torch.equal(got_keys, ref_keys), what + ": tokens of an expert not in increasing order"


@hopper
@pytest.mark.parametrize("t,e,k", [c for c in itertools.product(TOKENS, EXPERTS, TOP_K) if c[2] <= c[1]])
def test_index_shuffling_shapes(t, e, k):
    _check_index_shuffling(t, e, k)


@hopper
@pytest.mark.parametrize("case", _cases("index_shuffling", [
    {"score_dtype": "bfloat16", "has_valid_count": False}]), ids=_case_id)
def test_index_shuffling_every_config(case):
    sig, config = case
    dtype = getattr(torch, sig["score_dtype"])
    for t, e, k in ((3, 8, 8), (1000, min(128, config["max_experts"]), 4),
                    (2049, config["max_experts"], 8), (20000, config["max_experts"] // 2 + 3, 2)):
        _check_index_shuffling(t, e, k, dtype, config=config)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_shuffling_options(dtype):
    _check_index_shuffling(1000, 16, 4, dtype, start=1, end=9)          # a rank's local experts
    _check_index_shuffling(1000, 128, 2, dtype, n_valid=617)            # padded tokens
    _check_index_shuffling(4096, 128, 8, dtype, start=32, end=64, n_valid=4000)
    _check_index_shuffling(1000, 16, 1, dtype, n_valid=0)
    _check_index_shuffling(3000, 256, 8, dtype, column_major=True)      # E = 256, strided scores
    # E = 320 (one of MSLK's expert counts): the 512-expert config, 9-bit expert fields.
    _check_index_shuffling(5000, 320, 8, dtype, n_valid=4321)
    _check_index_shuffling(20000, 320, 4, dtype, start=64, end=300)
    _check_index_shuffling(1, 320, 1, dtype)
    # T within one route step: the single-block kernel, with each option.
    _check_index_shuffling(100, 128, 8, dtype, start=32, end=64, n_valid=77)
    _check_index_shuffling(64, 16, 2, dtype, column_major=True, n_valid=0)
    _check_index_shuffling(1, 256, 8, dtype, start=5, end=250)


# ------------------------------------------------------------------ gather_scale_dense_tokens
def _routing(t, e, k, seed):
    g = _gen(seed)
    tok = torch.randperm(t * k, device="cuda", generator=g) % t
    exp = torch.randint(0, e, (t * k,), device="cuda", generator=g)
    return tok.to(torch.int32), exp.to(torch.int32)


def _check_gather(t, d, k=2, e=16, dtype=torch.bfloat16, score_dtype=torch.bfloat16, n_valid=None,
                  column_major=False, config=None, x_offset=0):
    """x_offset: x starts that many elements past a 16-byte boundary."""
    g = _gen(t + d)
    store = torch.randn(t * d + x_offset, device="cuda", generator=g).to(dtype)
    x = store[x_offset:].view(t, d)
    scores = torch.rand(e, t, device="cuda", generator=g).to(score_dtype).t()    # column-major
    if not column_major:
        scores = scores.contiguous()
    tok, exp = _routing(t, e, k, seed=t * 3 + d)
    valid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32, device="cuda")
    if n_valid is not None:   # padding rows may hold any index: the kernel must not follow them
        tok[n_valid:], exp[n_valid:] = 2 ** 31 - 1, -7
    out = ops.gather_scale_dense_tokens(x, tok, exp, scores, valid, config=config)
    n = t * k if n_valid is None else n_valid
    ref = (x[tok[:n].long()].float() * scores[tok[:n].long(), exp[:n].long()].float()[:, None]).to(dtype)
    assert out.shape == (t * k, d) and out.dtype == dtype
    assert torch.equal(out[:n], ref), f"gather T={t} D={d} k={k} {dtype} {score_dtype} n={n} {config}"


@hopper
@pytest.mark.parametrize("t,d", list(itertools.product(TOKENS, HIDDEN)))
def test_gather_shapes(t, d):
    _check_gather(t, d)


@hopper
@pytest.mark.parametrize("case", _cases("gather_scale_dense_tokens", [
    {"dtype": "bfloat16", "score_dtype": "bfloat16", "vec_bytes": 16, "has_valid_count": False}]), ids=_case_id)
def test_gather_every_config(case):
    sig, config = case
    for t, d in ((1, 8), (3, 5120), (1000, 7168), (300, 1000), (37, 136)):
        _check_gather(t, d, config=config)
    _check_gather(300, 1000, k=3, n_valid=451, config=config)   # a block of rows ends past n


@hopper
def test_gather_options():
    for dtype, score_dtype in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                                (torch.bfloat16, torch.float32)):
        _check_gather(1000, 5120, k=4, dtype=dtype, score_dtype=score_dtype, column_major=True)
    _check_gather(1000, 5121, k=8)                       # odd rows: one element per access
    for dtype in (torch.bfloat16, torch.float16):        # 8-byte accesses (D a multiple of 4, not 8), 4-byte ones
        _check_gather(1000, 5124, k=8, dtype=dtype)
        _check_gather(37, 140, k=2, dtype=dtype)
        _check_gather(1000, 5122, k=8, dtype=dtype)
        _check_gather(37, 138, k=2, dtype=dtype)
    _check_gather(1000, 5122, k=2, dtype=torch.float32)  # fp32 rows of 8 bytes: two elements per access
    _check_gather(1000, 5121, k=2, dtype=torch.float32)  # fp32 rows of 4 bytes: one element per access
    _check_gather(1000, 4100, k=1, dtype=torch.float32)  # 16-byte rows, D not a multiple of 8
    _check_gather(1000, 5120, k=8, n_valid=3333)         # padded rows are left alone
    _check_gather(1000, 5120, k=8, n_valid=0)


@hopper
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("unroll", (1, 4, 8))
def test_gather_phased_rows(dtype, unroll):
    """Rows of one element per access are gathered phased: each out row's aligned middle from the
    two 16-byte loads around its source, shifted into place, the head and tail one element at a
    time. Every width 1-40 (rows with no middle, a middle and no edge, both edges) and long odd
    ones (40001: several chunks a row), x at each element offset from a 16-byte boundary (even
    widths too then take one element per access), few rows and many, valid_token_count;
    bit-exact against the reference."""
    config = {"unroll": unroll}
    per_16 = 128 // torch.finfo(dtype).bits   # elements in 16 bytes
    for d in list(range(1, 41)) + [93, 1001, 5121]:
        for x_offset in range(per_16):
            _check_gather(37, d, k=3, dtype=dtype, x_offset=x_offset, config=config)
    for d in (7, 333, 4097, 40001):
        _check_gather(20000 if d < 40000 else 200, d, k=2, dtype=dtype, x_offset=3 % per_16, config=config)
        _check_gather(1001, d, k=3, dtype=dtype, n_valid=1500, config=config)


# ------------------------------------------------------------------ scatter_add_dense_tokens
def _scatter_config(method, t, a):
    """The heuristic's config for the method (None: the heuristic's own choice) with T = t
    tokens and A = a rows; a width (and, for atomics, a token count of one row each) that forces
    the method."""
    if method is None:
        return None
    (tpl,) = registry.get_templates(op="scatter_add_dense_tokens", backend="cute")
    sig = {"dtype": "bfloat16", "vec_bytes": 16, "has_valid_count": False}
    atomic = method == "atomic"
    config = tpl.heuristic("sm90a", sig, {"A": a, "D": 1 if atomic else 1 << 40, "T": a if atomic else t})
    if method in ("sorted", "linked"):   # the large-input config's unroll and pdl, this method
        assert config["method"] in ("sorted", "linked")
        return {**config, "method": method}
    assert config["method"] == method
    return config


def _check_scatter(t, d, k, dtype=torch.bfloat16, integers=False, n_valid=None, config=None, tok=None,
                   method=None):
    """tok: the rows' destination tokens (default: each token k times, in random order); entries
    outside [0, t) must be skipped. method: force "atomic", "sorted" or "linked" (default: heuristic)."""
    g = _gen(t * 5 + d + k)
    if tok is None:
        tok, _ = _routing(t, 1, k, seed=t + k)
    a = tok.shape[0]
    if integers:   # small integers: every summation order gives the same fp32 result
        out0 = torch.randint(-8, 8, (t, d), device="cuda", generator=g).to(dtype)
        y = torch.randint(-8, 8, (a, d), device="cuda", generator=g).to(dtype)
    else:
        out0 = torch.randn(t, d, device="cuda", generator=g).to(dtype)
        y = torch.randn(a, d, device="cuda", generator=g).to(dtype)
    config = config or _scatter_config(method, t, a)
    out = out0.clone()
    valid = None if n_valid is None else torch.tensor([n_valid], dtype=torch.int32, device="cuda")
    assert ops.scatter_add_dense_tokens(out, y, tok, valid, config=config) is None
    n = a if n_valid is None else n_valid
    keep = (tok[:n] >= 0) & (tok[:n] < t)
    idx = tok[:n][keep].long()
    ref = out0.double().index_add(0, idx, y[:n][keep].double())
    what = f"scatter T={t} D={d} k={k} {dtype} n={n} {config}"
    if integers:
        assert torch.equal(out, ref.to(dtype)), what
        return
    mag = out0.double().abs().index_add(0, idx, y[:n][keep].double().abs())
    rows = torch.bincount(idx, minlength=t).double()[:, None]      # additions per out row
    err = (out.double() - ref).abs()
    if (config or {}).get("method") in ("sorted", "linked"):
        # fp32 sums, one rounding to the dtype: half an ulp of the result plus fp32 error.
        bound = UNIT_ROUNDOFF[dtype] * ref.abs() * 1.0001 + (rows + 1) * 2.0 ** -24 * mag
    else:   # each atomic addition rounds to the dtype
        bound = (rows + 1) * UNIT_ROUNDOFF[dtype] * mag
    bound = bound + 1e-30
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item()}"


@hopper
@pytest.mark.parametrize("t,d", list(itertools.product(TOKENS, HIDDEN)))
def test_scatter_shapes(t, d):
    _check_scatter(t, d, k=2)
    for method in ("atomic", "sorted", "linked"):
        _check_scatter(t, d, k=2, method=method)


@hopper
@pytest.mark.parametrize("method", ("atomic", "sorted", "linked"))
def test_scatter_irregular_tokens(method):
    """Tokens that get no rows, one token that gets most rows, and out-of-range indices."""
    g = _gen(7)
    t = 777
    tok = torch.randint(0, t // 3, (5000,), device="cuda", generator=g, dtype=torch.int32)
    tok[::3] = 5                                        # a hot token: ~1700 rows
    tok[7], tok[100], tok[4001] = -1, t, 2 ** 31 - 1    # skipped
    _check_scatter(t, 1024, 1, torch.float32, integers=True, tok=tok, method=method)
    _check_scatter(t, 1000, 1, torch.bfloat16, tok=tok, method=method)
    _check_scatter(t, 1024, 1, torch.float32, integers=True, tok=tok, n_valid=3000, method=method)
    one = torch.zeros(4096, dtype=torch.int32, device="cuda")      # T = 1: every row to token 0
    _check_scatter(1, 2048, 1, torch.float32, integers=True, tok=one, method=method)
    # More tokens than one tile of the sorted method's scan (32768 counts), not a multiple of it.
    _check_scatter(70001, 64, 2, torch.float32, integers=True, method=method)


@hopper
@pytest.mark.parametrize("t, a, d", [(1, 56424, 1), (336, 257923, 34), (9, 150, 64), (5, 4000, 4096)])
def test_tokens_of_many_rows_get_fp32_sums(t, a, d):
    """Tokens that receive 16 or more rows each on average (two random calls: 56424 rows into
    one token of one element, 257923 rows into 336 tokens of 34) take the linked method at any
    size, so each out element rounds once: within one bf16 ulp of the exact sum (plus 2^-20 of
    the sum of magnitudes for the fp32 additions), where bf16 atomics, rounding after every row,
    were 1.75 off at 48.25 (7 ulps)."""
    from mslk_dsl.ops import declaration, validate

    g = _gen(a + d)
    out0 = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.randn(a, d, device="cuda", generator=g).to(torch.bfloat16)
    tok = torch.randint(0, t, (a,), device="cuda", dtype=torch.int32, generator=g)
    sig = (validate.vector_bytes(out0, y), "bfloat16", False)
    _, config, _ = declaration.get("scatter_add_dense_tokens").kernels.choose("sm90a", sig, (a, d, t), None)
    assert config["method"] == "linked", config
    out = out0.clone()
    assert ops.scatter_add_dense_tokens(out, y, tok) is None        # the op's own choice
    ref = out0.double().index_add(0, tok.long(), y.double())
    mag = out0.double().abs().index_add(0, tok.long(), y.double().abs())
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -100))) - 7)
    err = (out.double() - ref).abs()
    bound = ulp + 2.0 ** -20 * mag
    assert bool((err <= bound).all()), f"T={t} A={a} D={d}: largest error {float(err.max())}"


@hopper
@pytest.mark.parametrize("k", TOP_K)
def test_scatter_top_k(k):
    for method in ("atomic", "sorted", "linked"):
        _check_scatter(1000, 5120, k, torch.float32, integers=True, method=method)
        _check_scatter(1000, 5120, k, torch.bfloat16, method=method)
        _check_scatter(1000, 5120, k, torch.float16, method=method)
        _check_scatter(1000, 5120, k, torch.float32, method=method)


@hopper
@pytest.mark.parametrize("case", _cases("scatter_add_dense_tokens", [
    {"dtype": "float32", "vec_bytes": 16, "has_valid_count": False}]), ids=_case_id)
def test_scatter_every_config(case):
    sig, config = case
    for t, d in ((1, 8), (3, 5120), (1000, 7168), (300, 1000), (37, 132)):
        _check_scatter(t, d, 4, torch.float32, integers=True, config=config)


@hopper
def test_scatter_options():
    for method in ("atomic", "sorted", "linked"):
        _check_scatter(1000, 5121, 4, torch.bfloat16, method=method)                      # odd rows
        _check_scatter(1000, 5124, 4, torch.bfloat16, method=method)                      # 8-byte accesses
        _check_scatter(1000, 5122, 4, torch.bfloat16, method=method)                      # 4-byte accesses
        _check_scatter(300, 140, 8, torch.float16, method=method)
        _check_scatter(1000, 5122, 4, torch.float32, integers=True, method=method)        # fp32, 8 bytes
        _check_scatter(300, 138, 8, torch.float16, method=method)
        _check_scatter(1000, 5121, 4, torch.float32, integers=True, method=method)
        _check_scatter(1000, 5120, 4, torch.float32, integers=True, n_valid=2222, method=method)
        _check_scatter(1000, 5120, 4, torch.bfloat16, n_valid=0, method=method)


@hopper
@pytest.mark.parametrize("d", (1, 6, 8, 72, 93, 146, 264, 520))
def test_short_rows_share_blocks(d):
    """Rows narrower than a block's threads share blocks (the gather and the sorted / linked
    reductions, by token): every row and every vector of it, blocks whose last rows lie past the
    last row or token, few rows (unroll 1) and many, valid_token_count."""
    for t, k in ((1, 1), (7, 2), (1001, 3), (40001, 2)):
        _check_gather(t, d, k=k)
        for method in ("atomic", "sorted", "linked"):
            _check_scatter(t, d, k, torch.bfloat16, method=method)
    _check_gather(1001, d, k=3, n_valid=1500)
    _check_gather(1001, d, k=2, dtype=torch.float32)
    for method in ("sorted", "linked"):
        _check_scatter(1001, d, 3, torch.float32, integers=True, method=method)
        _check_scatter(1001, d, 3, torch.float32, integers=True, n_valid=1500, method=method)


@hopper
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("d", (1, 2, 3, 93, 1000, 5121))
def test_scatter_word_pairs(dtype, d):
    """The atomic method on rows of one 16-bit element per access adds aligned words of two
    halves (BF16x2 / F16x2), a half outside the row adding -0.0: out one element into its
    storage (rows that start mid-word: every other row for odd widths, every row for even
    ones), exact integer sums, -0.0 kept bit for bit where nothing is added, skipped tokens,
    and the elements either side of out untouched."""
    g = _gen(d)
    t, k = 301, 3
    store = torch.full((t * d + 2,), -0.0, dtype=dtype, device="cuda")
    out = store[1:1 + t * d].view(t, d)
    out.copy_(torch.randint(-8, 8, (t, d), device="cuda", generator=g).to(dtype))
    out.view(-1)[::7] = -0.0
    tok = torch.randint(0, t // 2, (t * k,), device="cuda", generator=g, dtype=torch.int32)  # rows t // 2.. get none
    tok[5], tok[17] = -1, t
    y = torch.randint(-8, 8, (t * k, d), device="cuda", generator=g).to(dtype)
    keep = (tok >= 0) & (tok < t)
    ref = out.double().index_add(0, tok[keep].long(), y[keep].double()).to(dtype)
    before = store.clone()
    assert ops.scatter_add_dense_tokens(out, y, tok, config=_scatter_config("atomic", t, t * k)) is None
    bits = torch.int16
    assert torch.equal(out.view(bits), ref.view(bits)), f"d={d} {dtype}"
    assert torch.equal(store[[0, -1]].view(bits), before[[0, -1]].view(bits))


@hopper
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("unroll", (1, 2, 4, 8))
@pytest.mark.parametrize("method", ("atomic", "linked"))
def test_scatter_phased_rows(dtype, unroll, method):
    """The atomic and linked methods on rows of one element per access, phased: each out row's
    aligned middle in 16-byte vectors (vector atomics, or one fp32 sum per vector) of the input
    rows' bytes shifted into place, its head and tail by edge words (atomic, 16-bit: a half
    outside the row adding -0.0) or elements. Every width 1-40 and long odd ones (40001: several
    chunks a row), out and y each at every element offset from a 16-byte boundary (even widths
    too then take one element per access), exact integer sums, -0.0 kept bit for bit where
    nothing is added, skipped tokens, and the elements either side of out untouched."""
    config = {"unroll": unroll, "method": method, "pdl": method == "linked"}
    per_16 = 128 // torch.finfo(dtype).bits   # elements in 16 bytes
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    g = _gen(unroll)
    shapes = [(61, d, 3, off) for d in list(range(1, 41)) + [93, 1001, 5121] for off in range(per_16)]
    shapes += [(20000, 333, 2, 3 % per_16), (3001, 4097, 1, 1), (1001, 7, 8, 0), (200, 40001, 2, 1)]
    for t, d, k, off in shapes:
        store = torch.full((t * d + 2 * per_16,), -0.0, dtype=dtype, device="cuda")
        out = store[off:off + t * d].view(t, d)
        out.copy_(torch.randint(-8, 8, (t, d), device="cuda", generator=g).to(dtype))
        out.view(-1)[::7] = -0.0
        y_off = (3 * off + 1) % per_16
        y = torch.randint(-8, 8, (t * k * d + y_off,), device="cuda", generator=g).to(dtype)[y_off:].view(t * k, d)
        tok = torch.randint(0, max(t // 2, 1), (t * k,), device="cuda", generator=g, dtype=torch.int32)
        tok[min(5, t * k - 1)] = -1
        tok[-1] = t
        keep = (tok >= 0) & (tok < t)
        ref = out.double().index_add(0, tok[keep].long(), y[keep].double()).to(dtype)
        before = store.clone()
        assert ops.scatter_add_dense_tokens(out, y, tok, config=config) is None
        assert torch.equal(out.view(bits), ref.view(bits)), f"T={t} D={d} k={k} out+{off} y+{y_off} {dtype}"
        outside = torch.ones_like(store, dtype=torch.bool)
        outside[off:off + t * d] = False
        assert torch.equal(store[outside].view(bits), before[outside].view(bits)), f"D={d} out+{off}: outside written"


# ------------------------------------------------------------------ the three together
@hopper
@pytest.mark.parametrize("k", (1, 4))
def test_moe_round_trip(k):
    """route -> gather (scaled) -> identity experts -> scatter-add = x * sum of its top-k scores."""
    t, e, d = 1000, 16, 5120
    x = torch.randn(t, d, device="cuda", generator=_gen(1))
    scores = torch.sigmoid(_scores(t, e, torch.float32, seed=2))
    counts, exp_idx, tok_idx = ops.index_shuffling(scores, top_k=k)
    y = ops.gather_scale_dense_tokens(x, tok_idx, exp_idx, scores)
    out = torch.zeros_like(x)
    ops.scatter_add_dense_tokens(out, y, tok_idx)
    ref = x * torch.topk(scores, k, dim=1).values.sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
