#!/usr/bin/env bash
# Issue 16's GPU measurements, for a session that has a lent GPU (see BENCHMARKS.md "Captured
# forwards"). GGUF: the embedded target's GGUF on that machine (carried in parts, as in the
# earlier GPU runs); OUT: where the reports go. Every pair of runs is graphs vs --no-graphs in
# one process order, same machine, back to back.
set -euo pipefail
GGUF=${GGUF:?path to SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/gpu-graphs}
DRAFT=${DRAFT:-assets/models/smollm2-feature-draft}
mkdir -p "$OUT"
PAIR=(--target "$GGUF" --draft "$DRAFT" --device cuda)
POLICIES=linear,fixed_tree,dynatree,salf,eagle2
python -m pytest -q tests/test_graphs.py
for dtype in float32 bfloat16; do
  python -m dynatree_core latency "${PAIR[@]}" --dtype "$dtype" --out "$OUT/latency-$dtype-graphs.json"
  python -m dynatree_core latency "${PAIR[@]}" --dtype "$dtype" --no-graphs --out "$OUT/latency-$dtype-eager.json"
  for mode in graphs eager; do
    flag=(); [ "$mode" = eager ] && flag=(--no-graphs)
    python -m dynatree_core bench "${PAIR[@]}" --dtype "$dtype" "${flag[@]}" --policies "$POLICIES" \
      --limit 5 --max-new-tokens 128 --repeats 2 --out "$OUT/bench-$dtype-$mode.json" | tee "$OUT/bench-$dtype-$mode.md"
  done
done
