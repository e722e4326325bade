"""RMSNorm and fused residual-add + RMSNorm, CuTe DSL (Hopper).

  rmsnorm:      kernel(x, weight, y, eps)
                y = (x.float() * rsqrt(mean(x.float()^2) + eps) * weight.float()).to(dtype)
  rmsnorm_add:  kernel(x, residual, weight, y, new_residual, eps)
                new_residual = (x.float() + residual.float()).to(dtype)
                y = rmsnorm(new_residual) as above (from the rounded new_residual)

x, residual, y, new_residual: [M, N] compact row-major, bf16, fp16 or fp32 (sig["dtype"]);
weight: [N] of that dtype, or fp32 with sig["fp32_weight"] (mixed-precision checkpoints); fp32
math; eps: a Python float. M and N are dynamic: one artifact serves every shape. With
sig["fp32_residual"] (16-bit x) residual and new_residual are fp32 (a residual stream kept in
fp32): new_residual = x.float() + residual, unrounded, and y is normalized from it; the
residual's accesses are twice as wide as x's (a 16-byte vector of x meets two 16-byte accesses;
one element of x, one fp32 element; the phased middle of odd rows, two 16-byte accesses).

A CTA owns ``rows_per_block`` rows, each handled by ``threads / rows_per_block`` threads (see
``_rowwise_plan``). A thread issues all loads of its part of the row's first tile (``chunks``
vectors, as wide as the rows admit) at once, and keeps that part in registers, packed, from the
sum of squares to the normalize pass: a row of up to ``tile_k`` elements crosses DRAM once
(read x [+ residual], write y [+ new_residual]). Rows past 16K elements (8K fp32) are split
over a thread-block cluster of 2-16 CTAs, each holding its share of the row the same way; the
row's sum of squares meets over distributed shared memory (``_cute_rowwise``'s cluster
reduction: each warp pushes its partial to every CTA of the cluster, no CTA waits for another
to exit). A row longer than the config's whole tile (only past 256K elements, or with a config
forced) has the rest of each CTA's share streamed a vector at a time and read again (from L2,
usually) for the normalize pass; the heuristic picks the smallest tile that covers the row.

An fp32 weight with 16-bit x is read as two 128-bit vectors per vector of x. The weight under
the first tile is loaded ahead of pass 2 (cp.async into shared memory on vector rows, registers
for one element per access; see ``weight_mode``), so pass 2 computes the tile and stores it with no load between
its stores: read there, each weight vector was a round trip after the store before it. On
phased rows (odd hidden sizes) the weight under the aligned middle of x sits at another offset
from a 16-byte boundary in every row: it is read one element per load, or, with the config key
``"weight": "vectors"``, in the aligned 16-byte loads around it, moved into place in registers
(``_word_shift.shifted_words``).
"""
import functools
import operator

from mslk_dsl.template import Template
from mslk_dsl.templates import _kernel_limits as limits
from mslk_dsl.templates import _rowwise_plan as plan
from mslk_dsl.templates._word_shift import shifted_words

DTYPES = ("bfloat16", "float16", "float32")

# (threads, rows_per_block, chunks) -> tile_k for 16-bit dtypes (half for fp32): 2048 (a warp
# per row, 4 rows per CTA), 4096, 8192 and 16384 with 128-bit vectors; 4096, 8192 (256 threads)
# and 16384 (512) with scalar accesses (unaligned rows; see SCALAR_STREAMED_TILES). Longer rows
# are split over a cluster, each CTA holding its share in registers: 256 x 8 vectors (16K
# elements, 8K fp32) per CTA in clusters of 2, 4, 8 and 16 (32K-256K; fp32 16K-128K; 16 CTAs is
# a non-portable cluster size, which Hopper runs), 512 x 8 in clusters of 8 (256K; fp32 128K).
# One CTA of 1024 threads holding 32K (the rest of a longer row streamed and read again) is kept as
# a config, listed after the clusters so that the heuristic's tie-break takes the 2-CTA cluster at
# 16K-32K: measured on the H200 (bf16, CUDA-graph replays, docs/benchmarks.md) 22.4 against 26.1 us
# at 512 x 32768, 6.8 against 7.6 us at one row of 32768 (rmsnorm_add 39.1 / 43.0 and 7.7 / 9.6 us);
# past 32K the clusters win by more (2048 x 65536: 135.0 against 152.5 us). Unaligned rows (one
# element per access, 512 x 32 per CTA) get clusters of 2 and 4 too (32K and 64K; see _heuristic).
# Short rows (per-head q / k norms of 64-256, MLA's latent norm of 512, MoE widths of 700-1000):
# 4, 8 or 16 rows per CTA of 128 threads, tiles of 128-1024 elements (one element per access:
# 256-2048), rather than 2048- or 4096-element tiles of mostly idle lanes. H200, bf16, CUDA-graph
# replays (docs/benchmarks.md, "Short rows"): 262144 x 128 rmsnorm 37 us against 217 in the 2048
# tile, 183700 x 722 150 against 207, 82344 x 379 (one element per access) 55 against 299.
# A 1536 tile (4 x 6 chunks) was tried and dropped: no faster than 2048 at 1408 and 1536, and
# 4-8x slower on rows of 4-byte accesses (557 against 150 us at 183700 x 722).
SHORT_ROWS = [(128, 16, 2), (128, 8, 2), (128, 8, 4), (128, 4, 4)]
SHORT_SCALAR_ROWS = [(128, 4, 8), (128, 4, 16), (128, 4, 32), (128, 2, 32)]
CONFIGS = tuple(
    plan.expand(vector_shapes=[(128, 4, 8), (128, 2, 8), (128, 1, 8), (256, 1, 8), *SHORT_ROWS],
                scalar_shapes=[(256, 1, 16), (256, 1, 32), (512, 1, 32), *SHORT_SCALAR_ROWS])
    + [c for n in (2, 4, 8, 16) for c in plan.clustered(plan.expand(vector_shapes=[(256, 1, 8)], scalar_shapes=[]), n)]
    + plan.clustered(plan.expand(vector_shapes=[(512, 1, 8)], scalar_shapes=[]), 8)
    + plan.expand(vector_shapes=[(1024, 1, 4)], scalar_shapes=[])
    + [c for n in (2, 4) for c in plan.clustered(plan.expand(vector_shapes=[], scalar_shapes=[(512, 1, 32)]), n)])
# The single-CTA one-element tiles again with the phased middle's weight read as aligned 16-byte
# loads moved into place in registers (``"weight": "vectors"``) rather than one element per load:
# a warp's one-element weight loads touch as many cache lines per instruction as its 16-byte x
# loads, eight instructions per vector of x, two per vector this way. rmsnorm's heuristic takes
# them for tiles of 2048 elements and more (WEIGHT_VECTOR_FROM); rmsnorm_add does not (timed
# level, below).
WEIGHT_VECTOR_CONFIGS = tuple({**c, "weight": "vectors"} for c in CONFIGS if c["vec"] == 1 and "cluster" not in c)
# Holding the weight's 16-byte words takes the phased kernels of the 8192 and 16384 tiles 77 and
# 74 registers per thread (bf16) where the one-element weight's take 62 and 58: three CTAs of 256
# threads per SM instead of four, one of 512 instead of two. These two again with the phased
# kernel capped at WEIGHT_VECTOR_REGS (``regs``), the twin's occupancy, for a same-dtype weight
# (an fp32 weight's words spill 28-38 bytes per thread under the cap).
WEIGHT_VECTOR_REGS = 64
WEIGHT_VECTOR_CAPPED = tuple({**c, "regs": WEIGHT_VECTOR_REGS} for c in WEIGHT_VECTOR_CONFIGS
                             if c["rows_per_block"] == 1 and c["chunks"] == 32)
CONFIGS = (CONFIGS + WEIGHT_VECTOR_CONFIGS + WEIGHT_VECTOR_CAPPED
           + tuple(plan.expand(vector_shapes=[], scalar_shapes=plan.SHORT_SCALAR_GROUP_ROWS)))
# rmsnorm_add with an fp32 residual stream (sig["fp32_residual"]) holds 6 bytes an element of its
# tile (x and the fp32 residual in flight together) where the same-dtype form holds 4: its tiles
# of 8 vectors a thread take 126-128 registers, and cut into 4-byte accesses (capped at
# NARROW_REGS) they spill 40-88 bytes a thread (80% of copy at 4096 x 7170 on an H100, where the
# 8- and 16-byte rows reach 97-99%). Each such tile again with twice the threads, 4 vectors each
# (the same row tile: HALVED_TWINS maps one to the other), for those signatures only. Timed beside
# every config of the fused kernels (H100, CUDA events; docs/benchmarks.md "rmsnorm_add with an
# fp32 residual stream, fused"): the 4-byte rows' twins ran 99-102% of copy (4096 x 7170: 124
# against 155 us), so those rows take them (_halved_twin); at 8- and 16-byte rows the tiles of 8
# stayed within 2% of the fastest config and are kept.
HALVED_TWINS = {(128, 4, 8): (256, 4, 4), (128, 2, 8): (256, 2, 4), (128, 1, 8): (256, 1, 4), (256, 1, 8): (512, 1, 4)}
FP32_RESIDUAL_CONFIGS = tuple(c for c in plan.expand(vector_shapes=list(HALVED_TWINS.values()), scalar_shapes=[])
                              if c["vec"] == 8)

# Registers per thread for the 1024-thread CTAs (the most a CTA of 1024 threads may use), and
# for tiles cut into 8- or 4-byte accesses (512 threads per SM: the occupancy floor).
LONG_ROW_REGS = 64
NARROW_REGS = 128

# Register tiles a thread holds at once (rmsnorm_add: x and residual while they load), for the
# register budget of _rowwise_plan.valid.
ARRAYS = 2


def _valid(config, target, sig):
    # "weight": "vectors" changes the phased kernel of single-CTA one-element tiles of 16-bit rows
    # only (fp32 rows read their weight in 4-byte accesses already; holding twice the words cost
    # them 8-38 registers per thread, spilling in some, for half the gain).
    if "weight" in config and (config["weight"] != "vectors" or config["vec"] != 1 or "cluster" in config
                               or limits.ELEM_BYTES[sig["dtype"]] != 2):
        return False
    if "regs" in config and ("weight" not in config or sig.get("fp32_weight")):
        return False
    if config in FP32_RESIDUAL_CONFIGS and not sig.get("fp32_residual"):
        return False
    return plan.valid(config, sig, arrays=ARRAYS)


# Unaligned rows (one element per access) past the single CTA's 16K elements: either that CTA
# streams the rest of the row and reads it again for pass 2 (each input: x, and rmsnorm_add's
# residual), or a cluster of 2 or 4 such CTAs holds the whole row. Each of these CTAs takes a
# whole SM (512 threads, about 128 registers) however full it is, so the cluster costs its
# capacity (k x 16K elements) where the single CTA costs the row plus the rest read again: the
# cluster is taken where that capacity is the smaller, or where the single-CTA grid leaves SMs
# idle (fewer rows than SMs). Measured on the H200 (rmsnorm and rmsnorm_add, bf16 and fp16;
# docs/benchmarks.md "Unaligned rows past 16K elements"): set on 72 timings (50 of random
# shapes), where it takes the faster plan at 69 (the other 3 are 4-14% slower than it); checked
# on 40 of shapes drawn afterwards: the faster plan at 37, the other 3 within 2.3%.
SMS = limits.MULTIPROCESSORS["sm90a"]  # fewer single-CTA rows than this leave SMs idle


# Rows a little longer than a tile (the rest at most 1/8 of the row; a single CTA's tile, or a
# cluster's, each CTA streaming the rest of its share): that tile, rather than the next tile up,
# whose lanes past the row idle (half of them, just past a tile) while the rest is a few
# re-reads from L2. H200, bf16, CUDA-graph replays of every config near the row
# (docs/benchmarks.md, "Rows of 4-byte accesses"): rows of 4-byte accesses 32768 x 4098 149 us
# in the 4096 tile against 188 in the 8192 tile, 2009 x 16898 53 us in the 16384 tile against 68
# in a 2-CTA cluster; 16-byte rows 2025 x 16568 40 against 45 us, 1009 x 33256 (2-CTA cluster)
# 43 against 49 us. With a rest of 23-32% (3168 x 21180, 2798 x 23980) the next tile up wins or
# ties (101 against 126 us). Rows of one element per access keep their own rule (below).
STREAMED_REST_THREADS = 256  # single CTAs of at most this many threads (a 1024-thread CTA loses to the clusters)


def _streamed_rest_tile(configs, sig, n):
    """plan.streamed_rest over the clusters and the single CTAs of at most STREAMED_REST_THREADS,
    not the short-row tiles (the rule was measured on tiles of 2048 elements and more)."""
    return plan.streamed_rest([c for c in configs if ("cluster" in c or c["threads"] <= STREAMED_REST_THREADS)
                               and not _short(c)], sig, n, ARRAYS)


def _short(config) -> bool:
    return plan.has_shape(config, SHORT_ROWS, SHORT_SCALAR_ROWS)


# rmsnorm (not rmsnorm_add) on rows of one element per access past 1024 elements: tiles of
# 1024-8192 elements in CTAs of at most 256 threads, a row longer than its tile reading the rest
# again (from L2), rather than the smallest covering tile in a CTA of 512 threads. H200, bf16,
# CUDA-graph replays of every config near the row (docs/benchmarks.md, "One-element rows: the
# phased path in a kernel of its own"): the 2048 tile at 35044 x 3631 155.6 us against 166.0 in
# the covering 4096 one, the 8192 tile at 32045 x 5911 221.0 against 327.7 in the covering
# 512-thread 8192 tile (that config is gone), at 11092 x 15885 198.7 against 218.6 in the covering
# 16384 tile (512 threads, 116 registers: one CTA per SM). The one-warp 1024 tile takes rows at
# most a quarter past it (75.6 against 91.7 us at 33132 x 1309 when one kernel held both paths;
# 61.8 against 59.9 since). rmsnorm_add reads two inputs again: it keeps the covering tiles
# (its 2048 tile lost at 35044 x 3631, 278.7 against 256.7 us; the 8192 one at 11092 x 15885,
# 369.2 against 353.7).
SCALAR_STREAMED_TILES = (   # (tile, the longest row it takes)
    (plan.config(128, 4, 1, 32), 1280),    # one warp per row: 1024 elements
    (plan.config(128, 2, 1, 32), 4915),    # two warps per row: 2048
    (plan.config(256, 1, 1, 32), 16384),   # 8192
)


# rmsnorm (not rmsnorm_add) on rows of one element per access, a 16-bit x and a weight of its
# dtype: the pick's "weight": "vectors" twin where its tile holds at least WEIGHT_VECTOR_FROM
# elements, the 8192 tile's capped at WEIGHT_VECTOR_REGS (its uncapped twin, three CTAs per SM, was
# the slower of the two at 5911 and 6783). Measured on an H100 (no H200 was lent; bf16, CUDA-graph
# replays of every config near the row, one run; docs/benchmarks.md "rmsnorm on odd hidden sizes"),
# us, pick -> twin: 32045 x 5911 259.3 -> 256.6, 10615 x 6783 103.6 -> 101.9, 15788 x 8113 178.1
# -> 177.2, 2681 x 7929 36.9 -> 35.6 (the 8192 tile); 1343 x 4853 16.8 -> 15.7, 28384 x 4279 177.1
# -> 174.5, 35044 x 3631 185.3 -> 186.0 (the 2048 tile); the 1024 tile's twin did not gain
# (79096 x 1085 122.7 -> 123.5), nor did rmsnorm_add's twins (within 1% either way), whose x and
# residual loads outnumber the weight's. An fp32 weight's twins were not timed.
WEIGHT_VECTOR_FROM = 2048


def _weight_vector_twin(config, sig):
    """``config``'s "weight": "vectors" twin (capped where the template lists one) where rmsnorm's
    heuristic takes it (see above), else ``config``."""
    if (sig.get("fp32_weight") or not limits.one_element(sig) or limits.ELEM_BYTES[sig["dtype"]] != 2
            or "cluster" in config or plan.RowTile.of(config).row_k < WEIGHT_VECTOR_FROM):
        return config
    twin = {**config, "weight": "vectors"}
    capped = {**twin, "regs": WEIGHT_VECTOR_REGS}
    return capped if capped in WEIGHT_VECTOR_CAPPED else twin if twin in WEIGHT_VECTOR_CONFIGS else config


def _halved_twin(config, sig):
    """An fp32-residual tile cut into 4-byte accesses: its HALVED_TWINS twin (the same row tile in
    twice the threads; see FP32_RESIDUAL_CONFIGS), where it has one; else ``config``."""
    shape = (config["threads"], config["rows_per_block"], config["chunks"])
    if (not sig.get("fp32_residual") or "cluster" in config or shape not in HALVED_TWINS
            or sig["vec_bytes"] != 4):
        return config
    threads, rows, chunks = HALVED_TWINS[shape]
    return {**config, "threads": threads, "rows_per_block": rows, "chunks": chunks}


def _heuristic(target, sig, problem, residual: bool = False):
    config = _plain_heuristic(sig, problem, residual)
    return _halved_twin(config, sig) if residual else _weight_vector_twin(config, sig)


# One-element rows of at most 512 (rmsnorm) or 256 (rmsnorm_add) elements: the group tiles of
# _rowwise_plan.short_group_pick (measured there), 8 lanes a row to 256 elements and 16 lanes
# for 512 in rmsnorm; rmsnorm_add (timed in the first round only) 16 lanes past 64.
SHORT_GROUP_PICKS = [(128, 16, 8), (128, 16, 16), (128, 16, 32), (128, 8, 32)]
SHORT_GROUP_PICKS_ADD = [(128, 16, 8), (128, 8, 8), (128, 8, 16)]


def _plain_heuristic(sig, problem, residual: bool):
    n = problem["N"]
    short = plan.short_group_pick(CONFIGS, sig, n, ARRAYS, SHORT_GROUP_PICKS_ADD if residual else SHORT_GROUP_PICKS,
                                  rest_past_64=not residual)
    if short is not None:
        return short
    configs = [c for c in CONFIGS if "weight" not in c and not plan.short_scalar_groups(c)]
    streamed = _streamed_rest_tile(configs, sig, n)
    if streamed is not None:
        return streamed
    if limits.one_element(sig):
        streamed = None if residual else plan.scalar_tile(SCALAR_STREAMED_TILES, sig, n)
        if streamed is not None:
            return streamed
        scalar = [c for c in configs if c["vec"] == 1]
        single = max(plan.RowTile.of(c).row_k for c in scalar if "cluster" not in c)
        clusters = [plan.RowTile.of(c).row_k for c in scalar if "cluster" in c]
        capacity = min((k for k in clusters if k >= n), default=max(clusters))
        rows = problem.get("M")
        few_rows = isinstance(rows, int) and rows < SMS
        streamed = n + (2 if residual else 1) * max(n - single, 0)
        if not few_rows and capacity >= streamed:
            configs = [c for c in configs if not (c["vec"] == 1 and "cluster" in c)]
    return plan.pick(configs, sig, n, arrays=ARRAYS)


def _build(config, target, sig, residual):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32, const_expr
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cutlass_dsl import T

    from mslk_dsl.templates import _cute_reduce as red
    from mslk_dsl.templates import _cute_rowwise as rw

    tile = plan.access_tile(config, sig)
    dtype = rw.dsl_dtype(sig["dtype"])
    wdtype = Float32 if sig.get("fp32_weight") else dtype
    # The residual stream's dtype: x's, or fp32 (sig["fp32_residual"]: the sum is kept in fp32,
    # stored as new_residual and normalized unrounded; only y rounds to x's dtype).
    fp32_residual = bool(sig.get("fp32_residual"))
    rdtype = Float32 if fp32_residual else dtype

    def add_rounded(a, b):
        """x + residual in fp32, rounded to the residual's dtype."""
        return (a.load().to(Float32) + b.load().to(Float32)).to(rdtype)

    def row_body(t, phased: bool):
        """The kernel body for tile ``t``; ``phased``: t is the phased tile of a one-element
        config and the rows are congruent (rw.PhasedRow): the row's aligned middle in t's
        vectors, its edges one element at a time."""
        tpr, vec, chunks = t.tpr, t.vec, t.chunks
        # The weight under a vector of x, in ``wparts`` accesses of ``wvec`` elements (at most 16
        # bytes: two for an fp32 weight under 8 bf16 / fp16 values). A phased row's middle is
        # aligned in x, not in the weight (the weight's columns start at the row's head): one
        # element per access there.
        wvec = 1 if phased else min(vec, 16 // (wdtype.width // 8))
        wparts = vec // wvec
        # The phased middle's weight read as aligned 16-byte words and shifted into place
        # (config key "weight": "vectors"; see _word_shift.shifted_words).
        shifted = phased and config.get("weight") == "vectors"
        w_bytes = vec * wdtype.width // 8          # weight bytes under one vector of x: 16 or 32
        w_loads = w_bytes // 16 + 1                # 16-byte loads that cover them at any offset

        # Where the weight under the row's first tile waits for pass 2 (see the kernel):
        #  "smem":      vector rows: cp.async at the start into shared memory, a slot per thread;
        #               no registers held, so the kernel keeps the occupancy of x alone (a 1024-
        #               thread CTA takes 64 KB, 128 KB for an fp32 weight: still one CTA per SM);
        #  "registers": one element per access (cp.async moves 4-16 bytes, not one 16-bit
        #               element): loaded before the row reduction into registers of its own
        #               (their configs have at most 512 threads, with no register cap).
        #  "shifted":   the phased middle with the "vectors" weight key: each vector's weight
        #               from the 16-byte loads around it, moved into place in registers (the
        #               offset is the same for every vector of the row: w_bytes is a multiple of 16).
        weight_mode = "shifted" if shifted else ("registers" if wvec == 1 else "smem")

        def load_weight(vW, wraw, col, j):
            """Issue the loads of the weight under vector j of x into columns col * wparts.. of wraw."""
            for p in range(wparts):
                cute.copy(rw.weight_atom(wdtype, wvec), vW[None, j * wparts + p], wraw[None, col * wparts + p])

        def smem_weight_values(sW, wf, tidx, col):
            """The weight of column ``col`` of this thread's shared-memory slots, as fp32 (vec,) values."""
            if const_expr(wparts == 1):
                return sW[None, tidx, col].load().to(Float32)
            for e in range(vec):
                wf[e, 0] = Float32(sW[e % wvec, tidx, col * wparts + e // wvec])
            return wf.load()

        def weight_values(wraw, wf, col, ss=None):
            """The weight loaded into column ``col`` of wraw (load_weight), as fp32 (vec,) values;
            with ``ss`` (the row's sum of squares) converted only once that is known: a 16-bit
            weight loaded ahead of the reduction then stays packed through it (see red.after)."""
            if const_expr(wparts == 1):
                packed = wraw[None, col].load()
                if const_expr(ss is not None):
                    packed = red.after(packed, ss)
                return packed.to(Float32)
            for e in range(vec):
                wf[e, 0] = Float32(wraw[e % wvec, col * wparts + e // wvec])
            return wf.load()

        @cute.jit
        def load_shifted(wbase, woff: Int32, words: cute.Tensor, col: cutlass.Constexpr[int], j: Int32):
            """Issue the 16-byte loads around the weight of middle vector ``j`` into column ``col``
            of ``words``: the last one only where the weight starts past a 16-byte boundary (then
            it holds some of the vector's weight; else it may lie wholly past the weight's end)."""
            w128 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                       l1c_evict_priority=rw.KEEP)
            for k in cutlass.range_constexpr(w_loads):
                ptr = cute.make_ptr(Int32, wbase + j * w_bytes + 16 * k, cute.AddressSpace.gmem, assumed_align=16)
                src = cute.make_tensor(ptr, cute.make_layout(4))
                if const_expr(k < w_loads - 1):
                    cute.copy(w128, src, words[None, k, col])
                else:
                    if woff != 0:
                        cute.copy(w128, src, words[None, k, col])

        def shifted_values(words, col, woff, ss=None):
            """The weight of column ``col`` of ``words`` (load_shifted), as fp32 (vec,) values; with
            ``ss`` converted only once that is known (see weight_values)."""
            if const_expr(ss is not None):
                # The shifts read the sum of squares (its sign bit: 0), so ptxas cannot move them
                # above the row reduction, where the raw and the shifted words would both be held
                # (rmsnorm_add, bf16, 256 x 32: 118 registers per thread without this, 74 with it).
                woff = woff | Int32(Uint32(llvm.bitcast(T.i32(), ss.ir_value())) >> 31)
            flat = [words[e % 4, e // 4, col] for e in range(4 * w_loads)]
            packed = cute.make_rmem_tensor(w_bytes // 4, Int32)
            funnel = rw.funnel_right if const_expr(wdtype.width == 16) else None   # an fp32 weight: whole words
            for m, word in enumerate(shifted_words(flat, woff, w_bytes // 4, rw.select_word, funnel)):
                packed[m] = word
            values = cute.recast_tensor(packed, wdtype).load()
            if const_expr(ss is not None):
                values = red.after(values, ss)
            return values.to(Float32)

        @cute.jit
        def body(mX: cute.Tensor, mR, mW: cute.Tensor, mY: cute.Tensor, mRO, eps: Float32):
            n = mX.shape[1]
            smem = cutlass.memory.SmemAllocator()
            tidx, _, _ = cute.arch.thread_idx()
            # This thread's row and the row's vectors [base, nvec) its CTA holds: all of them, or
            # the CTA's share when a cluster splits the row. None past the last row (those
            # threads still join the barriers).
            if const_expr(t.cluster == 1):
                # The config's tile, not the phased one: its nvec counts single elements, so
                # nvec > 0 marks a live row even one shorter than a phased vector.
                row, row_in_cta, lane, nvec = rw.cta_row(tile, mX.shape[0], n)
                base = Int32(0)
            else:
                row_in_cta, lane = Int32(0), tidx
                row, base, nvec = rw.cluster_row(t, mX.shape[0], n)
                row = cutlass.min(row, mX.shape[0] - 1)
                cslots = rw.ClusterSlots(smem, t)
                rw.cluster_reduction_start(cslots)
            if const_expr(phased):
                pr = rw.phased_row(mX, row, n, vec, nvec > 0)
                nvec = pr.nmid
                vX, vY = pr.middle(mX), pr.middle(mY)
                vW = cute.zipped_divide(cute.make_tensor(mW.iterator + pr.head, mW.layout), (1,))
                if const_expr(shifted):
                    # The weight of middle vector j starts woff bytes past wbase + j * w_bytes.
                    waddr = (mW.iterator + pr.head).toint()
                    woff = Int32(waddr % 16)
                    wbase = waddr - woff
            else:
                vX, vY = rw.row_vectors(mX, row, vec), rw.row_vectors(mY, row, vec)
                vW = cute.zipped_divide(mW, (wvec,))
            first = base + lane
            wraw = cute.make_rmem_tensor((wvec, wparts), wdtype)
            wf = cute.make_rmem_tensor((vec, 1), Float32)
            srcs = (vX,)
            if const_expr(residual):
                if const_expr(phased):
                    vRO = pr.middle(mRO)
                    srcs = (vX, pr.middle(mR))
                else:
                    vRO = rw.row_vectors(mRO, row, vec)
                    srcs = (vX, rw.row_vectors(mR, row, vec))
            buf = rw.reduction_buffer(smem, t) if const_expr(t.cluster == 1) else None

            # Pass 1, first tile: every load in flight before the first use. `held` becomes the
            # row to normalize: x, or the new residual in its dtype (stored right away).
            ins = rw.tile_fragments(t, [dtype, rdtype][:len(srcs)])
            rw.load_tile(srcs, ins, first, tpr, nvec)
            # The row to normalize is held in the residual's fragment when that is fp32 (x's
            # fragment, free once added, then takes y); else in x's.
            held = ins[1] if const_expr(fp32_residual) else ins[0]
            out = ins[0]
            if const_expr(phased):
                # The row's edges, one element per lane, read with the first tile and kept as it is.
                row_tensors = (mX, mR) if const_expr(residual) else (mX,)
                edge_ins = rw.edge_fragments(t, [dtype, rdtype][:len(row_tensors)])
                for rt, f in zip(row_tensors, edge_ins):
                    rw.copy_edges(pr.elements(rt), f, pr, lane, tpr, load=True)
                edge_held = edge_ins[1] if const_expr(fp32_residual) else edge_ins[0]
            if const_expr(weight_mode == "smem"):
                # The first tile's weight, behind x: it lands in shared memory while x is
                # reduced. Column c of thread t at [:, t, c]: a warp's 16-byte accesses of one
                # column are contiguous (no bank conflicts).
                sW = smem.allocate_tensor(wdtype, cute.make_layout((wvec, t.threads, wparts * chunks),
                                                                   stride=(1, wvec, wvec * t.threads)),
                                          byte_alignment=16)
                w_async = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), wdtype,
                                              num_bits_per_copy=wvec * wdtype.width)
                for i in cutlass.range_constexpr(chunks):
                    jw = first + i * tpr
                    if jw < nvec:
                        for p in cutlass.range_constexpr(wparts):
                            cute.copy(w_async, vW[None, jw * wparts + p], sW[None, tidx, i * wparts + p])
                cute.arch.cp_async_commit_group()
            if const_expr(residual):
                held.store(add_rounded(ins[0], ins[1]))
                rw.copy_vectors(held, vRO, first, tpr, nvec, load=False)
                if const_expr(phased):
                    edge_held.store(add_rounded(edge_ins[0], edge_ins[1]))
                    rw.copy_edges(edge_held, pr.elements(mRO), pr, lane, tpr, load=False)
            ss = red.sum_squares(held)
            if const_expr(phased):
                ss = ss + red.sum_squares(edge_held)
            # Rest of a row longer than the tile, one vector per thread per step (the compiler
            # unrolls and batches the loads); nothing is kept.
            a = cute.make_rmem_tensor((vec, 1), dtype)
            b = cute.make_rmem_tensor((vec, 1), rdtype)
            for j in cutlass.range(first + t.tile_vecs, nvec, tpr):
                rw.copy_vectors(vX, a, j, tpr, nvec, load=True)
                if const_expr(residual):
                    rw.copy_vectors(srcs[1], b, j, tpr, nvec, load=True)
                    h = b if const_expr(fp32_residual) else a
                    h.store(add_rounded(a, b))
                    rw.copy_vectors(h, vRO, j, tpr, nvec, load=False)
                    ss = ss + red.sum_squares(h)
                else:
                    ss = ss + red.sum_squares(a)

            # One element per access: the first tile's weight, issued now: its loads overlap the
            # row reduction. Loaded in pass 2 instead, a vector at a time between the stores of
            # y, each load waited for the store before it (the compiler cannot tell y from the
            # weight): one round trip per vector, which is what a short call (few rows, a cold
            # L2) is made of. Not earlier: held through the loop above, the weight would cost
            # that loop's registers.
            if const_expr(weight_mode == "registers"):
                # The weight under the first tile, zero-filled as the x tile (see rw.tile_fragments).
                wtile = cute.make_rmem_tensor((wvec, wparts * chunks), wdtype)
                wtile.fill(0)
                for i in cutlass.range_constexpr(chunks):
                    jr = first + i * tpr
                    if jr < nvec:
                        load_weight(vW, wtile, i, jr)
            if const_expr(weight_mode == "shifted"):
                wwords = cute.make_rmem_tensor((4, w_loads, chunks), Int32)
                wwords.fill(0)
                for i in cutlass.range_constexpr(chunks):
                    jr = first + i * tpr
                    if jr < nvec:
                        load_shifted(wbase, woff, wwords, i, jr)
            if const_expr(phased):
                edge_w = rw.edge_fragments(t, [wdtype])[0]
                rw.copy_edges(cute.zipped_divide(mW, (1,)), edge_w, pr, lane, tpr, load=True)
            if const_expr(t.cluster > 1):
                ss = rw.cluster_row_allreduce(ss, operator.add, 0.0, cslots)
            else:
                ss = rw.row_allreduce(ss, operator.add, tpr, buf, row_in_cta, lane)
            rstd = cute.math.rsqrt(ss / Float32(n) + eps, fastmath=True)

            # Pass 2: y = (h * rstd) * w, rounded once, into the registers of x's tile (out: the
            # row itself unless that is an fp32 residual); the tile is stored once all of it is
            # computed.
            if const_expr(weight_mode == "smem"):
                cute.arch.cp_async_wait_group(0)
            for i in cutlass.range_constexpr(chunks):
                h = red.after(held[None, i].load(), ss).to(Float32)
                if const_expr(weight_mode == "smem"):
                    out[None, i].store((h * rstd * smem_weight_values(sW, wf, tidx, i)).to(dtype))
                elif const_expr(weight_mode == "shifted"):
                    out[None, i].store((h * rstd * shifted_values(wwords, i, woff, ss)).to(dtype))
                else:
                    out[None, i].store((h * rstd * weight_values(wtile, wf, i, ss)).to(dtype))
            rw.copy_vectors(out, vY, first, tpr, nvec, load=False)
            if const_expr(phased):
                y_edges = edge_held.load().to(Float32) * rstd * edge_w.load().to(Float32)
                rw.store_edges(y_edges.to(dtype), pr.elements(mY), pr, lane, tpr)
            # The streamed rest: read back what pass 1 read (x) or wrote (new_residual).
            vH = vRO if const_expr(residual) else vX
            if const_expr(shifted):
                rest_words = cute.make_rmem_tensor((4, w_loads, 1), Int32)
                rest_words.fill(0)   # the last load's words, where it is not issued (woff == 0)
            h = b if const_expr(fp32_residual) else a   # what pass 1 wrote: new_residual's dtype
            for j in cutlass.range(first + t.tile_vecs, nvec, tpr):
                rw.copy_vectors(vH, h, j, tpr, nvec, load=True, evict=rw.KEEP)
                if const_expr(shifted):
                    load_shifted(wbase, woff, rest_words, 0, j)
                    a.store((h.load().to(Float32) * rstd * shifted_values(rest_words, 0, woff)).to(dtype))
                else:
                    load_weight(vW, wraw, 0, j)
                    a.store((h.load().to(Float32) * rstd * weight_values(wraw, wf, 0)).to(dtype))
                rw.copy_vectors(a, vY, j, tpr, nvec, load=False)

        return body

    # Rows of one element per access (single CTAs) run their aligned middle in vectors where the
    # row tensors are congruent (rw.PhasedRow), in a kernel of its own (rw.launch_rows).
    plain = row_body(tile, phased=False)
    vec = rw.phased_vec(tile, limits.ELEM_BYTES[sig["dtype"]])
    phased = row_body(plan.phased_tile(tile, limits.ELEM_BYTES[sig["dtype"]]), phased=True) if vec else None

    @cute.kernel
    def kernel(mX: cute.Tensor, mR, mW: cute.Tensor, mY: cute.Tensor, mRO, eps: Float32):
        plain(mX, mR, mW, mY, mRO, eps)

    @cute.kernel
    def phased_kernel(mX: cute.Tensor, mR, mW: cute.Tensor, mY: cute.Tensor, mRO, eps: Float32):
        phased(mX, mR, mW, mY, mRO, eps)

    # A 1024-thread CTA must fit the SM's register file: cap ptxas at LONG_ROW_REGS. A tile cut
    # into 8- or 4-byte accesses holds 2-4 times the addresses and predicates: capped at NARROW_REGS,
    # which keeps the occupancy floor (512 threads per SM), where ptxas would take more.
    if tile.threads > 512:
        hints = rw.launch_hints(tile, LONG_ROW_REGS)
    elif plan.cut_into_words(config, sig):
        hints = rw.launch_hints(tile, NARROW_REGS)
    else:
        hints = {}

    def launch(mX, mR, mW, mY, mRO, eps, stream):
        rows = (mX, mY, mR, mRO) if residual else (mX, mY)
        grid = {**rw.row_launch(tile, mX.shape[0]), "stream": stream}
        if const_expr("regs" in config):   # the phased kernel capped (WEIGHT_VECTOR_CAPPED)
            rw.launch_rows(rows, vec, kernel, phased_kernel, (mX, mR, mW, mY, mRO, eps),
                           {**grid, **rw.launch_hints(tile, config["regs"])}, plain_launch={**grid, **hints})
        else:
            rw.launch_rows(rows, vec, kernel, phased_kernel, (mX, mR, mW, mY, mRO, eps), {**grid, **hints})

    @cute.jit
    def rmsnorm(mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32, stream):
        launch(mX, None, mW, mY, None, eps, stream)

    @cute.jit
    def rmsnorm_add(mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor,
                    mRO: cute.Tensor, eps: Float32, stream):
        launch(mX, mR, mW, mY, mRO, eps, stream)

    # N a multiple of the signature's vector (v elements), every row and the weight starting on one
    # (the weight on 16 bytes at most: an fp32 weight under 8 16-bit values is two accesses).
    v, _ = rw.row_alignment(sig)
    m, n = rw.dynamic_rows_cols(v)
    rows = [rw.fake_rows(dt, m, n, min(v * dt.width // 8, 16)) for dt in (dtype, rdtype, dtype, rdtype)]
    weight = rw.fake_vector(wdtype, n, min(v * wdtype.width // 8, 16))   # an access moves at most 16 bytes
    tail = [Float32(1e-6), rw.env_stream()]
    if residual:
        return rmsnorm_add, [rows[0], rows[1], weight, rows[2], rows[3], *tail]
    return rmsnorm, [rows[0], weight, rows[2], *tail]


def _spilling_configs(config, target, sig, residual: bool = False) -> bool:
    """The configs whose kernels use local memory (resource reports):
    - one element per access over 32 chunks (the unaligned path for rows of up to 16K elements)
      keeps 8-24 bytes per thread in local memory; rows that are not 16-byte aligned are rare and
      their speed is not a goal;
    - fp32 x (4-element vectors: only fp32 rows take them) with 16 values per thread in a
      1024-thread CTA (64 registers each) or 32 in a smaller one: x, its fp32 weight and the
      sums outgrow the registers by 16-32 bytes per thread. Those tiles serve the longest fp32
      rows; the spill is a few stores per row, not measured against a spill-free plan yet;
    - rmsnorm_add in a 1024-thread CTA (a config the heuristic no longer takes: the clusters
      hold long rows): x and the residual of the tile in flight at once under the 64-register
      cap spill 16-32 bytes per thread of 16-bit rows;
    - tiles cut into 8- or 4-byte accesses (``plan.cut_into_words``): up to 32 bytes per thread of the
      fused add or of the 1024-thread CTAs."""
    values = config["vec"] * config["chunks"]
    long_fp32 = config["vec"] == 4 and values >= (16 if config["threads"] > 512 else 32)
    long_add = residual and config["threads"] > 512
    return (config["vec"] == 1 and config["chunks"] >= 32) or long_fp32 or long_add or plan.cut_into_words(config, sig)


def signatures(residual: bool) -> dict:
    """The norms' signature parts; rmsnorm_add's ``fp32_residual``: see _kernel_limits."""
    parts = {"dtype": DTYPES, "vec_bytes": limits.VECTOR_WIDTHS, "fp32_weight": (False, True)}
    return {**parts, "fp32_residual": (False, True)} if residual else parts


def _template(op, residual):
    return Template(op=op, backend="cute", targets=("sm90a",),
                    signatures=signatures(residual),
                    signature_valid=limits.norm_signature,
                    configs=CONFIGS + FP32_RESIDUAL_CONFIGS if residual else CONFIGS, valid=_valid,
                    heuristic=functools.partial(_heuristic, residual=residual),
                    build=functools.partial(_build, residual=residual),
                    spills_allowed=functools.partial(_spilling_configs, residual=residual),
                    occupancy_floor=limits.ROWWISE_OCCUPANCY_FLOOR)


TEMPLATES = [_template("rmsnorm", residual=False), _template("rmsnorm_add", residual=True)]
