# One entry point a user needs: `make demo` (install + run the main job), `make test` (install the
# test extras + run the suite). PIP installs the CPU torch wheel first so no CUDA build is pulled.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH ?= torch==2.13.0

.PHONY: install install-dev demo test test-kernel test-slow test-latest lock bench quality format docs

# The test environment is pinned: constraints.txt holds every package's exact version (see `lock`).
CONSTRAINTS ?= constraints.txt

install:
	$(PIP) install -q -c $(CONSTRAINTS) $(TORCH)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[demo]"

install-dev:
	$(PIP) install -q -c $(CONSTRAINTS) $(TORCH)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev]"

demo: install
	$(PYTHON) -m hf_lossscale.tools.cli demo

test: install-dev
	HF_LOSSSCALE_CHECK_LOCK=1 $(PYTHON) -m pytest -q

# The masters' Triton kernel (masters/kernel.py) through Triton's interpreter on the CPU: Triton goes
# into .triton/, beside the venv, not in it (torch's CPU wheel does not need it, and it is 285 MB).
TRITON ?= triton==3.9.0
test-kernel: install-dev
	test -d .triton/triton || $(PIP) install -q --no-deps --target .triton $(TRITON)
	PYTHONPATH=.triton $(PYTHON) -m pytest -q tests/test_master_kernel.py

test-slow: install-dev
	$(PYTHON) -m pytest -q -m slow

# The suite on the newest releases, in its own venv (.venv-latest), without the pins: what upstream broke.
# The version-pin checks are expected to name the packages that moved; everything else should pass.
test-latest:
	rm -rf .venv-latest && $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install -q $(TORCH)
	.venv-latest/bin/pip install -q --upgrade -e ".[dev]"
	.venv-latest/bin/python -m pytest -q

# Regenerate constraints.txt from the newest releases in a fresh venv; then run `make test` and update
# hf_lossscale/integrations/compat.py's TESTED_VERSIONS (tests/test_compat.py checks the two agree).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q $(TORCH)
	.venv-lock/bin/pip install -q -e ".[dev]"
	{ sed -n '1,3p' $(CONSTRAINTS); .venv-lock/bin/pip freeze --exclude-editable \
	  | grep -v -i '^hf.lossscale' | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS) && rm -rf .venv-lock

# Benchmarks (a few minutes on 2 CPU cores); results in benchmarks/results/*.json, see benchmarks/README.md.
bench: install-dev
	$(PYTHON) benchmarks/step_overhead.py
	$(PYTHON) benchmarks/telemetry_overhead.py
	$(PYTHON) benchmarks/fp16_emulation_speed.py --head mlm --out benchmarks/results/fp16_emulation_speed_mlm.json
	$(PYTHON) benchmarks/fp16_emulation_speed.py --head cls --out benchmarks/results/fp16_emulation_speed_cls.json

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or a missing name fails.
docs: install-dev
	$(PYTHON) -m mkdocs build --strict --site-dir site

quality:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
