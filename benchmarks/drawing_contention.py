"""What drawing in Python costs the engine: a decoding thread vs a decoding process.

    PYTHONPATH=. .venv/bin/python -m benchmarks.drawing_contention [--rounds 3]

The app draws in Python (figures, protobuf) in the same process as its decoding worker thread.
This script decodes the embedded pair (fixed_tree defaults, "Why is the sky blue?", chat
template, 64 tokens, 1 torch thread, as the app runs it) while a stand-in for the drawing runs
pure Python for 0.2 s of every 0.6 s, in two arrangements:

- `thread`: the engine in a second thread of this process (the app's design today): both
  threads need the GIL;
- `process`: the engine in a child process (spawned, its own interpreter): no GIL in common.

Each arrangement is measured with and without the drawing, alternating, after one warm-up; it
prints engine-time tokens/s per run. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time


def load():
    import torch

    from dynatree_core.decoding.engine import DecodeConfig, generate
    from dynatree_core.decoding.pairs import encode_prompt, load_pair
    from dynatree_core.drafting import make_policy

    torch.set_num_threads(1)
    pair = load_pair("embedded", None, device="cpu", dtype="float32")
    ids = encode_prompt(pair.target.tokenizer, "Why is the sky blue?", chat=True)
    config = DecodeConfig(max_new_tokens=64, eos_token_ids=pair.target.eos_token_ids)

    def decode() -> float:
        kw = dict(draft=pair.draft.model, config=config, draft_token_map=pair.draft.token_map)
        return generate(pair.target.model, ids, make_policy("fixed_tree", {}), **kw).throughput_tps

    return decode


def child(go, out) -> None:
    decode = load()
    out.put("ready")
    while go.get():
        out.put(decode())


def draw_while(busy: bool, finished) -> None:
    """Until finished(): pure Python 0.2 s of every 0.6 s (busy), else just poll."""
    while not finished():
        if busy:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.2:
                sum(j * j for j in range(200))
            time.sleep(0.4)
        else:
            time.sleep(0.05)


def in_thread(decode, busy: bool) -> float:
    result = []
    worker = threading.Thread(target=lambda: result.append(decode()))
    worker.start()
    draw_while(busy, lambda: not worker.is_alive())
    worker.join()
    return result[0]


def in_process(go, out, busy: bool) -> float:
    go.put(True)
    got: list[float] = []

    def finished() -> bool:
        if not got and not out.empty():
            got.append(out.get())
        return bool(got)

    draw_while(busy, finished)
    return got[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(go, out), daemon=True)
    proc.start()
    decode = load()
    if out.get(timeout=300) != "ready":
        raise SystemExit("the engine process did not start")
    in_thread(decode, False), in_process(go, out, False)  # warm-ups
    results: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for busy in (False, True):
            results.setdefault(("thread", busy), []).append(round(in_thread(decode, busy), 1))
            results.setdefault(("process", busy), []).append(round(in_process(go, out, busy), 1))
    go.put(False)
    proc.join(timeout=60)
    for (where, busy), tps in results.items():
        print(f"engine in a {where:7}, {'drawing' if busy else 'idle':7}: {tps} tokens/s")


if __name__ == "__main__":
    main()
