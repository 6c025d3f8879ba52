# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every install takes the exact versions in constraints.txt (torch's is in pyproject.toml),
# so a new release of a dependency cannot turn `make test` red; a changed pin reinstalls.
# To raise the pins on purpose: `make pins` resolves the newest versions pyproject.toml
# allows in a scratch venv and rewrites constraints.txt; then `make clean test`, and commit
# constraints.txt with whatever the new versions needed.
PIN := -c constraints.txt
PINS_VENV := build/pins-venv

.PHONY: demo test check bench clean pins browser

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` would pull several GB of CUDA packages.
	$(BIN)/pip install -q $(PIN) torch==2.13.0
	$(BIN)/pip install -q $(PIN) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/nanogpt.py
	$(BIN)/python examples/parallel.py

# The suite runs on as many workers as there are cores, up to 4 (pytest-xdist): most tests
# are one Python thread, and a test whose ranks wait on each other leaves a core idle. A file
# runs whole on one worker, in order (--dist loadfile): the lines of a README sh block build
# on each other (--save, then --resume), and a module's fixtures are made once.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(JOBS) --dist loadfile

test: $(STAMP) browser
	$(BIN)/python -m pytest -q $(XDIST) --durations=25

# The inner loop: the tests that start no process (the rest are marked multiprocess).
check: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not multiprocess"

# tests/test_html.py opens plan.html in headless Chromium: Debian's package, installed when
# missing and this is root on a machine with apt-get (CI); elsewhere that one test skips.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium for the plan.html browser test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq chromium >/dev/null; \
	  else echo "no /usr/bin/chromium: the plan.html browser test will skip"; fi; fi

# Every benchmark, each appending its table to bench/RESULTS.md (the GPU ones, gpu and
# kernels, say they need CUDA and skip on a machine without it). One: `make bench B=plan`.
BENCHES := cli capture plan plan_budget spmd pipeline fuzz precision remat fused_loss zero checkpoint hf_load step compile optimizer optimizer_in_backward offload offload_gpu longseq autoshard moe heldout published search kernels gpu
B ?= $(BENCHES)

bench: $(STAMP)
	set -e; for b in $(B); do echo "== bench.$$b"; $(BIN)/python -m bench.$$b; done

pins:
	rm -rf $(PINS_VENV)
	$(PY) -m venv $(PINS_VENV)
	$(PINS_VENV)/bin/pip install -q --upgrade pip
	$(PINS_VENV)/bin/pip install -q torch==2.13.0
	$(PINS_VENV)/bin/pip install -q -e '.[test]'
	{ sed -n '/^#/p' constraints.txt; \
	  $(PINS_VENV)/bin/pip freeze --exclude-editable | grep -iv '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(PINS_VENV)

clean:
	rm -rf $(VENV) $(PINS_VENV) *.egg-info
