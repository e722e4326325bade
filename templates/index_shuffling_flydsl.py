"""MoE routing: top-k experts per token and the token indices grouped by expert, for ROCm
(FlyDSL), gfx942 / gfx950.

Same op, semantics, calling convention and algorithm as index_shuffling_cute.py (which follows
meta-pytorch/MSLK ``torch.ops.mslk.index_shuffling``):

    kernel(scores, valid_count, counts, expert_indices, token_indices, ws_slots, ws_hist,
           top_k, expert_start, expert_end)

scores [T, E] bf16/fp32; valid_count [1] int32 (a dummy unless sig["has_valid_count"]);
counts [E + 2], expert_indices / token_indices [T * top_k] int32 outputs; ws_slots [T * top_k]
and ws_hist [MAX_CHUNKS * E] int32 workspaces (MAX_CHUNKS = 128, torch.empty); int32 scalars
top_k (1..min(8, E)), expert_start, expert_end. E <= config["max_experts"] <= 256. Outputs as in
the CuTe template: deterministic, tokens ascending within each expert.
Difference from the CuTe template: scores must have a unit column stride (row-major; the op layer
makes column-major scores contiguous), since FlyDSL specializes a kernel on its unit-stride dim;
for the same reason E >= 2 (torch gives a [T, 1] tensor unit strides on both dimensions; the op
layer adds a second expert scored -inf, outside the routed range, for E = 1).

Route: a group of ``lanes`` threads of a 64-wide wave holds a token's packed keys
(orderable score bits << 8 | 255 - e) and takes k rounds of butterfly max; each wave ranks its
selections per expert in token order in its own LDS histogram; the waves' counts are scanned.
Place: per-expert prefix sums over the chunks, then the scatter of the ranked slots.
"""
from mslk_dsl.template import Template

SCORE_DTYPES = ("bfloat16", "float32")
TARGETS = ("gfx942", "gfx950")
WAVE = 64
MAX_CHUNKS = 128
PLACE_THREADS = 1024
UNROLL = 4

CONFIGS = (
    dict(max_experts=32, lanes=8, waves=16),
    dict(max_experts=64, lanes=8, waves=16),
    dict(max_experts=128, lanes=16, waves=16),
    dict(max_experts=128, lanes=8, waves=8),
    dict(max_experts=256, lanes=16, waves=8),
    dict(max_experts=256, lanes=32, waves=16),
)


def _heuristic(target, sig, problem):
    e = int(problem.get("E", 128))
    return dict(CONFIGS[0] if e <= 32 else CONFIGS[1] if e <= 64 else CONFIGS[2] if e <= 128 else CONFIGS[4])


def _device_code(config, sig):
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr, gpu, range_constexpr

    MAX_E, LANES, NWAVES = config["max_experts"], config["lanes"], config["waves"]
    V, P, NT = MAX_E // LANES, WAVE // LANES, config["waves"] * WAVE
    PB = PLACE_THREADS // MAX_E
    EPL = max(MAX_E // WAVE, 1)
    HAS_N = bool(sig["has_valid_count"])
    WIDE = sig["score_dtype"] == "float32"
    KeyT = fx.Int64 if WIDE else fx.Int32
    SIGN_FREE = 0x7FFFFFFF if WIDE else 0x7FFF
    KEY_MIN = -(2 ** 63) if WIDE else -(2 ** 31)
    NAME = f"mslk_index_shuffling_{sig['score_dtype']}_e{MAX_E}_l{LANES}_w{NWAVES}{'_n' if HAS_N else ''}"

    def lds_ints(*sizes):
        """int32 arrays in LDS (one allocator per kernel), as pointers."""
        fields = {f"a{i}": fx.Array[fx.Int32, n, 16] for i, n in enumerate(sizes)}
        storage = fx.struct(type("LdsInts", (), {"__annotations__": fields}))
        lds = fx.SharedAllocator().allocate(storage).peek()
        return [getattr(lds, f"a{i}").ptr for i in range(len(sizes))]

    def shfl_xor(key, off):
        if const_expr(WIDE):   # two 32-bit moves
            lo = fx.Int32(key).shuffle_xor(off, WAVE)
            hi = fx.Int32(key >> 32).shuffle_xor(off, WAVE)
            return (KeyT(hi) << 32) | (KeyT(lo) & 0xFFFFFFFF)
        return key.shuffle_xor(off, WAVE)

    def token_keys(S, t, g, n_tok, n_exp):
        s_stride, _ = S.stride.unpack()
        row = fx.get_iter(S) + fx.Int64((t < n_tok).select(t, n_tok - 1)) * fx.Int64(s_stride)
        # A register array (not a Python list): the top-k loop below updates it in place.
        keys = fx.make_rmem_tensor(V, KeyT)
        for j in range(V):
            e = g + j * LANES
            raw = row[(e < n_exp).select(e, n_exp - 1)]
            b = raw.bitcast(fx.Int32) if const_expr(WIDE) else fx.Int32(raw.bitcast(fx.Int16))
            ordered = b ^ ((b >> 31) & SIGN_FREE)       # float order as signed-integer order
            key = (KeyT(ordered) << 8) | KeyT(255 - e)
            fx.memref_store(((t < n_tok) & (e < n_exp)).select(key, KeyT(KEY_MIN)), keys, j)
        return keys

    @flyc.kernel(name=NAME + "_route", known_block_size=[NT, 1, 1])
    def route_kernel(S: fx.Tensor, N: fx.Tensor, Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32,
                     e_start: fx.Int32, e_end: fx.Int32, tpw: fx.Int32):
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        wave, lane = tid // WAVE, tid % WAVE
        grp, g = lane // LANES, lane % LANES
        n_tok, n_exp = S.shape.unpack()
        n_valid = n_tok
        if const_expr(HAS_N):
            n_req = fx.get_iter(N).load()
            n_valid = (n_req < n_tok).select(n_req, n_tok)
        (whist,) = lds_ints(MAX_E * NWAVES)   # whist[e + MAX_E * w]: wave w's count, then its offset
        slots = fx.get_iter(Slots)
        for i in range_constexpr((MAX_E * NWAVES + NT - 1) // NT):
            if i * NT + tid < MAX_E * NWAVES:
                whist[i * NT + tid] = fx.Int32(0)
        gpu.barrier()

        t_wave = (chunk * NWAVES + wave) * tpw
        for step in range(tpw // P):
            t = t_wave + step * P + grp
            keys = token_keys(S, t, g, n_tok, n_exp)
            win = KeyT(KEY_MIN)
            for r in range(top_k):
                m = fx.memref_load(keys, 0)
                for j in range_constexpr(1, V):
                    m = fx.max(m, fx.memref_load(keys, j))
                for d in range_constexpr(LANES.bit_length() - 1):
                    m = fx.max(m, shfl_xor(m, LANES >> (d + 1)))
                win = (g == r).select(m, win)
                for j in range_constexpr(V):
                    k_j = fx.memref_load(keys, j)
                    fx.memref_store((k_j == m).select(KeyT(KEY_MIN), k_j), keys, j)
            e = 255 - fx.Int32(win & 255)
            routed = (g < top_k) & (t < n_valid) & (win != KeyT(KEY_MIN)) & (e >= e_start) & (e < e_end)
            # Rank in token order: the step's tokens take turns (a wave's LDS accesses are in order).
            rank = fx.Int32(0)
            for p in range_constexpr(P):
                if routed & (grp == p):
                    rank = whist[e + MAX_E * wave]
                    whist[e + MAX_E * wave] = rank + 1
            if (g < top_k) & (t < n_tok):
                slots[t * top_k + g] = routed.select((rank << 8) | e, fx.Int32(-1))
        gpu.barrier()

        for i in range_constexpr((MAX_E + NT - 1) // NT):
            e = i * NT + tid
            if e < n_exp:
                acc = fx.Int32(0)
                for w in range_constexpr(NWAVES):
                    cnt = whist[e + MAX_E * w]
                    whist[e + MAX_E * w] = acc
                    acc = acc + cnt
                (fx.get_iter(Hist) + chunk * n_exp + e).store(acc)
        gpu.barrier()

        if wave > 0:
            for step in range(tpw // P):
                t = t_wave + step * P + grp
                if (g < top_k) & (t < n_tok):
                    slot = slots[t * top_k + g]
                    if slot >= 0:
                        slots[t * top_k + g] = slot + (whist[(slot & 255) + MAX_E * wave] << 8)

    @flyc.kernel(name=NAME + "_place", known_block_size=[PLACE_THREADS, 1, 1])
    def place_kernel(Slots: fx.Tensor, Hist: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor,
                     TokOut: fx.Tensor, n_tok: fx.Int32, top_k: fx.Int32, e_start: fx.Int32,
                     e_end: fx.Int32, tpc: fx.Int32, n_chunks: fx.Int32):
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        n_exp = Counts.shape.unpack() - 2      # a 1-D shape unpacks to a scalar
        s_pre, s_tot, s_base = lds_ints(PLACE_THREADS, PLACE_THREADS, MAX_E)
        hist, counts, slots = fx.get_iter(Hist), fx.get_iter(Counts), fx.get_iter(Slots)

        # Per expert: counts of earlier chunks and of all chunks (clamped loads, all in flight).
        e, part = tid % MAX_E, tid // MAX_E
        e_ld = (e < n_exp).select(e, n_exp - 1)
        pre, tot = fx.Int32(0), fx.Int32(0)
        for i in range_constexpr(MAX_CHUNKS // PB):
            c = part + i * PB
            v = hist[(c < n_chunks).select(c, n_chunks - 1) * n_exp + e_ld]
            v = ((c < n_chunks) & (e < n_exp)).select(v, fx.Int32(0))
            tot = tot + v
            pre = pre + (c < chunk).select(v, fx.Int32(0))
        s_pre[tid] = pre
        s_tot[tid] = tot
        gpu.barrier()

        # Wave 0: exclusive scan over the selected experts; lane l owns experts l*EPL .. + EPL-1.
        if tid < WAVE:
            local = []
            lsum = fx.Int32(0)
            for i in range_constexpr(EPL):
                ee = tid * EPL + i
                cnt = fx.Int32(0)
                for q in range_constexpr(PB):
                    cnt = cnt + s_tot[((ee < MAX_E).select(ee, 0)) + MAX_E * q]
                cnt = ((ee < n_exp) & (ee >= e_start) & (ee < e_end) & (ee < MAX_E)).select(cnt, fx.Int32(0))
                local.append(cnt)
                lsum = lsum + cnt
            incl = lsum
            for d in range_constexpr(6):
                up = fx.Int32(gpu.shuffle_up(incl, 1 << d, WAVE))
                incl = incl + (tid >= (1 << d)).select(up, fx.Int32(0))
            run = incl - lsum
            for i in range_constexpr(EPL):
                ee = tid * EPL + i
                if ee < MAX_E:
                    before = run
                    for q in range_constexpr(PB):
                        before = before + s_pre[ee + MAX_E * q]
                    s_base[ee] = before
                    if (chunk == 0) & (ee < n_exp):
                        counts[ee] = local[i]
                run = run + local[i]
            if (chunk == 0) & (tid == WAVE - 1):
                counts[n_exp] = n_tok
                counts[n_exp + 1] = incl
        gpu.barrier()

        t0 = chunk * tpc
        left = n_tok - t0
        n_slots = (tpc < left).select(tpc, left) * top_k   # >= 1: no chunk is empty
        for s0 in range(tid, n_slots, PLACE_THREADS * UNROLL):
            got = []
            for u in range_constexpr(UNROLL):
                s = s0 + u * PLACE_THREADS
                got.append(slots[t0 * top_k + (s < n_slots).select(s, n_slots - 1)])
            for u in range_constexpr(UNROLL):
                s = s0 + u * PLACE_THREADS
                if (s < n_slots) & (got[u] >= 0):
                    ee = got[u] & 255
                    pos = s_base[ee] + (got[u] >> 8)
                    (fx.get_iter(ExpOut) + pos).store(ee - e_start)
                    (fx.get_iter(TokOut) + pos).store((t0 * top_k + s) // top_k)

    @flyc.jit
    def index_shuffling(S: fx.Tensor, N: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor, TokOut: fx.Tensor,
                        Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32, e_start: fx.Int32,
                        e_end: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        n_tok = S.shape.unpack()[0]
        step = NWAVES * P
        n_chunks = (n_tok + step - 1) // step
        n_chunks = (n_chunks < MAX_CHUNKS).select(n_chunks, MAX_CHUNKS)
        tpw = ((n_tok + n_chunks - 1) // n_chunks + step - 1) // step * P   # tokens per wave
        tpc = tpw * NWAVES
        n_chunks = (n_tok + tpc - 1) // tpc
        route_kernel(S, N, Slots, Hist, top_k, e_start, e_end, tpw).launch(
            grid=(n_chunks, 1, 1), block=(NT, 1, 1), stream=stream)
        place_kernel(Slots, Hist, Counts, ExpOut, TokOut, n_tok, top_k, e_start, e_end, tpc, n_chunks).launch(
            grid=(n_chunks, 1, 1), block=(PLACE_THREADS, 1, 1), stream=stream)

    return index_shuffling


def build(config, target, sig):
    import torch

    scores = torch.zeros(5, 16, dtype=getattr(torch, sig["score_dtype"]))  # sizes stay dynamic
    ints = [torch.zeros(n, dtype=torch.int32) for n in (1, 18, 10, 10, 10, MAX_CHUNKS * 16)]
    return _device_code(config, sig), [scores, *ints, 2, 0, 16]


TEMPLATE = Template(op="index_shuffling", backend="flydsl", targets=TARGETS,
                    signatures={"score_dtype": SCORE_DTYPES, "has_valid_count": (False, True)},
                    configs=CONFIGS, heuristic=_heuristic, build=build)
