"""``mslk-dsl explain``: the parts of a kernel's key, where it is served from, and for a miss,
which parts differ from the closest entry that exists."""
from __future__ import annotations

import json

from mslk_dsl import env, jit, registry, resources
from mslk_dsl.errors import ConfigError, InputError
from mslk_dsl.keys import KernelKey, package_set_difference
from mslk_dsl.targets import get_target
from mslk_dsl.template import config_name

DEFAULT_PROBLEM = {"M": 4096, "N": 4096, "K": 4096, "T": 4096}


def resolve(op: str, target: str, sig: dict, config: str | None, problem: dict):
    """(template, config dict, full signature, notes) for an explain/build request."""
    if op not in registry.ops():
        raise InputError(f"unknown op {op!r}; known: {', '.join(registry.ops())}")
    get_target(target)  # an unknown target is an error naming the known ones
    templates = registry.templates_for(op, target)
    if not templates:
        raise InputError(f"no template for op {op!r} on target {target!r}")
    template = templates[0]
    unknown = sorted(set(sig) - set(template.signatures))
    if unknown:
        raise InputError(f"unknown signature part(s) {unknown} for {template.name}; known: {sorted(template.signatures)}")
    for part, value in sig.items():
        if value not in template.signatures[part]:
            raise InputError(f"signature {part}={value!r} not in {list(template.signatures[part])}")
    # The parts not given: those of the first signature the template builds that agrees with the
    # given ones (parts can depend on each other: attention's v head dim on q's).
    agreeing = [s for s in template.all_signatures() if all(s[part] == value for part, value in sig.items())]
    if not agreeing:
        raise InputError(f"signature {dict(sig)} is no call's: {template.name} builds no signature with these "
                         "parts (its signature_valid leaves them out; `mslk-dsl templates` lists its parts)")
    full_sig = dict(agreeing[0])
    notes = [f"signature {part} not given: using {full_sig[part]!r}" for part in template.signatures if part not in sig]
    if config:
        matches = [c for c in template.all_configs() if config_name(c) == config]
        if not matches:
            raise ConfigError(f"no config {config!r}; known: {[config_name(c) for c in template.all_configs()]}")
        chosen = matches[0]
    else:
        chosen = dict(template.heuristic(target, full_sig, {**DEFAULT_PROBLEM, **problem}))
        notes.append(f"config from the heuristic for {dict(DEFAULT_PROBLEM, **problem)}")
    return template, template.check_config(chosen, target, full_sig), full_sig, notes


def explain(op: str, target: str, sig: dict, config: str | None = None,
            problem: dict | None = None) -> tuple[str, bool]:
    """The report, and whether the kernel is served (a bundle or the cache holds it)."""
    template, chosen, full_sig, notes = resolve(op, target, sig, config, problem or {})
    key = KernelKey.make(template, chosen, target, full_sig)
    lines = [f"{op} on {target}: template {template.name} ({template.source})", *[f"  note: {n}" for n in notes],
             f"key {key.digest}:"]
    for part, value in key.parts().items():
        lines.append(f"  {part:18s} {json.dumps(value, sort_keys=True)}")
    found = jit.find_entry(key)
    if found is not None:
        layer, entry = found
        kind = "read-only bundle" if not layer.writable else "cache"
        lines.append(f"HIT in {kind} {layer.root}: {entry.path}")
        lines.extend(resources.explain_lines(entry))
        return "\n".join(lines), True
    lines.append("MISS: no bundle or cache entry has this key")
    lines.append(f"  {env.describe_aot_path()}")
    near = jit.nearest_entry(key)
    packages = ""
    if near is None:
        lines.append(f"  no entry for {op} on {target} exists at all")
    else:
        _, entry, diff = near
        lines.append(f"  closest entry {entry.path} differs in {len(diff)} part(s):")
        for part, (wanted, found_value) in diff.items():
            lines.append(f"    {part}: wanted {json.dumps(wanted, sort_keys=True)}, "
                         f"found {json.dumps(found_value, sort_keys=True)}")
        if "dsl_versions" in diff:
            packages = package_set_difference(*diff["dsl_versions"])
    if packages:
        lines.append(f"  the cause is the installed packages: {packages}")
    else:
        lines.append(f"  build it with: {jit.build_command(key)}")
    return "\n".join(lines), False
