"""index_shuffling's kernels for ROCm (FlyDSL), as one kernel class: the config in ``__init__``,
the host launcher in ``__call__``, one kernel method per kernel (route, place) and the device
helpers as plain methods. The contract and the algorithm are in ``index_shuffling_flydsl``'s
docstring; ``_flydsl_kernels`` says why the methods are marked rather than decorated and the
instances come from ``_flydsl_kernels.specialize``.

Imported only from that template's ``build()`` (it imports ``flydsl`` at module level).
"""
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from mslk_dsl.templates._kernel_limits import MAX_CHUNKS
from mslk_dsl.templates import _flydsl_kernels as fk
from mslk_dsl.templates import _index_shuffling_space as space
from mslk_dsl.templates._index_shuffling_space import PLACE_THREADS, UNROLL

WAVE = 64


class IndexShuffling(space.RouteGeometry):
    def __init__(self, config, sig, template: str = "index_shuffling_flydsl"):
        super().__init__(template, config, sig, WAVE, "waves")
        self.key_t = fx.Int64 if self.wide else fx.Int32
        self.name = (f"mslk_index_shuffling_{sig['score_dtype']}_e{self.max_e}_l{self.lanes}_w{self.route_waves}"
                     f"{'_n' if self.has_n else ''}")

    # -- helpers ---------------------------------------------------------------------------------
    def shfl_xor(self, key, off):
        if const_expr(self.wide):   # two 32-bit moves
            lo = fx.Int32(key).shuffle_xor(off, WAVE)
            hi = fx.Int32(key >> 32).shuffle_xor(off, WAVE)
            return (self.key_t(hi) << 32) | (self.key_t(lo) & 0xFFFFFFFF)
        return key.shuffle_xor(off, WAVE)

    def token_keys(self, S, t, g, n_tok, n_exp):
        KeyT = self.key_t
        s_stride, _ = S.stride.unpack()
        row = fx.get_iter(S) + fx.Int64((t < n_tok).select(t, n_tok - 1)) * fx.Int64(s_stride)
        # A register array (not a Python list): the top-k loop below updates it in place.
        keys = fx.make_rmem_tensor(self.keys_per_lane, KeyT)
        for j in range(self.keys_per_lane):
            e = g + j * self.lanes
            raw = row[(e < n_exp).select(e, n_exp - 1)]
            b = raw.bitcast(fx.Int32) if const_expr(self.wide) else fx.Int32(raw.bitcast(fx.Int16))
            ordered = b ^ ((b >> 31) & self.sign_free)       # float order as signed-integer order
            key = (KeyT(ordered) << 8) | KeyT(255 - e)
            fx.memref_store(((t < n_tok) & (e < n_exp)).select(key, KeyT(self.key_min)), keys, j)
        return keys

    # -- kernels ---------------------------------------------------------------------------------
    @fk.kernel(lambda self: {"name": self.name + "_route", "known_block_size": [self.threads, 1, 1]})
    def route_kernel(self, S: fx.Tensor, N: fx.Tensor, Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32,
                     e_start: fx.Int32, e_end: fx.Int32, tpw: fx.Int32):
        MAX_E, LANES, NWAVES, NT = self.max_e, self.lanes, self.route_waves, self.threads
        P, V, KeyT = self.tokens_per_step, self.keys_per_lane, self.key_t
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        wave, lane = tid // WAVE, tid % WAVE
        grp, g = lane // LANES, lane % LANES
        n_tok, n_exp = S.shape.unpack()
        n_valid = n_tok
        if const_expr(self.has_n):
            n_req = fx.get_iter(N).load()
            n_valid = (n_req < n_tok).select(n_req, n_tok)
        (whist,) = fk.lds_ints(MAX_E * NWAVES)   # whist[e + MAX_E * w]: wave w's count, then its offset
        slots = fx.get_iter(Slots)
        for i in range_constexpr((MAX_E * NWAVES + NT - 1) // NT):
            if i * NT + tid < MAX_E * NWAVES:
                whist[i * NT + tid] = fx.Int32(0)
        gpu.barrier()

        t_wave = (chunk * NWAVES + wave) * tpw
        for step in range(tpw // P):
            t = t_wave + step * P + grp
            keys = self.token_keys(S, t, g, n_tok, n_exp)
            win = KeyT(self.key_min)
            for r in range(top_k):
                m = fx.memref_load(keys, 0)
                for j in range_constexpr(1, V):
                    m = fx.max(m, fx.memref_load(keys, j))
                for d in range_constexpr(LANES.bit_length() - 1):
                    m = fx.max(m, self.shfl_xor(m, LANES >> (d + 1)))
                win = (g == r).select(m, win)
                for j in range_constexpr(V):
                    k_j = fx.memref_load(keys, j)
                    fx.memref_store((k_j == m).select(KeyT(self.key_min), k_j), keys, j)
            e = 255 - fx.Int32(win & 255)
            routed = (g < top_k) & (t < n_valid) & (win != KeyT(self.key_min)) & (e >= e_start) & (e < e_end)
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

    @fk.kernel(lambda self: {"name": self.name + "_place", "known_block_size": [PLACE_THREADS, 1, 1]})
    def place_kernel(self, Slots: fx.Tensor, Hist: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor,
                     TokOut: fx.Tensor, n_tok: fx.Int32, top_k: fx.Int32, e_start: fx.Int32,
                     e_end: fx.Int32, tpc: fx.Int32, n_chunks: fx.Int32):
        MAX_E, PB, EPL = self.max_e, self.place_parts, self.experts_per_lane
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        n_exp = Counts.shape.unpack() - 2      # a 1-D shape unpacks to a scalar
        s_pre, s_tot, s_base = fk.lds_ints(PLACE_THREADS, PLACE_THREADS, MAX_E)
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

    # -- host launcher ---------------------------------------------------------------------------
    @fk.jit
    def __call__(self, S: fx.Tensor, N: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor, TokOut: fx.Tensor,
                 Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32, e_start: fx.Int32,
                 e_end: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        P = self.tokens_per_step
        n_tok = S.shape.unpack()[0]
        step = self.route_waves * P
        n_chunks = (n_tok + step - 1) // step
        n_chunks = (n_chunks < MAX_CHUNKS).select(n_chunks, MAX_CHUNKS)
        tpw = ((n_tok + n_chunks - 1) // n_chunks + step - 1) // step * P   # tokens per wave
        tpc = tpw * self.route_waves
        n_chunks = (n_tok + tpc - 1) // tpc
        self.route_kernel(S, N, Slots, Hist, top_k, e_start, e_end, tpw).launch(
            grid=(n_chunks, 1, 1), block=(self.threads, 1, 1), stream=stream)
        self.place_kernel(Slots, Hist, Counts, ExpOut, TokOut, n_tok, top_k, e_start, e_end, tpc, n_chunks).launch(
            grid=(n_chunks, 1, 1), block=(PLACE_THREADS, 1, 1), stream=stream)
