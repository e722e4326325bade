"""Shared FlyDSL MFMA GEMM for CDNA3 (gfx942) and CDNA4 (gfx950): ``out = epilogue(x @ w.T)``.

x [M, K] and w [N, K] are row-major (K contiguous), out [M, N] row-major. There is no weight
pre-shuffle: both operands take the same path, so one set of helpers serves A and B:

  global --buffer_load_dwordx4--> registers --ds_write_b128--> LDS (XOR swizzled, `stages` deep)
         --ds_read_b128--> MFMA operands --v_mfma--> fp32 accumulators --epilogue--> buffer stores

The structure follows ROCm/FlyDSL's layout-API GEMMs (kernels/gemm/preshuffle_gemm.py: a tiled
MMA over waves with a K permutation so each lane reads 16 contiguous bytes from LDS;
kernels/gemm/gemm_a16w16_gfx950.py: both operands through LDS, coordinate tensors in the
epilogue). The next K tile is fetched into registers while the MFMAs of the current one run.

A config (plain ints, so tuning tables and JSON round-trip it):
  tile_m, tile_n, tile_k  block tile; tile_m = 16 / 32 serve decode-sized M
  waves_m, waves_n        waves per block along M and N (64 lanes each)
  mfma                    16 or 32: the MFMA's output block (16x16 or 32x32 per wave)
  stages                  LDS buffers per operand: 2 reads one while the next K tile lands in
                          the other (one barrier per K tile), 1 halves LDS (two barriers)
Blocks run in a 1-D grid, remapped so blocks sharing a die's L2 work on neighbouring tiles.

Sizes are dynamic: one binary serves every M, N and K, within these bounds:
  * rows past M (x) and N (w) read as zero through the buffer descriptors' byte bounds;
  * the last K tile, when K % tile_k != 0, is loaded with one predicate per 16-byte chunk and
    zero fill, so K must be a multiple of 16 bytes (8 bf16/fp16, 16 fp8) and rows 16-byte aligned;
  * stores and scale/bias reads are bounded by row < M and col < N;
  * buffer offsets are 32-bit: each operand must stay below 2**31 bytes.

flydsl is imported lazily inside the builders. Compile-time parameters reach the kernel as plain
scalars, which FlyDSL's own cache key covers, so configs never share a cache entry.
"""

from mslk_dsl.errors import ConfigError
from mslk_dsl.templates import _kernel_limits as limits

LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
WAVE = 64
FP8 = {"gfx942": "float8_e4m3fnuz", "gfx950": "float8_e4m3fn"}  # the target's FP8 flavour (torch name)
_DTYPES = {"bfloat16": "BFloat16", "float16": "Float16",
           "float8_e4m3fnuz": "Float8E4M3FNUZ", "float8_e4m3fn": "Float8E4M3FN"}


def mma_shape(target, elem_bytes, mfma):
    """(atom K, K per LDS read step, scaled MFMA?) for `mfma` x `mfma` output atoms.

    One K step is what one 16-byte LDS read per lane feeds: on gfx942 an atom takes 8 bytes per
    lane, so a K permutation pairs two atoms; gfx950's atoms take 16 (bf16) or 32 (fp8) bytes.
    """
    if elem_bytes == 2:
        if target == "gfx950":  # v_mfma_f32_{16x16x32,32x32x16}_{bf16,f16}
            return (32, 32, False) if mfma == 16 else (16, 16, False)
        return (16, 32, False) if mfma == 16 else (8, 16, False)  # {16x16x16,32x32x8}
    if target == "gfx950":  # scaled-MFMA atom with zero scales: LLVM emits the unscaled
        # v_mfma_f32_{16x16x128,32x32x64}_f8f6f4 (as FlyDSL's preshuffle GEMM relies on)
        return (128, 128, True) if mfma == 16 else (64, 64, True)
    return (32, 64, False) if mfma == 16 else (16, 32, False)  # {16x16x32,32x32x16}_fp8_fp8


def threads_of(config):
    return WAVE * config["waves_m"] * config["waves_n"]


def check_config(config, target, elem_bytes):
    """Why `config` cannot run on `target` with `elem_bytes`-byte inputs, or None if it can."""
    tm, tn, tk = config["tile_m"], config["tile_n"], config["tile_k"]
    wm, wn = config["waves_m"], config["waves_n"]
    mfma, stages, threads = config["mfma"], config["stages"], threads_of(config)
    if tm % (mfma * wm) or tn % (mfma * wn):
        return "tile_m / tile_n must be multiples of mfma * waves"
    if tk % mma_shape(target, elem_bytes, mfma)[1]:
        return "tile_k must be a multiple of the MFMA K step"
    chunks = tk * elem_bytes // 16  # 16-byte chunks per tile row
    if chunks & (chunks - 1) or chunks > threads:
        return "a tile row must be a power-of-two number of 16-byte chunks, at most one per thread"
    if tm % (threads // chunks) or tn % (threads // chunks):
        return f"tile_m / tile_n must be multiples of {threads // chunks} (rows per load pass)"
    if stages * (tm + tn) * tk * elem_bytes > LDS_BYTES[target]:
        return "LDS stages do not fit"
    if tm * tn // threads > 128:
        return "more than 128 fp32 accumulators per lane"
    return None


def pick_config(configs, target, elem_bytes, problem):
    """Valid config with the least estimated time: rounds of tiles over the CUs times the cycles
    one tile spends per K element, bound by MFMA rate, LDS bandwidth (128 B/clk) or L2 reads
    (~64 B/clk per CU). A first guess, to be replaced by measured tuning tables."""
    M, N = max(int(problem.get("M", 1)), 1), max(int(problem.get("N", 4096)), 1)
    macs_per_clk = 1024 * (2 if target == "gfx950" else 1) * (2 // elem_bytes)

    def cost(c):
        tm, tn, wm, wn = c["tile_m"], c["tile_n"], c["waves_m"], c["waves_n"]
        tiles = -(-M // tm) * -(-N // tn)
        lds_bytes = (wn * tm + wm * tn + tm + tn) * elem_bytes  # wave reads + block writes
        cycles = max(tm * tn / macs_per_clk, lds_bytes / 128, (tm + tn) * elem_bytes / 64)
        return (-(-tiles // limits.MULTIPROCESSORS[target]) * cycles, -tm * tn)

    return min((c for c in configs if check_config(c, target, elem_bytes) is None), key=cost)


# ---- layout builders, shared by the kernel and by offline checks of its data movement ----

def dsl_type(ab_dtype):
    import flydsl.expr as fx
    return getattr(fx, _DTYPES[ab_dtype])


def make_tiled_mma(target, ab_dtype, mfma, waves_m, waves_n):
    """Waves tile the block (waves_m x waves_n); repeats cover the rest of the tile."""
    import flydsl.expr as fx
    ab_t = dsl_type(ab_dtype)
    elem_bytes = ab_t.width // 8
    atom_k, k_step, scaled = mma_shape(target, elem_bytes, mfma)
    if scaled:
        atom = fx.make_mma_atom(fx.rocdl.cdna4.MFMA_Scale(mfma, mfma, atom_k, ab_t))
    else:
        atom = fx.make_mma_atom(fx.rocdl.MFMA(mfma, mfma, atom_k, ab_t))
    lane_k = atom_k * mfma // WAVE  # elements one lane holds per atom
    if k_step > atom_k:
        # two atoms per step: lane group g takes elements [2*lane_k*g, 2*lane_k*(g+1)) of the
        # step, i.e. one 16-byte read (preshuffle_gemm's (4,4,2):(1,8,4) for bf16 16x16x16)
        k_perm = fx.make_layout((lane_k, WAVE // mfma, 2), (1, 2 * lane_k, lane_k))
    else:
        k_perm = fx.make_layout(k_step, 1)
    return fx.make_tiled_mma(atom, fx.make_layout((waves_m, waves_n, 1), (1, waves_m, 0)),
                             fx.make_tile(None, None, k_perm))


def make_g2s_copy(ab_dtype, tile_k, threads):
    """Global -> register tiled copy: consecutive lanes take consecutive 16-byte chunks of a
    row (coalesced), each pass covers threads / chunks rows."""
    import flydsl.expr as fx
    ab_t = dsl_type(ab_dtype)
    vec = 128 // ab_t.width
    chunks = tile_k // vec
    rows = threads // chunks
    return fx.make_tiled_copy(
        fx.make_copy_atom(fx.UniversalCopy128b(), ab_t),
        fx.make_layout(((chunks, rows), (1, vec)), ((rows * vec, 1), (1, rows))),
        fx.make_tile(rows, tile_k))


def make_lds_layout(ab_dtype, rows, tile_k, stages):
    """(rows, tile_k, stages), K contiguous; the 16-byte chunk index is XORed with the row
    (mod 8), so the 8 lanes of a ds_read_b128 / ds_write_b128 phase hit distinct banks."""
    import flydsl.expr as fx
    width = dsl_type(ab_dtype).width
    chunk_bits = (tile_k * width // 128).bit_length() - 1
    swizzle = fx.SwizzleType.get(min(chunk_bits, 3), (128 // width).bit_length() - 1, chunk_bits)
    return fx.make_composed_layout(fx.static(swizzle),
                                   fx.make_ordered_layout((rows, tile_k, stages), (1, 0, 2)))


def make_gemm_kernel(*, target, ab_dtype, out_dtype, epilogue, tile_m, tile_n, tile_k,
                     waves_m, waves_n, mfma, stages, tile_of_block=None):
    """The @flyc.kernel ``gemm(x, w, out, epi)``; launch on `grid_for(...)` x `threads_of`.

    epilogue "none": out = acc;  "rowwise": out = acc * x_scale[m] * w_scale[n], epi =
    (x_scale, w_scale, ...);  "rowwise_bias": + bias[n], epi = (x_scale, w_scale, bias).
    tile_of_block: None, or (for grouped GEMMs) a traced function (x, w, out, epi) -> (x, w, out,
    epi, bid_m, bid_n, live) giving the block's operands as views (one group's rows and weight),
    its tile and whether it has one (a block without does one K tile of zeros, storing nothing).
    """
    import flydsl.compiler as flyc
    import flydsl.expr as fx
    from flydsl.expr import const_expr, gpu, range_constexpr

    ab_t, out_t = dsl_type(ab_dtype), dsl_type(out_dtype)
    elem_bytes = ab_t.width // 8
    atom_k, k_step, _ = mma_shape(target, elem_bytes, mfma)
    threads = WAVE * waves_m * waves_n
    k_iters = tile_k // k_step
    paired = k_step > atom_k  # the K permutation nests two atoms in each step
    has_scale = epilogue in ("rowwise", "rowwise_bias")
    has_bias = epilogue == "rowwise_bias"

    @fx.struct
    class SharedStorage:
        a: fx.Array[ab_t, stages * tile_m * tile_k, 16]
        b: fx.Array[ab_t, stages * tile_n * tile_k, 16]

    @flyc.kernel
    def gemm(x: fx.Tensor, w: fx.Tensor, out: fx.Tensor, epi):
        tid = fx.thread_idx.x
        if const_expr(tile_of_block is not None):
            x, w, out, epi, bid_m, bid_n, live = tile_of_block(x, w, out, epi)
        M, K = x.shape.unpack()
        N, _ = w.shape.unpack()
        if const_expr(tile_of_block is None):
            bid_m, bid_n = block_tile(fx.block_idx.x, (M + (tile_m - 1)) // tile_m,
                                      (N + (tile_n - 1)) // tile_n, _select)
        tiled_mma = make_tiled_mma(target, ab_dtype, mfma, waves_m, waves_n)
        thr_mma = tiled_mma.thr_slice(tid)
        thr_g2s = make_g2s_copy(ab_dtype, tile_k, threads).get_slice(tid)
        buf_copy = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), ab_t)
        lds_copy = fx.make_copy_atom(fx.UniversalCopy128b(), ab_t)

        # Buffer views bounded by the tensors' extents: OOB rows read 0, OOB stores are dropped.
        gA = fx.flat_divide(fx.rocdl.make_buffer_tensor(x, max_size=False),
                            fx.make_tile(tile_m, tile_k))[None, None, bid_m, None]
        gB = fx.flat_divide(fx.rocdl.make_buffer_tensor(w, max_size=False),
                            fx.make_tile(tile_n, tile_k))[None, None, bid_n, None]
        gC = fx.flat_divide(fx.rocdl.make_buffer_tensor(out, max_size=False),
                            fx.make_tile(tile_m, tile_n))[None, None, bid_m, bid_n]
        lds = fx.SharedAllocator().allocate(SharedStorage).peek()
        sA = fx.make_view(lds.a.ptr, make_lds_layout(ab_dtype, tile_m, tile_k, stages))
        sB = fx.make_view(lds.b.ptr, make_lds_layout(ab_dtype, tile_n, tile_k, stages))

        def operand(g_tile, s_tile, rows, thr_s2r, frag):
            """Per-thread views of one operand (A or B) through every pipeline step."""
            k_coord = thr_g2s.partition_S(fx.make_view(0, fx.make_layout((rows, tile_k), (0, 1))))
            k_coord = k_coord[(0, None), None, None]  # K index of each 16-byte chunk
            smem = thr_g2s.partition_D(s_tile)
            return dict(gmem=thr_g2s.partition_S(g_tile),       # (V, R, RK, k tiles)
                        smem=smem,                              # (V, R, RK, stages)
                        regs=fx.make_fragment_like(smem[None, None, None, 0]),
                        k_coord=k_coord,
                        pred=fx.make_fragment_like(k_coord, dtype=fx.Boolean),
                        s2r=thr_s2r.partition_S(s_tile),        # (V, R, k_iters, stages)
                        frag=frag,
                        frag_view=thr_s2r.retile(frag))

        thr_s2r_A = fx.make_tiled_copy_A(buf_copy, tiled_mma).get_slice(tid)
        thr_s2r_B = fx.make_tiled_copy_B(buf_copy, tiled_mma).get_slice(tid)
        opA = operand(gA, sA, tile_m, thr_s2r_A, thr_mma.make_fragment_A(sA[None, None, 0]))
        opB = operand(gB, sB, tile_n, thr_s2r_B, thr_mma.make_fragment_B(sB[None, None, 0]))
        frag_C = thr_mma.make_fragment_C(gC)
        full_k_tiles = K // tile_k
        num_k_tiles = (K + (tile_k - 1)) // tile_k
        if const_expr(tile_of_block is not None):
            num_k_tiles = live.select(num_k_tiles, fx.Int32(1))

        def load_tile(kt):
            """Global -> registers, K tile `kt` of both operands."""
            if kt < full_k_tiles:
                for op in (opA, opB):
                    fx.copy(buf_copy, op["gmem"][None, None, None, kt], op["regs"])
            else:
                # K tail: chunks at or past K must read zero, not the next row's data.
                k_left = K - kt * tile_k
                for op in (opA, opB):
                    for i in range_constexpr(fx.size(op["pred"].shape).unpack()):
                        op["pred"][i] = fx.get_scalar(op["k_coord"][i]) < k_left
                    op["regs"].fill(0)
                    fx.copy(buf_copy, op["gmem"][None, None, None, kt], op["regs"], pred=op["pred"])

        def store_tile(stage):
            for op in (opA, opB):
                fx.copy(lds_copy, op["regs"], op["smem"][None, None, None, stage])

        def mma_tile(stage):
            # LDS reads per K step so they interleave with the MFMAs of the previous step
            for ki in range_constexpr(k_iters):
                for op in (opA, opB):
                    fx.copy(lds_copy, op["s2r"][None, None, ki, stage], op["frag_view"][None, None, ki])
                kc = (None, ki) if paired else ki
                fx.gemm(tiled_mma, frag_C, opA["frag"][None, None, kc], opB["frag"][None, None, kc],
                        frag_C)

        frag_C.fill(0.0)
        load_tile(fx.Int32(0))
        store_tile(0)
        gpu.barrier()
        if const_expr(stages == 2):
            # Read one stage while the next tile lands in the other: one barrier per tile.
            for kt in range(0, num_k_tiles - 1, 1):
                load_tile(kt + 1)
                mma_tile(kt % 2)
                store_tile((kt + 1) % 2)
                gpu.barrier()
            mma_tile((num_k_tiles - 1) % 2)
        else:
            for kt in range(0, num_k_tiles - 1, 1):
                load_tile(kt + 1)
                mma_tile(0)
                gpu.barrier()
                store_tile(0)
                gpu.barrier()
            mma_tile(0)

        # ---- epilogue: coordinates come from the same partitions as the accumulators
        m0 = bid_m * tile_m
        n0 = bid_n * tile_n
        rows = thr_mma.partition_C(fx.make_view(0, fx.make_layout((tile_m, tile_n), (1, 0))))
        cols = thr_mma.partition_C(fx.make_view(0, fx.make_layout((tile_m, tile_n), (0, 1))))
        # A lane holds one column per N repeat and the same rows in every N repeat, so in the
        # (V, RM, RN) accumulator order row(i) depends on i % per_col and col(i) on i // per_col.
        row_strides, col_strides = rows.stride.to_py_value(), cols.stride.to_py_value()
        if const_expr(row_strides[2] != 0 or any(_flatten(col_strides[:2]))):
            raise ConfigError(f"GEMM config tile {tile_m}x{tile_n}x{tile_k}, waves {waves_m}x{waves_n}, mfma {mfma}: "
                              f"the accumulators' row / column strides {row_strides} / {col_strides} do not "
                              f"have the layout the epilogue assumes")
        n_acc = fx.size(frag_C.shape).unpack()
        per_col = n_acc // fx.size(frag_C.shape[2]).unpack()
        vals = [frag_C[i] for i in range_constexpr(n_acc)]
        if const_expr(has_scale):
            xs = fx.rocdl.make_buffer_tensor(epi[0], max_size=False)  # OOB reads give 0
            ws = fx.rocdl.make_buffer_tensor(epi[1], max_size=False)
            row_scale = [xs[m0 + fx.get_scalar(rows[i])] for i in range_constexpr(per_col)]
            col_scale = [ws[n0 + fx.get_scalar(cols[i])] for i in range_constexpr(0, n_acc, per_col)]
            vals = [vals[i] * row_scale[i % per_col] * col_scale[i // per_col]
                    for i in range_constexpr(n_acc)]
            if const_expr(has_bias):
                bs = fx.rocdl.make_buffer_tensor(epi[2], max_size=False)
                col_bias = [bs[n0 + fx.get_scalar(cols[i])].to(fx.Float32)
                            for i in range_constexpr(0, n_acc, per_col)]
                vals = [vals[i] + col_bias[i // per_col] for i in range_constexpr(n_acc)]
        frag_out = fx.make_fragment_like(frag_C, out_t)
        for i in range_constexpr(n_acc):
            frag_out[i] = vals[i].to(out_t)

        out_copy = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), out_t)
        thr_r2g = fx.make_tiled_copy_C(out_copy, tiled_mma).get_slice(tid)
        r_rows = thr_r2g.partition_S(fx.make_view(0, fx.make_layout((tile_m, tile_n), (1, 0))))
        r_cols = thr_r2g.partition_S(fx.make_view(0, fx.make_layout((tile_m, tile_n), (0, 1))))
        pred_C = fx.make_fragment_like(r_rows, dtype=fx.Boolean)  # one per 16-bit store
        m_left = M - m0
        n_left = N - n0
        src, dst = thr_r2g.retile(frag_out), thr_r2g.partition_S(gC)
        if (m_left >= tile_m) & (n_left >= tile_n):  # interior block: no per-store branches
            fx.copy(out_copy, src, dst)
        else:
            for i in range_constexpr(fx.size(pred_C.shape).unpack()):
                pred_C[i] = (fx.get_scalar(r_rows[i]) < m_left) & (fx.get_scalar(r_cols[i]) < n_left)
            fx.copy(out_copy, src, dst, pred=pred_C)

    return gemm


def _flatten(t):
    return [y for x in t for y in _flatten(x)] if isinstance(t, (tuple, list)) else [t]


def grid_for(M, N, tile_m, tile_n):
    """A 1-D grid: `block_tile` maps each block to its (m, n) tile."""
    return (((M + (tile_m - 1)) // tile_m) * ((N + (tile_n - 1)) // tile_n), 1, 1)


XCDS = 8  # MI300X and MI355X: consecutive workgroups go round-robin to 8 dies with own L2s
GROUP_M = 8


def block_tile(pid, tiles_m, tiles_n, select):
    """Tile (m, n) of block `pid`, a bijection on [0, tiles_m * tiles_n) (checked in Python).

    Blocks that the hardware places on one XCD get consecutive tile numbers, and tiles are
    numbered in bands of GROUP_M rows (column by column inside a band), so blocks running at
    the same time on one die share A rows and B columns in that die's L2 (Triton's grouped
    ordering plus the XCD remap of AMD's GEMM kernels). `select(c, a, b)` is `a if c else b`.
    """
    total = tiles_m * tiles_n
    per_xcd = (total + (XCDS - 1)) // XCDS
    tall = total % XCDS  # dies that get per_xcd blocks; the others get one fewer (0: all)
    xcd, local = pid % XCDS, pid // XCDS
    pid = select((xcd < tall) | (tall == 0), xcd * per_xcd + local,
                 tall * per_xcd + (xcd - tall) * (per_xcd - 1) + local)
    in_band = GROUP_M * tiles_n
    first_m = (pid // in_band) * GROUP_M
    band_m = select(tiles_m - first_m < GROUP_M, tiles_m - first_m, GROUP_M)
    r = pid % in_band
    return first_m + r % band_m, r // band_m


def _select(cond, a, b):
    return cond.select(a, b)


# (tile_m, tile_n, tile_k for 16-bit inputs, (waves_m, waves_n), mfma, stages). The FP8 GEMM
# doubles tile_k, so both read the same bytes per K tile.
_CONFIG_TABLE = (
    (16, 64, 128, (1, 4), 16, 2),
    (16, 128, 128, (1, 4), 16, 1),
    (32, 64, 128, (1, 4), 16, 2),
    (64, 64, 64, (2, 2), 16, 2),
    (64, 128, 64, (2, 2), 16, 2),
    (128, 128, 64, (2, 2), 16, 2),
    (128, 128, 64, (2, 2), 32, 1),
    (256, 128, 64, (2, 2), 32, 1),
    (128, 256, 64, (2, 4), 32, 1),
    (256, 256, 64, (2, 4), 32, 2),  # 128 KiB of LDS: gfx950 only
)


def configs(tile_k_scale: int) -> tuple[dict, ...]:
    """The config space of a GEMM template, as dicts of plain ints."""
    return tuple({"tile_m": m, "tile_n": n, "tile_k": k * tile_k_scale, "waves_m": w[0], "waves_n": w[1],
                  "mfma": mfma, "stages": stages} for m, n, k, w, mfma, stages in _CONFIG_TABLE)


def spills_sgprs(config, target, sig) -> bool:
    """The configs whose kernels spill: the 256-row tiles with 32-wide MFMA (256 x 128, and
    256 x 256 on gfx950) spill about 50 SGPRs, which LLVM keeps in VGPR lanes (v_writelane /
    v_readlane; their resource reports show no private memory), a few instructions per K tile."""
    return config["tile_m"] == 256 and config["mfma"] == 32


def template_rules(tile_k_scale: int, elem_bytes: int):
    """(configs, valid, heuristic) of a GEMM template whose inputs take ``elem_bytes`` bytes and
    whose K tiles are ``tile_k_scale`` times the 16-bit ones."""
    table = configs(tile_k_scale)

    def valid(config, target, sig):
        return check_config(config, target, elem_bytes) is None

    def heuristic(target, sig, problem):
        return pick_config(table, target, elem_bytes, problem)

    return table, valid, heuristic


def kernel_for(config, *, target, ab_dtype, out_dtype, epilogue, tile_of_block=None):
    """The ``gemm`` kernel of ``config`` (see make_gemm_kernel), and its launch geometry:
    (kernel, tile_m, tile_n, threads per block)."""
    kernel = make_gemm_kernel(target=target, ab_dtype=ab_dtype, out_dtype=out_dtype, epilogue=epilogue,
                              tile_of_block=tile_of_block,
                              **{k: config[k] for k in ("tile_m", "tile_n", "tile_k", "waves_m", "waves_n",
                                                        "mfma", "stages")})
    return kernel, config["tile_m"], config["tile_n"], threads_of(config)
