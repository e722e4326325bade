"""Ahead-of-time builds: manifests -> jobs -> parallel compiles -> bundles (and bundle wheels)."""
from mslk_dsl.aot.bundle import merge_bundles, verify_bundle, write_bundle_manifest
from mslk_dsl.aot.manifest import Job, expand, load_manifest
from mslk_dsl.aot.runner import BuildReport, build

__all__ = ["BuildReport", "Job", "build", "expand", "load_manifest", "merge_bundles", "verify_bundle",
           "write_bundle_manifest"]
