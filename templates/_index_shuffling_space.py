"""What the CuTe and FlyDSL index_shuffling templates share: signatures, the config tables, the
config checks and the heuristic (plain Python: the registry runs them without a DSL).

A config is ``max_experts`` (E the kernel is built for, rounded up), ``lanes`` (threads that
hold one token's scores; each keeps max_experts / lanes of them) and the number of warps (CuTe,
32 threads) or waves (FlyDSL, 64 threads) of a route block; with ``single`` (CuTe), one block of
PLACE_THREADS threads runs both steps over every token in one launch (see ``heuristic``).
"""
from mslk_dsl.errors import ConfigError
from mslk_dsl.templates._kernel_limits import MAX_CHUNKS, MAX_EXPERTS, MAX_TOP_K, SCORE_DTYPES

SIGNATURES = {"score_dtype": SCORE_DTYPES, "has_valid_count": (False, True)}
PLACE_THREADS = 1024            # threads of a place block
UNROLL = 4                      # slots per place thread in flight


def configs(groups: str, shapes) -> tuple[dict, ...]:
    """Configs from (max_experts, lanes, groups per route block) shapes; ``groups`` names the
    thread groups: "warps" (CuTe) or "waves" (FlyDSL). List the preferred config of each
    max_experts first: the heuristic takes it."""
    return tuple({"max_experts": e, "lanes": lanes, groups: n} for e, lanes, n in shapes)


_CUTE_SHAPES = [(32, 8, 32), (64, 8, 32), (128, 8, 32), (128, 16, 32), (256, 16, 32), (256, 8, 16), (512, 16, 16)]
# The single-block twins of the configs whose route block is a place block (32 warps).
CUTE_CONFIGS = configs("warps", _CUTE_SHAPES) + tuple(
    {**c, "single": True} for c in configs("warps", _CUTE_SHAPES) if c["warps"] * 32 == PLACE_THREADS)
FLYDSL_CONFIGS = configs("waves", [(32, 8, 16), (64, 8, 16), (128, 16, 16), (128, 8, 8),
                                   (256, 16, 8), (256, 32, 16), (512, 32, 8)])


def heuristic(configs, problem) -> dict:
    """The first listed config of the smallest max_experts that holds the problem's E (the
    largest when none does); its single-block twin where there is one and the two-kernel form
    would route the T tokens in one chunk (T at most one step of its route block: the same work
    in one launch instead of two, so decode pays one launch)."""
    e, t = int(problem.get("E", 128)), int(problem.get("T", 1 << 30))
    sizes = sorted({c["max_experts"] for c in configs})
    size = next((s for s in sizes if s >= e), sizes[-1])
    pick = next(c for c in configs if c["max_experts"] == size and not c.get("single"))
    twin = next((c for c in configs if c == {**pick, "single": True}), None)
    if twin is not None and t <= PLACE_THREADS // pick["lanes"]:  # a 32-warp block's tokens a step
        return dict(twin)
    return dict(pick)


def check(template: str, config, wave: int) -> None:
    """Raise ConfigError (a ValueError), naming the template and the config, for a config the kernels cannot
    run: they assume these divisions are exact and the key packing's limits."""
    max_e, lanes = config["max_experts"], config["lanes"]
    problems = []
    # The place kernel spreads the experts over its threads (PLACE_THREADS // max_experts per
    # expert, each summing an equal share of the chunks).
    if not 1 <= max_e <= MAX_EXPERTS or PLACE_THREADS % max_e or MAX_CHUNKS % (PLACE_THREADS // max_e):
        problems.append(f"max_experts must be a power of two in [{PLACE_THREADS // MAX_CHUNKS}, "
                        f"{MAX_EXPERTS}]")
    if lanes & (lanes - 1) or not MAX_TOP_K <= lanes <= wave or max_e % lanes:
        problems.append(f"lanes must be a power of two in [{MAX_TOP_K}, {wave}] (one lane per "
                        f"selected expert) that divides max_experts")
    if config.get("single") and config.get("warps", config.get("waves", 0)) * wave != PLACE_THREADS:
        problems.append(f"single runs both steps in one block, so its route block must have "
                        f"{PLACE_THREADS} threads (warps = {PLACE_THREADS // wave})")
    if problems:
        raise ConfigError(f"{template}: config {dict(config)} is not usable: " + "; ".join(problems))


class RouteGeometry:
    """What both kernel classes derive from a config and a signature; they subclass this and add
    their DSL types. ``wave``: threads of a warp (CuTe, 32) or wave (FlyDSL, 64); ``groups``:
    the config key of the warps or waves per route block."""

    def __init__(self, template: str, config, sig, wave: int, groups: str):
        check(template, config, wave)
        self.max_e, self.lanes, self.route_waves = config["max_experts"], config["lanes"], config[groups]
        self.single = bool(config.get("single"))
        self.keys_per_lane = self.max_e // self.lanes
        self.tokens_per_step = wave // self.lanes           # tokens a warp / wave routes at once
        self.threads = self.route_waves * wave              # of a route block
        self.place_parts = PLACE_THREADS // self.max_e      # place: threads per expert for the prefix sums
        self.experts_per_lane = max(self.max_e // wave, 1)  # place: in the expert scan
        self.has_n = bool(sig["has_valid_count"])
        # Low bits of a key or slot that hold the expert: 8 (E <= 256) or 9 (E <= 512). A slot
        # is rank << expert_bits | e in an int32, so a chunk routes fewer than 2^(31 - bits) pairs.
        self.expert_bits = max(8, (self.max_e - 1).bit_length())
        self.expert_mask = (1 << self.expert_bits) - 1
        # Keys: orderable score bits << expert_bits | expert_mask - e, in 32 bits for bf16 scores, 64 for fp32.
        self.wide = sig["score_dtype"] == "float32"
        self.sign_free = 0x7FFFFFFF if self.wide else 0x7FFF
        self.key_min = -(2 ** 63) if self.wide else -(2 ** 31)
