"""The FlyDSL attention templates' config spaces and choices, without compiling (the kernels
themselves compile in test_compile_templates.py: ``-k "attention or merge_attentions"``)."""
import pytest

from mslk_dsl import registry
from mslk_dsl.templates import _flydsl_attention as attn
from mslk_dsl.templates._attention_limits import HEAD_DIM_PAIRS

TARGETS = ("gfx942", "gfx950")


def _sigs(template):
    return template.all_signatures()


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_choice_serves_every_mask_and_layout(target):
    """For every dtype, head dim, mask family and dense / packed call, the heuristic's config is
    valid on the target, serves the call and keeps its K / V tiles within LDS."""
    t = registry.get_template("attention_fwd_flydsl")
    for sig in _sigs(t):
        for mask in range(len(attn.MASKS)):
            for varlen in (0, 1):
                problem = {"B": 2, "Mq": 1000, "Mk": 1000, "Hq": 32, "Hkv": 8, "mask": mask, "varlen": varlen}
                config = t.check_config(t.heuristic(target, sig, problem), target, sig, problem)
                assert (config["mask"], config["varlen"]) == (attn.MASKS[mask], bool(varlen))
                assert attn.lds_bytes(config, sig["head_dim"], sig["head_dim_v"]) <= attn.LDS_BYTES[target]


@pytest.mark.parametrize("target", TARGETS)
def test_prefill_tiles_by_head_dim(target):
    """The widest KV tile that fits: 128 keys at head dims 64 and 96 (96's 32-key tile would not
    split into whole 16-byte chunks per thread), 32 at 256 (whose 64-key tile needs more registers
    than the kernel keeps), 64 at 192 (with v of 192 or 128), and 64 / 128 at 128 on gfx942 /
    gfx950 (LDS)."""
    t = registry.get_template("attention_fwd_flydsl")
    widths = {(d, dv): t.heuristic(target, {"dtype": "bfloat16", "head_dim": d, "head_dim_v": dv}, {})["block_n"]
              for d, dv in HEAD_DIM_PAIRS}
    assert widths == {(64, 64): 128, (96, 96): 128, (128, 128): 64 if target == "gfx942" else 128,
                      (192, 192): 64, (192, 128): 64, (256, 256): 32}


def test_check_config_says_why():
    assert "LDS" in attn.check_config({"waves": 4, "block_n": 128}, "gfx942", 256)
    assert "registers" in attn.check_config({"waves": 4, "block_n": 64}, "gfx950", 256)
    assert "16-byte chunks" in attn.check_config({"waves": 8, "block_n": 32}, "gfx942", 64)
    assert attn.check_config({"waves": 4, "block_n": 64}, "gfx942", 128) is None
    # v rows of their own length count in LDS: K 128 x 192 and Vt 128 x 128 exceed gfx942's 64 KiB
    assert "LDS" in attn.check_config({"waves": 4, "block_n": 128}, "gfx942", 192, 128)
    assert attn.check_config({"waves": 4, "block_n": 64}, "gfx942", 192, 128) is None


@pytest.mark.parametrize("name", ["attention_decode_flydsl", "merge_attentions_flydsl"])
def test_decode_and_merge_defaults_are_valid(name):
    t = registry.get_template(name)
    for target in TARGETS:
        for sig in _sigs(t):
            t.check_config(t.heuristic(target, sig, {}), target, sig)


def test_flydsl_attention_ops_match_their_cute_templates():
    """Each FlyDSL attention template implements an op whose CuTe template takes the same
    signature parts (the op layer builds one key for both backends)."""
    for name in ("attention_fwd_flydsl", "attention_decode_flydsl", "merge_attentions_flydsl"):
        flydsl = registry.get_template(name)
        cute = [t for t in registry.get_templates(op=flydsl.op) if t.backend == "cute"]
        if not cute:
            pytest.skip(f"no CuTe template of {flydsl.op} in this checkout")
        assert set(cute[0].signatures) == set(flydsl.signatures), name
