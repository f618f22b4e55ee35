# `make demo` and `make test` create .venv with the pinned dependencies when it is missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

# Other transformers versions for the interop tests, each in its own .venv-tf<version> (pinned in tests/interop).
INTEROP_VERSIONS := 4.48 4.57
INTEROP_STAMPS := $(foreach v,$(INTEROP_VERSIONS),.venv-tf$(v)/.installed)
comma := ,
space := $(eval) $(eval)
INTEROP_PYTHONS := $(subst $(space),$(comma),$(strip $(foreach v,$(INTEROP_VERSIONS),$(CURDIR)/.venv-tf$(v)/bin/python)))

.PHONY: demo test test-quick test-interop test-floor test-gpu-image lint format clean shell docs docs-serve

# .venv in two layers: make demo installs what the demo needs (requirements-demo.txt: the library's runtime
# dependencies, matplotlib, the kernel's build tools), make test everything in requirements-dev.txt on top (the same
# pins). PYTHONWARNINGS filters setuptools' notice that an editable install is editable (a warning block at every set-up)
define install_venv
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r $(1)
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -c 'from difftransformer.core.attention import cpu_kernel; print(cpu_kernel.build())'
endef

$(DEMO_STAMP): requirements-demo.txt requirements-dev.txt pyproject.toml
	$(call install_venv,requirements-demo.txt)
	touch $(DEMO_STAMP)
	@echo "$(VENV) is ready for the demo (make test adds the development tools)."; $(HINT)

$(STAMP): requirements-dev.txt pyproject.toml
	$(call install_venv,requirements-dev.txt)
	touch $(STAMP) $(DEMO_STAMP)
	@echo "$(VENV) is ready."; $(HINT)

# a shell with the environment active (difftx and python on PATH); exit returns
shell: $(DEMO_STAMP)
	@echo "difftx is on PATH in this shell (exit to leave)"
	@VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH="$(CURDIR)/$(BIN):$$PATH" $${SHELL:-/bin/bash}

# the documentation site (docs/, mkdocs.yml) into site/; --strict: every warning is an error
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# the site served at http://127.0.0.1:8000 (search needs it served: a browser refuses its worker from a file); Ctrl-C
docs-serve: docs
	@echo "the documentation: http://127.0.0.1:8000 (Ctrl-C stops it)"
	$(BIN)/python -m http.server 8000 --bind 127.0.0.1 --directory site

HINT := echo "difftx is $(BIN)/difftx: 'source $(BIN)/activate' (or 'make shell') puts it on PATH; then difftx --help"

demo: $(DEMO_STAMP)
	$(BIN)/difftx demo
	@$(HINT)

# DIFFTX_REQUIRE_OPTIONAL=1: the pinned environment has every optional dependency, so none of their tests may skip;
# --durations: the 15 slowest tests, so that every run (CI's included) says where the suite's time goes. The GPU
# rehearsal (marked gpu_image, 7 minutes) runs in make test-gpu-image, on the GPU machine's versions, as CI runs it
# -n: pytest-xdist's worker processes (TEST_WORKERS, default 2: one per core of the project's machines; each worker's
# torch runs 1 thread, tests/conftest.py), whole modules to a worker (--dist loadscope) so that a module's fixtures
# are built once, in the order tests/conftest.py gives them (the longest first: xdist's own reorder, by number of
# tests, left a one-test module of two minutes to the end)
TEST_WORKERS ?= 2
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
test: $(STAMP) lint
	DIFFTX_REQUIRE_OPTIONAL=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS) --durations=15 -m "not gpu_image"
	@$(HINT)

# the fast tier: every test not marked slow (1273 tests in 53 to 59 s on two idle cores with 2 workers, 2026-12-07,
# .venv already made; a first run adds its set-up)
test-quick: $(STAMP)
	DIFFTX_REQUIRE_OPTIONAL=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

.venv-tf%/.installed: tests/interop/requirements-%.txt
	test -x .venv-tf$*/bin/python || $(PYTHON) -m venv .venv-tf$*
	.venv-tf$*/bin/python -m pip install --quiet -r $<
	touch $@

# exports and imports checked in every pair of (writer, reader) among transformers 4.48, 4.57 and the pinned 5.x
test-interop: $(STAMP) $(INTEROP_STAMPS)
	DIFFTX_INTEROP_PYTHONS=$(INTEROP_PYTHONS) DIFFTX_REQUIRE_INTEROP=1 $(BIN)/python -m pytest -q tests/test_interop.py

# the fast tier on the oldest versions pyproject.toml declares (torch 2.6, transformers 4.48.0, numpy 1.24, ...),
# in .venv-floor, with this checkout on the path (optional extras absent there: their tests skip)
.venv-floor/.installed: tests/floor/requirements.txt
	test -x .venv-floor/bin/python || $(PYTHON) -m venv .venv-floor
	.venv-floor/bin/python -m pip install --quiet -r $<
	touch $@

test-floor: .venv-floor/.installed
	PYTHONPATH=$(CURDIR) .venv-floor/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) -m "not slow"

# The GPU machine's versions (Python 3.12, torch 2.11, Triton 3.6, transformers 5.17 and the rest of its image,
# pinned in tests/gpu_image), in .venv-gpu-image with this checkout on the path: the GPU rehearsal (gpu.sh --cpu, the
# CUDA branch's code on the CPU), the device choices, the Triton compile tests and the compiled blocks' gradients run
# there, so that the GPU's versions are no unknown the day one is lent (this found torch 2.11's compiled norms
# getting no gradient). Python 3.12 where the machine has one that runs (a pyenv shim on PATH may name a version
# that is not selected, so each candidate is run, not just found), else $(PYTHON); the log prints the version used.
GPU_IMAGE_PYTHON ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; exit 0; }; done; \
	echo $(PYTHON))
.venv-gpu-image/.installed: tests/gpu_image/requirements.txt
	test -x .venv-gpu-image/bin/python || $(GPU_IMAGE_PYTHON) -m venv .venv-gpu-image
	.venv-gpu-image/bin/python -m pip install --quiet -r $<
	touch $@

test-gpu-image: .venv-gpu-image/.installed
	.venv-gpu-image/bin/python -c 'import platform, torch, triton, transformers as t; print("versions: python", \
		platform.python_version(), "torch", torch.__version__, "triton", triton.__version__, "transformers", t.__version__)'
	PYTHONPATH=$(CURDIR) .venv-gpu-image/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_gpu_script.py tests/test_device_choices.py tests/test_triton_compile.py tests/test_layers.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .venv-tf* .venv-floor .venv-gpu-image build *.egg-info .pytest_cache .ruff_cache
