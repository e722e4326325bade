"""Deployment manifests (aot/*.toml) and their expansion into compile jobs.

A manifest names targets and kernels; each ``[[kernels]]`` table selects an op (or "*"), its
configs ("all", or a list of config names), a subset of signature values, and optionally its
own targets::

    targets = ["sm90a", "gfx942", "gfx950"]
    [[kernels]]
    op = "silu_mul"
    configs = "all"
    signatures = { dtype = ["bfloat16"], aligned = [true] }

Expansion is the Cartesian product (template x target x signature x config) minus configs the
template rejects for that target and signature; each job is one KernelKey, de-duplicated. A
manifest (or a command-line narrowing) that names an op, target, config, signature part or value
that no template has is refused with the known names, rather than silently building nothing.
"""
from __future__ import annotations

import difflib
import fnmatch
import os
import tomllib
from dataclasses import dataclass
from importlib import resources

from mslk_dsl import registry
from mslk_dsl.errors import MslkDslError
from mslk_dsl.keys import KernelKey
from mslk_dsl.targets import all_targets
from mslk_dsl.template import Template, config_name

KERNEL_FIELDS = ("op", "configs", "signatures", "targets")
# An unknown name's error lists the known ones up to this many, else the nearest few.
KNOWN_LISTED = 40


class ManifestError(MslkDslError, ValueError):
    """A manifest (or a narrowing of it on the command line) is malformed or names something
    that does not exist; the message says where, what was expected, and the known names."""


@dataclass(frozen=True)
class Job:
    key: KernelKey
    template: str  # template name, resolved again in the worker process

    @property
    def label(self) -> str:
        return self.key.describe()


def load_manifest(path_or_name: str | None = None) -> dict:
    """A manifest by path, or by name from the package's aot/ folder (default: "default")."""
    name = path_or_name or "default"
    if os.path.exists(name):
        where = name
        try:
            with open(name, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest {name}: cannot be read: {e}") from e
    else:
        packaged = resources.files("mslk_dsl.manifests") / f"{name.removesuffix('.toml')}.toml"
        if not packaged.is_file():
            known = sorted(p.name.removesuffix(".toml") for p in resources.files("mslk_dsl.manifests").iterdir()
                           if p.name.endswith(".toml"))
            raise ManifestError(f"no manifest {name!r}: not a file, nor a packaged manifest (packaged: "
                                f"{', '.join(known)})")
        where, text = str(packaged), packaged.read_text()
    try:
        manifest = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"manifest {where}: not valid TOML: {e}") from e
    check_manifest(manifest, where)
    return manifest


def check_manifest(manifest: dict, where: str = "manifest") -> None:
    """Raise ManifestError for a manifest whose tables or fields have the wrong form."""
    def bad(field: str, expected: str, got) -> ManifestError:
        return ManifestError(f"{where}: {field} must be {expected}, got {got!r}; see the example at the top of "
                             "mslk_dsl/aot/manifest.py (or aot/default.toml)")

    targets = manifest.get("targets", [])
    if not _is_str_list(targets):
        raise bad("targets", 'a list of target names, e.g. targets = ["sm90a"]', targets)
    kernels = manifest.get("kernels", [])
    if not isinstance(kernels, list) or not all(isinstance(k, dict) for k in kernels):
        raise bad("kernels", 'a list of [[kernels]] tables, each with op = "..."', kernels)
    unknown_top = set(manifest) - {"targets", "kernels"}
    if unknown_top:
        raise ManifestError(f"{where}: unknown field(s) {sorted(unknown_top)}; a manifest has targets and [[kernels]]")
    for i, spec in enumerate(kernels, 1):
        at = f"[[kernels]] #{i}"
        unknown = set(spec) - set(KERNEL_FIELDS)
        if unknown:
            raise ManifestError(f"{where}: {at} has unknown field(s) {sorted(unknown)}; known: {', '.join(KERNEL_FIELDS)}")
        if not isinstance(spec.get("op", "*"), str):
            raise bad(f"{at} op", 'an op name or pattern, e.g. op = "silu_mul" or op = "*"', spec.get("op"))
        configs = spec.get("configs", "all")
        if configs != "all" and not _is_str_list(configs) and not isinstance(configs, str):
            raise bad(f"{at} configs", '"all" or a list of config names', configs)
        if not isinstance(spec.get("signatures", {}), dict):
            raise bad(f"{at} signatures", "a table of part -> value or list of values, e.g. "
                      '{ dtype = ["bfloat16"] }', spec.get("signatures"))
        if not _is_str_list(spec.get("targets", [])):
            raise bad(f"{at} targets", "a list of target names", spec.get("targets"))


def _is_str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def expand(manifest: dict, targets: list[str] | None = None, ops: list[str] | None = None,
           overrides: dict | None = None) -> list[Job]:
    """Jobs of a manifest, optionally narrowed to ``targets`` / ``ops``. ``overrides`` replaces
    the kernels' selection for one-off builds: {"configs": [...], "signatures": {...}}."""
    check_manifest(manifest)
    specs = [{**spec, **(overrides or {})} for spec in manifest.get("kernels", [{"op": "*"}])]
    _check_names(specs, manifest, targets, ops)
    jobs: dict[str, Job] = {}
    for spec in specs:
        # Targets named on the command line replace the manifest's (a one-off build for sm80, say).
        wanted_targets = targets or spec.get("targets", manifest.get("targets", []))
        for template in registry.get_templates():
            if not fnmatch.fnmatchcase(template.op, spec.get("op", "*")):
                continue
            if ops and template.op not in ops:
                continue
            for target in template.targets:
                if target not in wanted_targets:
                    continue
                for sig in _signatures(template, spec.get("signatures", {})):
                    for config in _configs(template, target, sig, spec.get("configs", "all")):
                        key = KernelKey.make(template, config, target, sig)
                        jobs.setdefault(key.digest, Job(key, template.name))
    if not jobs:
        raise ManifestError(_why_nothing(specs, manifest, targets, ops))
    return sorted(jobs.values(), key=lambda j: (j.key.target, j.key.op, j.key.template, j.key.digest))


def _why_nothing(specs: list[dict], manifest: dict, targets: list[str] | None, ops: list[str] | None) -> str:
    """Why names that each exist select no kernel together: the ops have no template for the
    targets, or none of their configs is valid for the chosen targets and signatures."""
    if not specs:
        return "the manifest lists no [[kernels]] (each table names an op, e.g. op = \"silu_mul\")"
    for spec in specs:
        wanted = targets or spec.get("targets", manifest.get("targets", []))
        chosen = [t for t in registry.get_templates()
                  if fnmatch.fnmatchcase(t.op, spec.get("op", "*")) and (not ops or t.op in ops)]
        served = sorted({target for t in chosen for target in t.targets})
        if not set(served) & set(wanted):
            names = ", ".join(sorted({t.op for t in chosen}))
            return (f"no template of {names} targets {', '.join(wanted) or '(no target given)'}; "
                    f"their targets: {', '.join(served)}")
    selection = {k: v for k, v in specs[0].items() if k in ("configs", "signatures")}
    return (f"the selection {selection} matches no valid kernel of the chosen ops and targets (a config "
            "may not serve the chosen signatures, and some combinations of signature values are no "
            "call's); `mslk-dsl templates --op OP --json` lists each template's configs and signatures")


def refuse_unknown(what: str, names, known) -> None:
    """ManifestError for the ``names`` not in ``known`` (an op, target, config...), listing the
    known ones, or the nearest few where there are hundreds."""
    missing = [n for n in names if n not in known]
    if not missing:
        return
    if len(known) <= KNOWN_LISTED:
        hint = f"known: {', '.join(map(str, known))}"
    else:   # hundreds of config names: the nearest few, and where the rest are listed
        near = difflib.get_close_matches(str(missing[0]), list(map(str, known)), n=5, cutoff=0.5)
        hint = (f"{len(known)} known{'; nearest: ' + ', '.join(near) if near else ''}; "
                "`mslk-dsl templates --op OP` lists them")
    raise ManifestError(f"unknown {what} {', '.join(map(repr, missing))}; {hint}")


def _check_names(specs: list[dict], manifest: dict, targets: list[str] | None, ops: list[str] | None) -> None:
    """Refuse a name no template knows: an op (or op pattern), target, config, signature part or
    value. Each is checked against the templates it could select, so a typo is an error with the
    known names instead of a build of nothing."""
    templates = registry.get_templates()
    known_ops = sorted({t.op for t in templates})
    known_targets = list(all_targets())

    unknown = refuse_unknown
    unknown("op", ops or [], known_ops)
    unknown("target", [*(targets or []), *manifest.get("targets", []),
                       *(t for s in specs for t in s.get("targets", []))], known_targets)
    for spec in specs:
        pattern = spec.get("op", "*")
        chosen = [t for t in templates if fnmatch.fnmatchcase(t.op, pattern) and (not ops or t.op in ops)]
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known_ops):
            raise ManifestError(f"op {pattern!r} in the manifest matches no op; known: {', '.join(known_ops)}")
        selection = spec.get("signatures", {})
        parts = {p: {v for t in chosen for v in t.signatures.get(p, ())} for p in selection}
        unknown("signature part", [p for p in selection if not parts[p]],
                sorted({p for t in chosen for p in t.signatures}))
        for part, values in selection.items():
            known_values = sorted(parts[part], key=str)
            unknown(f"value of signature part {part}", _as_list(values), known_values)
        if spec.get("configs", "all") != "all":
            known_configs = sorted({config_name(c) for t in chosen for c in t.all_configs()})
            unknown("config", _as_list(spec["configs"]), known_configs)


def _signatures(template: Template, selection: dict) -> list[dict]:
    unknown = set(selection) - set(template.signatures)
    if unknown and not set(selection) & set(template.signatures):
        return template.all_signatures()  # selection names other ops' parts: take all of ours
    return [s for s in template.all_signatures()
            if all(s[k] in _as_list(v) for k, v in selection.items() if k in s)]


def _configs(template: Template, target: str, sig: dict, selection) -> list[dict]:
    valid = template.valid_configs(target, sig)
    if selection == "all":
        return valid
    names = set(_as_list(selection))
    return [c for c in valid if config_name(c) in names]


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4); ManifestError naming --shard and the expected form otherwise."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ManifestError(f"--shard {text!r}: expected I/N, build shard I of N (1-based), e.g. --shard 2/4") from None
    if count < 1 or not 1 <= index <= count:
        raise ManifestError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. --shard 2/4")
    return index, count


def shard(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The ``index``-th (1-based) of ``count`` deterministic slices: by key digest, so every build
    machine computes the same split whatever order it listed the jobs in."""
    if not 1 <= index <= count:
        raise ManifestError(f"--shard {index}/{count}: the shard index must be in 1..{count}")
    return [j for j in jobs if int(j.key.digest, 16) % count == index - 1]
