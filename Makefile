# The two set-up commands of the README. Each creates .venv if missing, installs, and runs.
#   make aot   compile every registered kernel config for sm90a, gfx942 and gfx950 into the cache, and
#              check each one's resources (spills, occupancy) against its template's declarations
#   make test  lint (ruff, mypy), then run the whole test suite (GPU tests skip with a reason where there is no GPU);
#              the compile tests build a sample of the configs, MSLK_DSL_TEST_ALL_CONFIGS=1 builds them all
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0 is the CPU build verified here; the GPU machine brings its own torch (>= 2.11).
TORCH  ?= torch==2.13.0
PYTEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: aot test lint setup lld

setup: $(VENV)/.installed lld

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[all,test]"
	touch $@

# FlyDSL links AMD code objects with ld.lld (Debian: lld-19).
lld:
	@if command -v ld.lld >/dev/null || ls /usr/lib/llvm-*/bin/ld.lld >/dev/null 2>&1 || [ -x /opt/rocm/llvm/bin/ld.lld ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq lld-19) >/dev/null; \
	else \
	  echo "FlyDSL needs ld.lld: run 'apt-get install -y lld-19' as root (or set MSLK_DSL_LLD to an ld.lld)"; exit 1; \
	fi

aot: setup
	$(BIN)/mslk-dsl aot build --check-resources

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -rs --durations=15 tests
