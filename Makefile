# ar-slicing: `make install`, then `make all` (the demo) or `make test`.
# Stage targets name the files they produce and depend on their stage's settings, so `make` reruns
# only what is stale; a stage whose settings changed refuses, naming them, unless OVERWRITE=1.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# (overridable: tests run `make` with `ARSLICE="python -m pipeline.cli"` from their own tree)
ARSLICE ?= $(VENV)/bin/arslice
CONFIG ?= pipeline/configs/demo.toml
# A value as one quoted shell word: a CONFIG or run_dir with spaces stays one argument.
shell_word = '$(subst ','\'',$(1))'
# The run directory named by the config (`run_dir = "..."`).
RUN := $(shell sed -n 's/^run_dir *= *"\([^"]*\)".*/\1/p' $(call shell_word,$(CONFIG)) 2>/dev/null)
# ... as make names files: make splits names at spaces, so each is escaped (as the stage rules
# in stages.mk escape theirs)
space := $() $()
RUN_FILE := $(subst $(space),\ ,$(RUN))
# OVERWRITE=1: redo the stages whose settings or inputs changed (without it they refuse, naming
# the change); complete outputs of unchanged stages are still kept.
# DEMO_TRAIN=1: train the models here, taking none from the folder of prebuilt models that the
# config's `[train] prebuilt` names (`arslice run --train-here`).
RUNFLAGS := $(if $(OVERWRITE),--redo-changed,) $(if $(DEMO_TRAIN),--train-here,)
# Where `make demo-models` puts the models it trains: the folder the config's `[train] prebuilt`
# names (`prebuilt = "..."`), else demo-models.
DEMO_MODELS ?= $(or $(shell sed -n 's/^prebuilt *= *"\([^"]*\)".*/\1/p' $(call shell_word,$(CONFIG)) 2>/dev/null),demo-models)
STAGE = $(ARSLICE) run --config $(call shell_word,$(CONFIG)) $(RUNFLAGS) --stage

.PHONY: FORCE install install-browser test test-slow test-demo test-gpu lint format bench bench-scale bench-gpu all tokenizer tokenize counts tags train eval probe report verify readme-demo mqar demo-models clean-run

install:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,ray,kernels]"

# Debian's chromium, for the test that opens report.html in a headless browser (skipped without it).
install-browser:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test:
	$(PY) -m pytest -m "not slow and not gpu" -q

test-slow:
	$(PY) -m pytest -m "slow and not gpu" -q

# `make all` end to end on a reduced demo config (also part of test-slow).
test-demo:
	$(PY) -m pytest -m slow tests/pipeline/test_demo_e2e.py -q

# Only the files holding CUDA cases are collected, so a GPU machine's own Python (PY=python3)
# needs torch, transformers, tokenizers, pyarrow, numpy, numba, triton and pytest, not the data
# side's duckdb or polars (tests/test_gpu_environment.py checks it).
GPU_TESTS = $(shell grep -rl --include='test_*.py' 'pytest.mark.gpu' tests)
test-gpu:
	$(PY) -m pytest -m gpu -q $(GPU_TESTS)

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench:
	@set -e; for f in $(filter-out benchmarks/bench_scale.py,$(wildcard benchmarks/bench_*.py)); do echo "== $$f"; $(PY) $$f; done

# The Pile on one node, scaled down: 2 B training + 100 M validation tokens through import,
# count (full and restricted) and tag (about 12 GB under bench-data/scale/).
bench-scale:
	$(PY) benchmarks/bench_scale.py

bench-gpu:
	@set -e; for f in benchmarks/gpu_*.py; do echo "== $$f"; $(PY) $$f; done

# ---- the pipeline, one target per stage -------------------------------------------------------
# `arslice run --make-rules` checks the whole config first (keys, values, sources, model specs,
# and outputs made with other settings), then writes each stage's resolved settings to
# $(RUN)/.settings/<stage>.json only when they change, and the stage rules below (file names from
# the run layout) to $(RUN)/.settings/stages.mk. A stage target depends on its settings file and
# on the markers of the stages it reads, so editing the config reruns exactly what it changed.
PIPELINE_GOALS := all tokenizer tokenize counts tags train eval probe report readme-demo
ifneq ($(filter $(PIPELINE_GOALS),$(MAKECMDGOALS)),)
ifeq ($(RUN),)
$(error CONFIG=$(CONFIG): no such file, or no `run_dir = "runs/<name>"` line in it)
endif
ifneq ($(findstring :,$(RUN))$(findstring ;,$(RUN)),)
$(error CONFIG=$(CONFIG): run_dir "$(RUN)" holds a ':' or ';', which make cannot take in a file name; choose a run_dir without them, or run `arslice run --config FILE`, which takes any path)
endif
$(RUN_FILE)/.settings/stages.mk: FORCE
	@$(ARSLICE) run --config $(call shell_word,$(CONFIG)) $(RUNFLAGS) --make-rules
include $(RUN_FILE)/.settings/stages.mk
endif

all: report
tokenizer: $(MARK_tokenizer)
tokenize: $(MARK_tokenize)
counts: $(MARK_count)
tags: $(MARK_tag)
train: $(MARK_train)
eval: $(MARK_eval)
probe: $(MARK_probe)
report: $(MARK_report)

FORCE:

# Zoology's MQAR probe (Figure 2): synthetic, so it needs none of the stages above. Finished
# cells are kept, a rerun trains only what is missing and a complete sweep is skipped
# (OVERWRITE=1 retrains everything). By default the panel in docs/ (attention and BaseConv over
# every width and length, one run a cell: ~37 min on 2 cores); `make mqar MQAR_ARGS=` runs the
# whole sweep of every family (many hours on a CPU), other MQAR_ARGS another part of it.
MQAR_ARGS ?= --archs attention base_conv --lrs 3e-3 --restarts 1
mqar:
	$(ARSLICE) mqar --out $(call shell_word,$(RUN)/mqar) $(MQAR_ARGS) $(if $(OVERWRITE),--overwrite,)

# The demo's models trained here (with the config's kept checkpoints), then written in bf16 to
# $(DEMO_MODELS)/ with a README saying how (`arslice export-models`): the folder to commit, which
# `make all` takes the models from while the config's [train] asks for exactly how they were
# made. Only the models the folder does not hold made so are trained (`--train-missing`): a
# model added to the config is trained, the others are kept as they are.
demo-models:
	$(ARSLICE) run --config $(call shell_word,$(CONFIG)) --train-here --stage tokenizer tokenize
	$(ARSLICE) run --config $(call shell_word,$(CONFIG)) --train-missing --stage train
	$(ARSLICE) export-models --config $(call shell_word,$(CONFIG)) --out $(call shell_word,$(DEMO_MODELS)) \
		--command $(call shell_word,make demo-models CONFIG=$(CONFIG))

# Every invariant of the run's outputs (sizes, fingerprints, one loss per tag row, ...).
verify:
	$(ARSLICE) verify --run $(call shell_word,$(RUN))

# A demo's table and figures in docs/, regenerated from a real `make all` run: the run's folder
# name names them (runs/demo: docs/demo-table1.md, docs/demo-*.png and docs/demo.md's
# `<!-- demo-table:start -->` section; runs/demo-stdlib: docs/demo-stdlib-* and its section).
DEMO_DOC = docs/demo.md
DOCS_NAME = $(notdir $(RUN))
readme-demo: all
	mkdir -p docs
	sed -n '/^## Table 1/,/^!\[/p' $(RUN)/report/report.md | sed '$$d' > docs/$(DOCS_NAME)-table1.md
	cp $(RUN)/report/frequency_curve.png docs/$(DOCS_NAME)-frequency-curve.png
	cp $(RUN)/report/recall_gain.png docs/$(DOCS_NAME)-recall-gain.png
	cp $(RUN)/report/emergence.png docs/$(DOCS_NAME)-emergence.png
	cp $(RUN)/report/copy_length.png docs/$(DOCS_NAME)-copy-length.png
	for f in probes probes_training; do test ! -f $(RUN)/report/$$f.png || cp $(RUN)/report/$$f.png docs/$(DOCS_NAME)-$$(echo $$f | tr _ -).png; done
	$(PY) -c 'import re, sys, pathlib; n = sys.argv[1]; r = pathlib.Path(sys.argv[2]); t = pathlib.Path(f"docs/{n}-table1.md").read_text().split("\n", 2)[2].strip(); new, k = re.subn(rf"(<!-- {re.escape(n)}-table:start[^>]*-->\n).*?(\n<!-- {re.escape(n)}-table:end -->)", lambda m: m.group(1) + t + m.group(2), r.read_text(), flags=re.S); k or sys.exit(f"{r} has no <!-- {n}-table:start --> section for {n}"); r.write_text(new)' $(DOCS_NAME) $(DEMO_DOC)
	@echo "docs/$(DOCS_NAME)-table1.md, docs/$(DOCS_NAME)-*.png and $(DEMO_DOC)'s $(DOCS_NAME) table updated from $(RUN)"

clean-run:
	rm -rf $(call shell_word,$(RUN))
