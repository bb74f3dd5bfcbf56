# One entry point a user needs: `make demo` (install + run the main job), `make test` (install the
# test extras + run the suite). PIP installs the CPU torch wheel first so no CUDA build is pulled.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TORCH ?= torch==2.13.0

.PHONY: install install-dev demo test test-slow bench quality format

install:
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[demo]"

install-dev:
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev]"

demo: install
	$(PYTHON) -m hf_lossscale.demo

test: install-dev
	$(PYTHON) -m pytest -q

test-slow: install-dev
	$(PYTHON) -m pytest -q -m slow

# Benchmarks (a few minutes on 2 CPU cores); results in benchmarks/results/*.json, see benchmarks/README.md.
bench: install-dev
	$(PYTHON) benchmarks/step_overhead.py
	$(PYTHON) benchmarks/telemetry_overhead.py
	$(PYTHON) benchmarks/fp16_emulation_speed.py --head mlm --out benchmarks/results/fp16_emulation_speed_mlm.json
	$(PYTHON) benchmarks/fp16_emulation_speed.py --head cls --out benchmarks/results/fp16_emulation_speed_cls.json

quality:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .
