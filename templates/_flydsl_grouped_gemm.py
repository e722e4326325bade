"""Grouped GEMM over stacked rows for CDNA3 / CDNA4 (FlyDSL): ``_flydsl_gemm``'s MFMA GEMM, one
output tile per block, each block finding its (group, tile) from M_sizes on the device.

    out[rows of group g] = epilogue(x[rows of group g] @ w[g]^T)
    x [total_M, K], w [G * N, K] (the [G, N, K] weights), out [total_M, N], M_sizes [G]

The output tiles of all groups form one list, group by group (M tiles fastest inside a group);
block b takes tile b. The grid is an upper bound known on the host, (total_M // tile_m +
min(G, total_M)) N-tiles (each non-empty group adds at most one partial M tile); a block past
the real count does one K tile of zeros and stores nothing. Each wave reads M_sizes 64 groups at
a time (a lane per group; wave prefix sums of tiles and rows by shuffles) and keeps the group
whose tile range holds b: G / 64 rounds of loads, no host sync, so calls capture in graphs.

The block's operands are then views of its group: x and out from the group's first row with the
group's row count as their extent, w from the group's first weight row. The GEMM's buffer
descriptors are bounded by those extents, so rows past the group's end read as zero and their
stores are dropped: a tile never touches another group's rows. Groups are cut at total_M when
sum(M_sizes) exceeds it. The FP8 scales are viewed the same way (x_scale from the group's first
row, w_scale [G * N] from the group's first column).

flydsl is imported lazily (inside the builders), like ``_flydsl_gemm``.
"""
from mslk_dsl.templates import _flydsl_gemm as gemm

WAVE = gemm.WAVE


def grouped_problem(problem):
    """The dense GEMM problem whose tiling suits a grouped call (the groups' sizes are on the
    device; this assumes an even spread): with decode-sized groups (under 64 rows on average)
    one group of the average size, so the tiles fit the groups' rows; else all the rows, so the
    tile count (and rounds over the CUs) is about the grouped call's."""
    m, groups = max(int(problem.get("M", 1)), 1), max(int(problem.get("G", 1)), 1)
    average = -(-m // min(groups, m))
    return {"M": average if average < 64 else m, "N": problem.get("N", 4096), "K": problem.get("K", 4096)}


# The dense GEMM's tiles that a grouped call uses (keeps the AOT build and the compile tests
# small): 16- and 32-row tiles for decode-sized groups, 64 x 128, and 128 x 128 / 128 x 256 for
# large groups (the 256-row tiles would mostly compute padding past a group's end).
_TILES = ((16, 64), (32, 64), (64, 128), (128, 128), (128, 256))


def template_rules(tile_k_scale: int, elem_bytes: int):
    """(configs, valid, heuristic) of a grouped template: those of the dense GEMM's configs with
    a tile in _TILES (the first of each), chosen by its cost model (see grouped_problem)."""
    dense, valid, _ = gemm.template_rules(tile_k_scale, elem_bytes)
    table = tuple(next(c for c in dense if (c["tile_m"], c["tile_n"]) == tile) for tile in _TILES)

    def heuristic(target, sig, problem):
        return gemm.pick_config(table, target, elem_bytes, grouped_problem(problem))

    return table, valid, heuristic


def grid_bound(total_m, groups, n, tile_m, tile_n):
    """Host side (traced): the grid, an upper bound of the tiles (see the module docstring)."""
    active = (groups < total_m).select(groups, total_m)
    return ((total_m // tile_m + active) * ((n + (tile_n - 1)) // tile_n), 1, 1)


def kernel_for(config, *, target, ab_dtype, scaled):
    """The grouped kernel of ``config`` (bf16 out; with ``scaled``, the FP8 rowwise-scale
    epilogue) and its launch geometry, as _flydsl_gemm.kernel_for."""
    return gemm.kernel_for(config, target=target, ab_dtype=ab_dtype, out_dtype="bfloat16",
                           epilogue="rowwise" if scaled else "none",
                           tile_of_block=make_tile_of_block(config["tile_m"], config["tile_n"], scaled=scaled))


def launch(kernel, x, w, out, epi, tile_m, tile_n, threads, stream):
    """Host side (traced): launch a kernel_for kernel over the tile bound; ``epi`` ends with
    M_sizes."""
    total_m, _ = x.shape.unpack()
    _, n = out.shape.unpack()
    kernel(x, w, out, epi).launch(grid=grid_bound(total_m, epi[-1].shape.unpack(), n, tile_m, tile_n),
                                  block=(threads, 1, 1), stream=stream)


def make_tile_of_block(tile_m, tile_n, scaled):
    """The ``tile_of_block`` hook of ``_flydsl_gemm.make_gemm_kernel`` for a grouped call; epi is
    (M_sizes,) or, ``scaled``, (x_scale, w_scale [G * N], M_sizes)."""
    import flydsl.expr as fx
    from flydsl.compiler.ast_rewriter import ASTRewriter
    from flydsl.expr import T, const_expr, gpu, range_constexpr

    def wave_scan(x, lane):
        for d in range_constexpr(WAVE.bit_length() - 1):
            up = fx.Int32(gpu.shuffle_up(x, 1 << d, WAVE))
            x = x + (lane >= (1 << d)).select(up, fx.Int32(0))
        return x

    def uniform(x):
        """``x`` (the same in every lane) as a wave-uniform value: in a scalar register."""
        return fx.Int32(fx.rocdl.readfirstlane(T.i32, fx.Int32(x)))

    def tile_of_block(x, w, out, epi):
        m_sizes = epi[-1]
        total_m, k = x.shape.unpack()
        _, n = out.shape.unpack()
        groups = m_sizes.shape.unpack()   # a 1-D shape unpacks to a scalar
        n_tiles = (n + (tile_n - 1)) // tile_n
        pid = fx.Int32(fx.block_idx.x)
        lane = fx.Int32(fx.thread_idx.x) % WAVE
        sizes = fx.get_iter(m_sizes)
        tiles_base, rows_base = fx.Int32(0), fx.Int32(0)
        group, first_row, rows_of, tile = fx.Int32(-1), fx.Int32(0), fx.Int32(0), fx.Int32(0)
        for chunk in range(0, groups, WAVE):
            g = chunk + lane
            rows = fx.Int32(sizes[(g < groups).select(g, groups - 1)])
            rows = ((g < groups) & (rows > 0)).select(rows, fx.Int32(0))
            tiles = (rows + (tile_m - 1)) // tile_m * n_tiles
            incl_tiles, incl_rows = wave_scan(tiles, lane), wave_scan(rows, lane)
            # Lanes whose inclusive tile sum is at or below the block's index: the count is the
            # lane of its group (sums only grow); a shuffle-xor sum gives it to every lane.
            local = pid - tiles_base
            below = (incl_tiles <= local).select(fx.Int32(1), fx.Int32(0))
            for d in range_constexpr(WAVE.bit_length() - 1):
                below = below + fx.Int32(gpu.shuffle_xor(below, 1 << d, WAVE))
            hit = (local >= 0) & (below < WAVE)
            src = (below < WAVE).select(below, fx.Int32(WAVE - 1))
            hit_first_tile = fx.Int32(gpu.shuffle_idx(incl_tiles - tiles, src, WAVE))
            hit_first_row = fx.Int32(gpu.shuffle_idx(incl_rows - rows, src, WAVE))
            hit_rows = fx.Int32(gpu.shuffle_idx(rows, src, WAVE))
            group = hit.select(chunk + src, group)
            first_row = hit.select(rows_base + hit_first_row, first_row)
            rows_of = hit.select(hit_rows, rows_of)
            tile = hit.select(local - hit_first_tile, tile)
            tiles_base = tiles_base + fx.Int32(gpu.shuffle_idx(incl_tiles, WAVE - 1, WAVE))
            rows_base = rows_base + fx.Int32(gpu.shuffle_idx(incl_rows, WAVE - 1, WAVE))
        # The search leaves the same values in every lane, but in vector registers (they come
        # from shuffles): read them once into scalar ones, so the views' buffer descriptors are
        # wave-uniform. Per-lane descriptors make the compiler loop over the wave's distinct
        # values (v_readfirstlane, exec masks) around every load and store of the main loop.
        group, first_row, rows_of, tile = uniform(group), uniform(first_row), uniform(rows_of), uniform(tile)
        live = group >= 0
        group = live.select(group, fx.Int32(0))
        # Cut at total_M (and a dead block's extent is 0: everything reads 0, nothing is stored).
        left = total_m - first_row
        length = (rows_of < left).select(rows_of, left)
        length = (live & (length > 0)).select(length, fx.Int32(0))
        m_tiles = (rows_of + (tile_m - 1)) // tile_m
        m_tiles = (m_tiles > 0).select(m_tiles, fx.Int32(1))
        bid_n = tile // m_tiles
        bid_m = tile - bid_n * m_tiles
        x_g = fx.make_view(fx.get_iter(x) + first_row * k, fx.make_layout((length, k), (k, 1)))
        w_g = fx.make_view(fx.get_iter(w) + group * n * k, fx.make_layout((n, k), (k, 1)))
        out_g = fx.make_view(fx.get_iter(out) + first_row * n, fx.make_layout((length, n), (n, 1)))
        epi_g = ()
        if const_expr(scaled):
            x_scale, w_scale = epi[0], epi[1]
            epi_g = (fx.make_view(fx.get_iter(x_scale) + first_row, fx.make_layout(length, 1)),
                     fx.make_view(fx.get_iter(w_scale) + group * n, fx.make_layout(n, 1)))
        return x_g, w_g, out_g, epi_g, bid_m, bid_n, live

    # The kernel's own body gets FlyDSL's rewrite of dynamic loops and branches; a function it
    # calls needs it too.
    return ASTRewriter.transform(tile_of_block)
