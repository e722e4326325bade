"""Child process for one FlyDSL compile job (see backends/flydsl.py).

argv[1] is a JSON job {template, config, target, signature}; the parent sets COMPILE_ONLY=1,
ARCH, ROCM_PATH and a private FLYDSL_RUNTIME_CACHE_DIR. Exit status 0 means the artifact exists.
"""
import json
import sys


def main() -> int:
    job = json.loads(sys.argv[1])
    from mslk_dsl.registry import get_template

    template = get_template(job["template"])
    launcher, args = template.build(job["config"], job["target"], job["signature"])
    launcher(*args)  # COMPILE_ONLY=1: compiles and persists into the cache, launches nothing
    return 0


if __name__ == "__main__":
    sys.exit(main())
