"""index_shuffling at decode sizes: the heuristic's config (one launch where every token fits one
route step) against the two-kernel form of the same config, each replayed from a CUDA graph (the
GPU's time), and the default eager call as a program makes it.

  python tools/bench.py index_shuffling [--tokens 1,16,64,128] [--json PATH]

Both forms' results are compared (counts and the routed pairs) before they are timed.
"""
from __future__ import annotations

import argparse

from bench_common import graph_timed, parse_with_gpu, save_json, table

# (experts, top_k): Llama-4-like, DeepSeek-V3-like, 256 experts, Mixtral-like
ROUTERS = ((16, 1), (128, 8), (256, 8), (8, 2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,128", help="comma-separated T")
    found = parse_with_gpu(parser, argv, "bench_index_shuffling")
    if found is None:
        return 1
    args, torch, do_bench = found
    from mslk_dsl import ops
    from mslk_dsl.templates import _index_shuffling_space as space

    rows = []
    for experts, top_k in ROUTERS:
        for tokens in (int(t) for t in args.tokens.split(",")):
            scores = torch.rand(tokens, experts, device="cuda").to(torch.bfloat16)
            pick = space.heuristic(space.CUTE_CONFIGS, {"T": tokens, "E": experts})
            two = {k: v for k, v in pick.items() if k != "single"}
            want = ops.index_shuffling(scores, None, None, None, top_k=top_k)
            routed = int(want[0][-1])
            row = {"E": experts, "top_k": top_k, "T": tokens, "single": bool(pick.get("single"))}
            for label, config in (("one launch", pick), ("two kernels", two)):
                def call(c=config):
                    return ops.index_shuffling(scores, None, None, None, top_k=top_k, config=c)
                got = call()
                assert torch.equal(got[0], want[0]) and all(
                    torch.equal(g[:routed], w[:routed]) for g, w in zip(got[1:], want[1:])), (label, row)
                row[f"{label} us"] = graph_timed(torch, do_bench, call) * 1e3
            row["eager us"] = do_bench(lambda: ops.index_shuffling(scores, None, None, None, top_k=top_k)) * 1e3
            rows.append(row)
    table(rows, ["E", "top_k", "T", "single", "two kernels us", "one launch us", "eager us"])
    save_json(args.json, rows)
    return 0
