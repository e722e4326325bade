"""The ``mslk-dsl`` command line: targets, templates, AOT builds and bundles, the cache, explain."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

from mslk_dsl.errors import CacheError, CompileError, InputError, MslkDslError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, so a closed pipe is seen below and not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`mslk-dsl cache ls | head`): stop quietly. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (MslkDslError, ValueError, KeyError, OSError) as e:
        # Errors raised on purpose carry what, where and how to fix; a file the command could
        # not read or write (OSError) names its path. One line, never a traceback.
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"mslk-dsl: error: {message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mslk-dsl", description=__doc__)
    sub = p.add_subparsers()

    s = sub.add_parser("targets", help="list compile targets (arch/*.toml)")
    s.set_defaults(func=cmd_targets)

    s = sub.add_parser("ops", help="list the declared ops: schema, signature parts, sizes, targets")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_ops)

    s = sub.add_parser("templates", help="list registered templates")
    s.add_argument("--op")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_templates)

    aot = sub.add_parser("aot", help="ahead-of-time builds and bundles").add_subparsers()
    s = aot.add_parser("build", help="compile a manifest's kernels (default: aot/default.toml)")
    s.add_argument("--manifest", help="manifest path or packaged name (default: default)")
    s.add_argument("--target", action="append", help="only these targets (repeatable)")
    s.add_argument("--op", action="append", help="only these ops (repeatable)")
    s.add_argument("--config", action="append", help="only these config names (repeatable)")
    s.add_argument("--sig", action="append", default=[], metavar="PART=VALUE",
                   help="only signatures with this value (repeatable), e.g. --sig dtype=bfloat16")
    s.add_argument("--workers", type=_positive_int, help="worker processes (default: MSLK_DSL_AOT_WORKERS or CPU count)")
    s.add_argument("--out", help="output bundle directory (default: the kernel cache)")
    s.add_argument("--shard", help="build only shard i of n (i/n, 1-based)")
    s.add_argument("--dry-run", action="store_true", help="list the jobs, compile nothing")
    s.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto")
    s.add_argument("--check-resources", action="store_true",
                   help="exit 1 if a kernel of the build breaks a limit or its template's declarations "
                        "(spills, occupancy floor: as `mslk-dsl resources --check`, over exactly these kernels)")
    s.set_defaults(func=cmd_aot_build)
    s = aot.add_parser("merge", help="merge bundles (e.g. shards) into one")
    s.add_argument("out")
    s.add_argument("sources", nargs="+")
    s.set_defaults(func=cmd_aot_merge)
    s = aot.add_parser("verify", help="check a bundle against its manifest.json")
    s.add_argument("dir")
    s.set_defaults(func=cmd_aot_verify)
    s = aot.add_parser("package", help="turn a bundle into an installable wheel")
    s.add_argument("dir")
    s.add_argument("--name", required=True)
    s.add_argument("--version", default="1.0.0")
    s.add_argument("--out", default="dist")
    s.set_defaults(func=cmd_aot_package)

    cache = sub.add_parser("cache", help="inspect and manage the kernel cache").add_subparsers()
    s = cache.add_parser("ls")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_cache_ls)
    cache.add_parser("stats").set_defaults(func=cmd_cache_stats)
    s = cache.add_parser("verify")
    s.add_argument("--repair", action="store_true", help="remove damaged entries")
    s.set_defaults(func=cmd_cache_verify)
    cache.add_parser("clear").set_defaults(func=cmd_cache_clear)
    s = cache.add_parser("prune", help="remove least recently used entries beyond a size")
    s.add_argument("--max-size", required=True, help="e.g. 500M, 2G")
    s.set_defaults(func=cmd_cache_prune)

    s = sub.add_parser("explain", help="show a kernel's key and, on a miss, the closest entry")
    s.add_argument("op")
    s.add_argument("--target", required=True)
    s.add_argument("--dtype")
    s.add_argument("--sig", action="append", default=[], metavar="PART=VALUE")
    s.add_argument("--config", help="config name (default: the heuristic's choice)")
    s.add_argument("--problem", default="", help="sizes for the heuristic, e.g. M=4096,K=8192")
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("resources", help="registers, shared memory / LDS, spills and occupancy of compiled kernels")
    s.add_argument("--op", action="append", help="only these ops (repeatable)")
    s.add_argument("--target", action="append", help="only these targets (repeatable)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--markdown", action="store_true")
    s.add_argument("--check", action="store_true", help="exit 1 if a kernel breaks a limit or its template's floor")
    s.add_argument("--defaults", action="store_true",
                   help="the default config of every op and target (sm90a, gfx942, gfx950), compiled if missing")
    s.set_defaults(func=cmd_resources)

    s = sub.add_parser("tune", help="benchmark configs on this GPU and store the winners")
    s.add_argument("--op", required=True)
    s.add_argument("--shapes", required=True, help="problems, e.g. 'M=128,N=8192,K=8192;M=4096,N=8192,K=8192'")
    s.add_argument("--sig", action="append", default=[], metavar="PART=VALUE")
    s.set_defaults(func=cmd_tune)

    s = sub.add_parser("native", help="build the native launch path for this Python and torch (mslk_dsl.native) "
                                      "into the cache dir; serving with JIT off only loads a prebuilt one")
    s.set_defaults(func=cmd_native)
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _parse_pairs(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            if "=" not in pair:
                raise InputError(f"expected PART=VALUE, got {pair!r}")
            k, v = pair.split("=", 1)
            out.setdefault(k.strip(), []).append(_parse_value(v.strip()))
    return out


def _parse_sizes(text: str, op: str) -> dict:
    """``M=1,K=4096`` -> {"M": 1, "K": 4096}: whole numbers >= 0, named as the op's declaration
    names its sizes (an op without a declaration, such as a test template's, takes any name)."""
    from mslk_dsl.ops import declarations

    pairs = _parse_pairs([text])
    repeated = sorted(k for k, v in pairs.items() if len(v) > 1)
    if repeated:
        raise InputError(f"problem size(s) {repeated} given more than once in {text!r}")
    sizes = {k: v[0] for k, v in pairs.items()}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise InputError(f"problem sizes are whole numbers >= 0; got {', '.join(f'{k}={v!r}' for k, v in bad.items())}")
    decl = declarations().get(op)
    if decl is not None and decl.problem:
        unknown = sorted(set(sizes) - set(decl.problem))
        if unknown:
            raise InputError(f"unknown size(s) {unknown} for {op}; its sizes: {', '.join(decl.problem)}")
    return sizes


def _print_rows(rows: list[dict], as_json: bool, line) -> int:
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(line(r))
    return 0


# -- commands ------------------------------------------------------------------------------------
def cmd_targets(args) -> int:
    from mslk_dsl.targets import all_targets

    for t in all_targets().values():
        print(f"{t.name:8s} {t.vendor:7s} backend={t.backend:7s} arch={t.dsl_arch:8s} warp={t.warp_size} "
              f"smem={t.smem_per_block} fp8={t.fp8 or '-'}")
    return 0


def cmd_ops(args) -> int:
    from mslk_dsl import registry
    from mslk_dsl.ops import declarations

    rows = []
    for name, decl in declarations().items():
        targets = sorted({t for tpl in registry.get_templates(op=name) for t in tpl.targets})
        rows.append({"op": name, "schema": f"{name}{decl.schema}", "signature": list(decl.signature),
                     "problem": list(decl.problem), "targets": targets,
                     "kind": "composite" if decl.composite is not None else "kernel"})
    return _print_rows(rows, args.json, lambda r: f"{r['schema']}\n    {r['kind']}; signature: "
                       f"{', '.join(r['signature']) or '-'}; sizes: {', '.join(r['problem']) or '-'}; "
                       f"targets: {', '.join(r['targets']) or 'any device'}")


def cmd_templates(args) -> int:
    from mslk_dsl import registry
    from mslk_dsl.template import config_name

    if args.op and args.op not in registry.ops():
        raise InputError(f"unknown op {args.op!r}; known: {', '.join(registry.ops())}")
    rows = []
    for t in registry.get_templates(op=args.op):
        rows.append({"name": t.name, "op": t.op, "backend": t.backend, "targets": list(t.targets),
                     "signatures": {k: list(v) for k, v in t.signatures.items()},
                     "configs": [config_name(c) for c in t.all_configs()], "source": t.source,
                     "unusable_configs": unusable_configs(t)})

    def line(r):
        text = (f"{r['op']:24s} {r['backend']:7s} {r['name']:32s} targets={','.join(r['targets'])} "
                f"configs={len(r['configs'])} signatures={r['signatures']}")
        if r["unusable_configs"]:
            text += (f"\n  {len(r['unusable_configs'])} config(s) no target and signature can use: "
                     + ", ".join(r["unusable_configs"]))
        return text
    return _print_rows(rows, args.json, line)


def unusable_configs(template) -> list[str]:
    """Names of the template's configs that ``valid`` rejects for every target and signature
    (dead entries of its space, which `aot build` never compiles)."""
    from mslk_dsl.template import config_name

    usable = {config_name(c) for target in template.targets for sig in template.all_signatures()
              for c in template.valid_configs(target, sig)}
    return [config_name(c) for c in template.all_configs() if config_name(c) not in usable]


def cmd_aot_build(args) -> int:
    from mslk_dsl import env
    from mslk_dsl.aot import bundle, manifest, runner

    overrides = {}
    if args.config:
        overrides["configs"] = args.config
    if args.sig:
        overrides["signatures"] = _parse_pairs(args.sig)
    jobs = manifest.expand(manifest.load_manifest(args.manifest), targets=args.target, ops=args.op,
                           overrides=overrides)
    if args.shard:
        jobs = manifest.shard(jobs, *manifest.parse_shard(args.shard))
    out = os.path.abspath(args.out or env.cache_dir())
    if args.dry_run:
        for j in jobs:
            print(j.label)
        print(f"{len(jobs)} jobs")
        return 0
    workers = args.workers or env.aot_workers()
    print(f"mslk-dsl aot build: {len(jobs)} kernels -> {out} ({workers} workers)", flush=True)
    progress = {"auto": None, "bar": True, "lines": False}[args.progress]
    report = runner.build(jobs, out, workers=workers, progress=progress)
    if os.path.isdir(out):
        bundle.write_bundle_manifest(out)
    by_op = Counter((j.key.op, j.key.target) for j in jobs if j.key.digest in set(report.built))
    for (op, target), n in sorted(by_op.items()):
        print(f"  built {n:4d}  {op} for {target}")
    print(f"built {len(report.built)}, already present {len(report.skipped)}, copied from the cache or a "
          f"bundle {len(report.copied)}, failed {len(report.failed)} "
          f"in {report.seconds:.1f}s")
    for error in report.failed.values():
        print(f"FAILED: {error}", file=sys.stderr)
    broken = _resource_problems(jobs, out) if args.check_resources else []
    for problem in broken:
        print(f"RESOURCES: {problem}", file=sys.stderr)
    if args.check_resources:
        print(f"resources: {len(broken)} problems in the {len(jobs)} kernels")
    return 0 if report.ok and not broken else 1


def _resource_problems(jobs, out: str) -> list[str]:
    """The resource problems (mslk_dsl.resources.entry_problems) of the built kernels of ``jobs``
    in ``out``: the whole config matrix's check, which the compile tests make on a sample."""
    from mslk_dsl import resources
    from mslk_dsl.cache import KernelCache

    store = KernelCache(out)
    found = []
    for job in jobs:
        entry = store.lookup(job.key)
        if entry is not None:
            found += resources.entry_problems(entry)
    return found


def cmd_aot_merge(args) -> int:
    from mslk_dsl.aot import merge_bundles
    from mslk_dsl.aot.bundle import read_bundle_manifest

    for source in args.sources:
        read_bundle_manifest(source)

    problems: list[str] = []
    manifest = merge_bundles(args.out, args.sources, problems)
    for problem in problems:
        print(f"DAMAGED {problem}")
    print(f"merged {len(args.sources)} bundles into {args.out}: {len(manifest['kernels'])} kernels"
          + (f"; {len(problems)} damaged entries not copied (see above)" if problems else ""))
    return 0


def cmd_aot_verify(args) -> int:
    from mslk_dsl.aot import verify_bundle
    from mslk_dsl.aot.bundle import read_bundle_manifest

    manifest = read_bundle_manifest(args.dir)
    problems = verify_bundle(args.dir)
    for p in problems:
        print(f"BAD {p}")
    if problems:
        return 1
    print(f"ok: {len(manifest['kernels'])} kernels verify")
    return 0


def cmd_aot_package(args) -> int:
    from mslk_dsl.aot.wheel import package_bundle

    print(package_bundle(args.dir, args.name, args.out, version=args.version))
    return 0


def _cache():
    from mslk_dsl import env, jit

    root = env.cache_dir()
    if os.path.exists(root) and not os.path.isdir(root):
        raise CacheError(f"the kernel cache {root} is not a directory; point MSLK_DSL_CACHE_DIR at a directory "
                         "(or unset it for the default)")
    return jit.cache()


def cmd_cache_ls(args) -> int:
    store = _cache()
    rows = [{"path": e.path, "op": e.key_parts["op"], "target": e.key_parts["target"],
             "template": e.key_parts["template"], "config": e.key_parts["config"],
             "signature": e.key_parts["signature"], "size": e.size, "built_at": e.meta.get("built_at")}
            for e in store.entries()]
    return _print_rows(rows, args.json, lambda r: f"{r['target']:7s} {r['op']:22s} {r['template']:30s} "
                       f"{r['size']:9d}  {json.dumps(r['config'])} {json.dumps(r['signature'])}")


def cmd_cache_stats(args) -> int:
    store = _cache()
    entries = store.entries()
    by = Counter((e.key_parts["target"], e.key_parts["op"]) for e in entries)
    print(f"cache {store.root}: {len(entries)} entries, {sum(e.size for e in entries) / 2**20:.1f} MiB")
    for (target, op), n in sorted(by.items()):
        print(f"  {target:7s} {op:24s} {n}")
    leftovers = store.leftovers()
    if leftovers:  # unfinished or killed builds; `cache prune` and `cache verify --repair` sweep them
        print(f"  {len(leftovers)} leftovers of unfinished builds (swept by `cache prune` / `cache verify --repair`):")
        for path, why in leftovers:
            print(f"    {path}: {why}")
    return 0


def cmd_cache_verify(args) -> int:
    problems = _cache().verify_all(repair=args.repair)
    for path, why in problems:
        print(f"BAD {path}: {why}{' (removed)' if args.repair else ''}")
    print(f"{len(problems)} damaged entries")
    return 1 if problems and not args.repair else 0


def cmd_cache_clear(args) -> int:
    print(f"removed {_cache().clear()} entries")
    return 0


def cmd_cache_prune(args) -> int:
    from mslk_dsl.env import parse_size

    removed = _cache().prune(parse_size(args.max_size, "--max-size"))
    print(f"removed {len(removed)} entries ({sum(e.size for e in removed) / 2**20:.1f} MiB)")
    return 0


def cmd_explain(args) -> int:
    from mslk_dsl.explain import explain

    sig = {k: v[0] for k, v in _parse_pairs(args.sig).items()}
    if args.dtype:
        sig["dtype"] = args.dtype
    problem = _parse_sizes(args.problem, args.op) if args.problem else {}
    text, hit = explain(args.op, args.target, sig, args.config, problem)
    print(text)
    return 0 if hit else 1


def cmd_resources(args) -> int:
    return _resources_table(args.op, args.target, args.json, args.markdown, args.check, args.defaults)


RESOURCE_TARGETS = ("sm90a", "gfx942", "gfx950")  # mslk-dsl resources --defaults


def resource_default_jobs(ops: list[str] | None = None, targets: list[str] | None = None) -> list:
    """The default kernel of every op on every target: the first template's heuristic config
    for its first signature, at ``mslk-dsl explain``'s default sizes."""
    from mslk_dsl import registry
    from mslk_dsl.aot import Job
    from mslk_dsl.explain import resolve
    from mslk_dsl.keys import KernelKey

    jobs = {}
    for target in targets or RESOURCE_TARGETS:
        for op in sorted({t.op for t in registry.get_templates()}):
            if (ops and op not in ops) or not registry.templates_for(op, target):
                continue
            template, config, sig, _ = resolve(op, target, {}, None, {})
            key = KernelKey.make(template, config, target, sig)
            jobs[key.digest] = Job(key, template.name)
    return list(jobs.values())


def _resources_table(ops: list[str] | None, targets: list[str] | None, as_json: bool = False,
            as_markdown: bool = False, check: bool = False, defaults: bool = False) -> int:
    """``mslk-dsl resources``: the table over every entry of the cache and bundles, or with
    ``defaults`` over the default kernel of every op and target (compiled into the cache if
    missing)."""
    import contextlib
    import json

    from mslk_dsl import aot, env, jit, registry
    from mslk_dsl.aot.manifest import refuse_unknown
    from mslk_dsl.resources import COLUMNS, entry_problems, markdown, rows
    from mslk_dsl.targets import all_targets

    refuse_unknown("op", ops or [], registry.ops())   # a typo is an error, not an empty table
    refuse_unknown("target", targets or [], list(all_targets()))
    wanted = None
    if defaults:
        jobs = resource_default_jobs(ops, targets)
        with contextlib.redirect_stdout(sys.stderr):  # progress lines stay out of the table
            report = aot.build(jobs, env.cache_dir(), workers=1, progress=False)
        if not report.ok:
            raise CompileError("failed to compile:\n" + "\n".join(report.failed.values()))
        wanted = {j.key.digest for j in jobs}
    seen, entries = set(), []
    for layer in jit._layers():
        for entry in layer.entries():
            key = entry.key_parts
            if entry.meta["digest"] in seen or (ops and key["op"] not in ops) or (targets and key["target"] not in targets):
                continue
            if wanted is not None and entry.meta["digest"] not in wanted:
                continue
            seen.add(entry.meta["digest"])
            entries.append(entry)
    table = rows(entries)
    if as_json:
        print(json.dumps(table, indent=1))
    elif as_markdown:
        print(markdown(table))
    else:
        widths = {c: max([len(c)] + [len(str(r[c])) for r in table]) for c in COLUMNS}
        print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
        for r in table:
            print("  ".join(str(r[c] if r[c] is not None else "-").ljust(widths[c]) for c in COLUMNS))
    if check:
        found = [p for entry in entries for p in entry_problems(entry)]
        for p in found:
            print(f"PROBLEM {p}")
        return 1 if found else 0
    return 0


def cmd_tune(args) -> int:
    import torch

    from mslk_dsl import autotune, registry
    from mslk_dsl.errors import UnsupportedError

    if args.op not in autotune.tunable_ops():
        raise InputError(f"unknown op {args.op!r} for tuning; tunable: {', '.join(autotune.tunable_ops())}")
    sig = {k: v[0] for k, v in _parse_pairs(args.sig).items()}
    parts = {p for t in registry.get_templates() if t.op == args.op for p in t.signatures}
    unknown = sorted(set(sig) - parts)
    if unknown:
        raise InputError(f"unknown signature part(s) {unknown} for {args.op}; its parts: {', '.join(sorted(parts))}")
    problems = [_parse_sizes(s, args.op) for s in args.shapes.split(";") if s]
    if not torch.cuda.is_available():
        raise UnsupportedError("tune times kernels on this machine's GPU, and there is none")
    for problem, (config, ms) in zip(problems, autotune.tune(args.op, problems, sig)):
        print(f"{args.op} {problem}: best {config} ({ms * 1e3:.1f} us)")
    return 0


def cmd_native(args) -> int:
    from mslk_dsl import native

    path = native.library_path()
    if path is None:
        print("mslk-dsl native: tvm_ffi is not installed", file=sys.stderr)
        return 1
    try:
        native.build(path)
    except Exception as e:  # noqa: BLE001 - reported as the command's failure
        print(f"mslk-dsl native: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
