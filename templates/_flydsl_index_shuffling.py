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
        s_stride, _ = S.stride.unpack()
        row = fx.get_iter(S) + fx.Int64((t < n_tok).select(t, n_tok - 1)) * fx.Int64(s_stride)
        # A register array (not a Python list): the top-k loop below updates it in place.
        keys = fx.make_rmem_tensor(self.keys_per_lane, self.key_t)
        for j in range(self.keys_per_lane):
            e = g + j * self.lanes
            raw = row[(e < n_exp).select(e, n_exp - 1)]
            b = raw.bitcast(fx.Int32) if const_expr(self.wide) else fx.Int32(raw.bitcast(fx.Int16))
            ordered = b ^ ((b >> 31) & self.sign_free)       # float order as signed-integer order
            key = (self.key_t(ordered) << self.expert_bits) | self.key_t(self.expert_mask - e)
            fx.memref_store(((t < n_tok) & (e < n_exp)).select(key, self.key_t(self.key_min)), keys, j)
        return keys

    # -- kernels ---------------------------------------------------------------------------------
    @fk.kernel(lambda self: {"name": self.name + "_route", "known_block_size": [self.threads, 1, 1]})
    def route_kernel(self, S: fx.Tensor, N: fx.Tensor, Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32,
                     e_start: fx.Int32, e_end: fx.Int32, tpw: fx.Int32):
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        wave, lane = tid // WAVE, tid % WAVE
        grp, g = lane // self.lanes, lane % self.lanes
        n_tok, n_exp = S.shape.unpack()
        n_valid = n_tok
        if const_expr(self.has_n):
            n_req = fx.get_iter(N).load()
            n_valid = (n_req < n_tok).select(n_req, n_tok)
        # whist[e + max_e * w]: wave w's count, then its offset
        (whist,) = fk.lds_ints(self.max_e * self.route_waves)
        slots = fx.get_iter(Slots)
        for i in range_constexpr((self.max_e * self.route_waves + self.threads - 1) // self.threads):
            if i * self.threads + tid < self.max_e * self.route_waves:
                whist[i * self.threads + tid] = fx.Int32(0)
        gpu.barrier()

        t_wave = (chunk * self.route_waves + wave) * tpw
        for step in range(tpw // self.tokens_per_step):
            t = t_wave + step * self.tokens_per_step + grp
            keys = self.token_keys(S, t, g, n_tok, n_exp)
            win = self.key_t(self.key_min)
            for r in range(top_k):
                m = fx.memref_load(keys, 0)
                for j in range_constexpr(1, self.keys_per_lane):
                    m = fx.max(m, fx.memref_load(keys, j))
                for d in range_constexpr(self.lanes.bit_length() - 1):
                    m = fx.max(m, self.shfl_xor(m, self.lanes >> (d + 1)))
                win = (g == r).select(m, win)
                for j in range_constexpr(self.keys_per_lane):
                    k_j = fx.memref_load(keys, j)
                    fx.memref_store((k_j == m).select(self.key_t(self.key_min), k_j), keys, j)
            e = self.expert_mask - fx.Int32(win & self.expert_mask)
            routed = (g < top_k) & (t < n_valid) & (win != self.key_t(self.key_min)) & (e >= e_start) & (e < e_end)
            # Rank in token order: the step's tokens take turns (a wave's LDS accesses are in order).
            rank = fx.Int32(0)
            for p in range_constexpr(self.tokens_per_step):
                if routed & (grp == p):
                    rank = whist[e + self.max_e * wave]
                    whist[e + self.max_e * wave] = rank + 1
            if (g < top_k) & (t < n_tok):
                slots[t * top_k + g] = routed.select((rank << self.expert_bits) | e, fx.Int32(-1))
        gpu.barrier()

        for i in range_constexpr((self.max_e + self.threads - 1) // self.threads):
            e = i * self.threads + tid
            if e < n_exp:
                acc = fx.Int32(0)
                for w in range_constexpr(self.route_waves):
                    cnt = whist[e + self.max_e * w]
                    whist[e + self.max_e * w] = acc
                    acc = acc + cnt
                (fx.get_iter(Hist) + chunk * n_exp + e).store(acc)
        gpu.barrier()

        if wave > 0:
            for step in range(tpw // self.tokens_per_step):
                t = t_wave + step * self.tokens_per_step + grp
                if (g < top_k) & (t < n_tok):
                    slot = slots[t * top_k + g]
                    if slot >= 0:
                        slots[t * top_k + g] = slot + (whist[(slot & self.expert_mask) + self.max_e * wave] << self.expert_bits)

    @fk.kernel(lambda self: {"name": self.name + "_place", "known_block_size": [PLACE_THREADS, 1, 1]})
    def place_kernel(self, Slots: fx.Tensor, Hist: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor,
                     TokOut: fx.Tensor, n_tok: fx.Int32, top_k: fx.Int32, e_start: fx.Int32,
                     e_end: fx.Int32, tpc: fx.Int32, n_chunks: fx.Int32):
        tid = fx.thread_idx.x
        chunk = fx.block_idx.x
        n_exp = Counts.shape.unpack() - 2      # a 1-D shape unpacks to a scalar
        s_pre, s_tot, s_base = fk.lds_ints(PLACE_THREADS, PLACE_THREADS, self.max_e)
        hist, counts, slots = fx.get_iter(Hist), fx.get_iter(Counts), fx.get_iter(Slots)

        # Per expert: counts of earlier chunks and of all chunks (clamped loads, all in flight).
        e, part = tid % self.max_e, tid // self.max_e
        e_ld = (e < n_exp).select(e, n_exp - 1)
        pre, tot = fx.Int32(0), fx.Int32(0)
        for i in range_constexpr(MAX_CHUNKS // self.place_parts):
            c = part + i * self.place_parts
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
            for i in range_constexpr(self.experts_per_lane):
                ee = tid * self.experts_per_lane + i
                cnt = fx.Int32(0)
                for q in range_constexpr(self.place_parts):
                    cnt = cnt + s_tot[((ee < self.max_e).select(ee, 0)) + self.max_e * q]
                cnt = ((ee < n_exp) & (ee >= e_start) & (ee < e_end) & (ee < self.max_e)).select(cnt, fx.Int32(0))
                local.append(cnt)
                lsum = lsum + cnt
            incl = lsum
            for d in range_constexpr(6):
                up = fx.Int32(gpu.shuffle_up(incl, 1 << d, WAVE))
                incl = incl + (tid >= (1 << d)).select(up, fx.Int32(0))
            run = incl - lsum
            for i in range_constexpr(self.experts_per_lane):
                ee = tid * self.experts_per_lane + i
                if ee < self.max_e:
                    before = run
                    for q in range_constexpr(self.place_parts):
                        before = before + s_pre[ee + self.max_e * q]
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
                    ee = got[u] & self.expert_mask
                    pos = s_base[ee] + (got[u] >> self.expert_bits)
                    (fx.get_iter(ExpOut) + pos).store(ee - e_start)
                    (fx.get_iter(TokOut) + pos).store((t0 * top_k + s) // top_k)

    # -- host launcher ---------------------------------------------------------------------------
    @fk.jit
    def __call__(self, S: fx.Tensor, N: fx.Tensor, Counts: fx.Tensor, ExpOut: fx.Tensor, TokOut: fx.Tensor,
                 Slots: fx.Tensor, Hist: fx.Tensor, top_k: fx.Int32, e_start: fx.Int32,
                 e_end: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        n_tok = S.shape.unpack()[0]
        step = self.route_waves * self.tokens_per_step
        n_chunks = (n_tok + step - 1) // step
        n_chunks = (n_chunks < MAX_CHUNKS).select(n_chunks, MAX_CHUNKS)
        tpw = ((n_tok + n_chunks - 1) // n_chunks + step - 1) // step * self.tokens_per_step   # tokens per wave
        tpc = tpw * self.route_waves
        n_chunks = (n_tok + tpc - 1) // tpc
        self.route_kernel(S, N, Slots, Hist, top_k, e_start, e_end, tpw).launch(
            grid=(n_chunks, 1, 1), block=(self.threads, 1, 1), stream=stream)
        self.place_kernel(Slots, Hist, Counts, ExpOut, TokOut, n_tok, top_k, e_start, e_end, tpc, n_chunks).launch(
            grid=(n_chunks, 1, 1), block=(PLACE_THREADS, 1, 1), stream=stream)
