"""Benchmark scripts: what the CLI's `bench` cannot measure alone, one script per question.

Run each from the repo root as a module, nothing else torch-heavy running (each takes the
machine's cores; BENCHMARKS.md gives the exact commands behind every number):

    PYTHONPATH=. .venv/bin/python -m benchmarks.<script> [--help]

Results are data, not code: every script writes its reports (JSON, CSV) into assets/benchmarks/
(`RESULTS`); this package holds only the scripts. BENCHMARKS.md is written from those reports by
`benchmarks_doc` (a number reaches it through a topic there, never by hand).

    ood_headline        BENCHMARKS' headline: each draft of the embedded target on the OOD prompts
                        (speedup over the faster of ar and HF generate), cpu-ood-headline.json
    draft_merit         a new feature draft against the shipped one in one process: OOD agreement,
                        the OOD headline, the README example; ship only if ahead, cpu-draft-merit.json
    ood_defaults        fits each tree policy's registry defaults on OOD prompts 9-16 (bench sweeps),
                        ood-defaults/
    forward_paths       one cached forward on each forward path (lean, static, dynamic) by width,
                        cpu-forward-paths.json
    invariance_cost     what width-invariant forwards cost against the shared-kernel lean forward,
                        cpu-invariance-cost.json
    gqa_fold            lean forward ms with query heads folded vs enable_gqa, by width
    draft_levels        ms per draft level in the decoding loop: token draft vs feature draft variants
    map_cost            ms per draft level against the feature draft's vocabulary size
    draft_data_speed    draft-data throughput: HF generate + teacher-forced pass vs one-pass batching
    answer_profile      the draft recipe's answer decoding timed and profiled (device busy share, top
                        ops on device and host), for a lent GPU's `gpu_session.sh measure answers`
    train_profile       the draft recipe's training step timed and profiled over a run's answers, for a
                        lent GPU's `gpu_session.sh measure train`
    train_step          the feature draft's training step before and after the cheap step
    decode_profile      where a decoding run's host time goes, function by function (cProfile), GEMMs apart
    drawing_contention  what Python drawing costs the engine: a decoding thread vs a decoding process
    live_page           the live page in Chromium vs the CLI, engine-time tokens/s, cpu-live-page*.json
    first_iterations    the first ten live iterations' tokens/s against the rest's, in Chromium
    pages_open          each page's first drawn figure after its title, in Chromium, cpu-pages-open.json
    replicas            two sessions on one pair: iterations/s with one engine against two replicas (Ray
                        engines), cpu-replicas.json
    gpu_check_shaped    gpu-check's pair checks on SmolLM2's shapes with random weights (CUDA only)
    verify_rows         rows per verify forward queued from the device's rows vs the host-built batch,
                        cpu-verify-rows.json
    iteration_path      the files and functions one decoding iteration passes through, traced,
                        cpu-iteration-path.json
    iteration_split     a greedy iteration's draft / verify / commit / outside ms and tokens, per policy
    launches            launches per iteration outside the forwards: levels on the host, on the device
                        op by op, and as captured steps, cpu-launches.json
    forward_kernels     kernels one target forward launches in the CPU's form and the GPU's (fused norm
                        and projections), and the rotation's time both ways, cpu-forward-kernels.json
    benchmarks_doc      not a benchmark: writes BENCHMARKS.md from the committed reports (each topic's
                        table, command, date, machine and computed goals); --check says if it is stale
    app_server          not a benchmark: `streamlit run app.py` on a free port as a context manager,
                        shared by live_page, first_iterations and tests/test_e2e.py

`benchmarks/gpu_session.sh` (a shell script, run by path) stages a lean copy of the tree for a
lent GPU machine and lists the device calls that measure gpu-check and `bench` there.

Nothing in dynatree_core imports this package (tests/test_layering.py); tests/test_benchmarks.py
imports every module and runs each script's --help, so none rots.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "assets" / "benchmarks"
