"""TALF: a tree-aware loss for draft training (salf-talf-tree-loss-and-stopping.md §3.2, Alg. 1).

For sampled root positions s of a training window, the TARGET builds a small tree with EAGLE-2
beam search (top-k children, expand the k best nodes of the deepest level, `depth` levels;
appendix B of the same paper) and records its next-token distribution at every node
(Alg. 1 line 5, "precomputed during tree generation"). The DRAFT then reads the window and all
tree nodes in ONE forward with tree attention (line 6: each node sees the window up to its root
and its own ancestors, position = s + depth), and the loss sums the per-node cross-entropies to
the target's distributions (lines 7-8). Node labels are stored as the target's top-k like the
window labels, so the per-node term is the same soft cross-entropy as `kd_loss`.

Tree layout per window: R roots x N nodes; `parents` index nodes of the same root (-1: the root).
"""

from __future__ import annotations

import numpy as np
import torch

from dynatree_core.core.kv import KVState
from dynatree_core.training.ledger import record


def tree_attention(length: int, roots: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor):
    """Mask and positions for [window of `length` tokens] + [R x N tree nodes], flattened.

    Args: roots (R,) root positions; parents, depths (R, N).
    Returns: visible (Q, Q) bool with Q = length + R*N, and position_ids (Q,).
    """
    r, n = parents.shape
    q = length + r * n
    visible = torch.zeros(q, q, dtype=torch.bool)
    visible[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    positions = torch.empty(q, dtype=torch.long)
    positions[:length] = torch.arange(length)
    for i in range(r):
        base = length + i * n
        for j in range(n):
            row = base + j
            visible[row, : int(roots[i]) + 1] = True
            node = j
            while node >= 0:  # the node and its ancestors within this root's tree
                visible[row, base + node] = True
                node = int(parents[i, node])
            positions[row] = int(roots[i]) + int(depths[i, j])
    return visible, positions


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


@torch.inference_mode()
def build_target_trees(
    target: torch.nn.Module, window: list[int], roots: list[int], *, k: int = 4, depth: int = 3, label_k: int = 20
) -> dict[str, np.ndarray]:
    """EAGLE-2 beam trees of the target at each root, with the target's top-`label_k` at each node.

    One window forward, then one forward per tree level for all roots together (tree attention).
    Returns arrays over (R, N = k * depth): tokens, parents, depths, topk_ids, topk_logp.
    """
    kv = KVState(target, window)
    visible = torch.ones(len(window), len(window), dtype=torch.bool).tril()
    logits = kv.forward(window, list(range(len(window))), visible, len(window))
    logp_root = torch.log_softmax(logits[roots], -1)  # (R, V)
    r, n = len(roots), k * depth
    tokens = np.zeros((r, n), np.int64)
    parents = np.full((r, n), -1, np.int64)
    depths = np.zeros((r, n), np.int64)
    cum = np.zeros((r, n))
    slots = np.zeros((r, n), np.int64)  # cache index of each node once forwarded
    topk_ids = np.zeros((r, n, label_k), np.uint16)
    topk_logp = np.zeros((r, n, label_k), np.float16)
    frontier_logp = logp_root[:, None, :]  # (R, 1, V): distributions of the nodes to expand
    frontier = [[-1] for _ in range(r)]  # node indices (per root) whose children we choose
    for level in range(depth):
        for i in range(r):  # beam: top-k children of each frontier node, keep the best k paths
            lp, tok = frontier_logp[i].topk(k, dim=-1)  # (F, k)
            base = np.array([cum[i, f] if f >= 0 else 0.0 for f in frontier[i]])[:, None] + lp.numpy()
            best = np.argsort(-base.ravel(), kind="stable")[:k]
            for j, flat in enumerate(best):
                f, c = divmod(int(flat), k)
                node = level * k + j
                tokens[i, node] = int(tok[f, c])
                parents[i, node] = frontier[i][f]
                depths[i, node] = level + 1
                cum[i, node] = base.ravel()[flat]
        new = [(i, level * k + j) for i in range(r) for j in range(k)]
        vis = torch.zeros(len(new), kv.length + len(new), dtype=torch.bool)
        for row, (i, node) in enumerate(new):
            vis[row, : roots[i] + 1] = True
            anc = parents[i, node]
            while anc >= 0:
                vis[row, slots[i, anc]] = True
                anc = parents[i, anc]
            vis[row, kv.length + row] = True
            slots[i, node] = kv.length + row
        out = kv.forward(
            [int(tokens[i, node]) for i, node in new],
            [roots[i] + int(depths[i, node]) for i, node in new],
            vis,
            len(new),
        )
        logp = torch.log_softmax(out, -1).view(r, k, -1)
        top, tid = logp.topk(label_k, dim=-1)
        for i in range(r):
            topk_ids[i, level * k : (level + 1) * k] = tid[i].numpy().astype(np.uint16)
            topk_logp[i, level * k : (level + 1) * k] = top[i].numpy().astype(np.float16)
        frontier_logp = logp
        frontier = [list(range(level * k, (level + 1) * k)) for _ in range(r)]
    return {"tokens": tokens, "parents": parents, "depths": depths, "topk_ids": topk_ids, "topk_logp": topk_logp}


def talf_node_loss(draft: torch.nn.Module, window: torch.Tensor, roots: torch.Tensor, trees: dict) -> torch.Tensor:
    """Sum over tree nodes of the soft cross-entropy to the target's top-k (Alg. 1 lines 6-8).

    Args: window (L,) token ids; roots (R,); trees: tensors tokens/parents/depths (R, N) and
    topk_ids/topk_logp (R, N, K). One draft forward over window + all nodes.
    """
    length = window.shape[0]
    visible, positions = tree_attention(length, roots, trees["parents"], trees["depths"])
    ids = torch.cat([window, trees["tokens"].reshape(-1)])
    dtype = next(draft.parameters()).dtype
    logits = draft(input_ids=ids[None], position_ids=positions[None], attention_mask=additive(visible, dtype)).logits[
        0, length:
    ]  # (R*N, V)
    logq = torch.log_softmax(logits.float(), -1)
    k = trees["topk_ids"].shape[-1]
    logq_k = logq.gather(-1, trees["topk_ids"].reshape(-1, k))
    p = torch.softmax(trees["topk_logp"].reshape(-1, k).float(), -1)
    return -(p * logq_k).sum()


def label_trees(
    corpus_path,
    out_path,
    *,
    rows: int,
    roots: int = 8,
    k: int = 4,
    depth: int = 3,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> None:
    """Target trees for the first `rows` training windows of each source (on-policy first).

    Resumable: windows already in `out_path` are kept; progress is saved every 32 windows.
    """
    import time
    from pathlib import Path

    from dynatree_core.core.models import load_model

    out_path = Path(out_path)
    data = np.load(corpus_path)
    rng = np.random.default_rng(seed)
    candidates = np.flatnonzero(~data["heldout"])
    onpolicy = candidates[data["source"][candidates] == 0]
    other = rng.permutation(candidates[data["source"][candidates] != 0])
    chosen = np.concatenate([onpolicy, other])[:rows]
    done: dict[str, list] = {
        "row": [],
        "roots": [],
        "tokens": [],
        "parents": [],
        "depths": [],
        "topk_ids": [],
        "topk_logp": [],
    }
    if out_path.exists():
        with np.load(out_path) as old:
            done = {key: list(old[key]) for key in done}
    todo = [r for r in chosen if r not in set(done["row"])]
    print(f"talf: {len(done['row'])} windows present, {len(todo)} to label", flush=True)
    if not todo:
        return
    target = load_model("embedded", device="cpu", dtype=dtype).model
    t0 = last = time.perf_counter()
    for count, row in enumerate(todo, 1):
        length = int(data["lengths"][row])
        window = data["ids"][row, :length].astype(np.int64).tolist()
        picks = np.sort(rng.choice(np.arange(length - 1), size=min(roots, length - 1), replace=False))
        trees = build_target_trees(target, window, picks.tolist(), k=k, depth=depth)
        if len(picks) < roots:  # pad short windows by repeating the last root's tree
            pad = roots - len(picks)
            picks = np.concatenate([picks, np.repeat(picks[-1:], pad)])
            trees = {key: np.concatenate([v, np.repeat(v[-1:], pad, axis=0)]) for key, v in trees.items()}
        done["row"].append(row)
        done["roots"].append(picks)
        for key, value in trees.items():
            done[key].append(value)
        if count % 32 == 0 or count == len(todo):
            tmp = out_path.with_name(out_path.stem + ".tmp.npz")
            np.savez(tmp, **{key: np.stack(v) if key != "row" else np.asarray(v) for key, v in done.items()})
            tmp.rename(out_path)
            print(f"talf: {count}/{len(todo)} windows, {time.perf_counter() - t0:.0f}s", flush=True)
            record("talf-label", time.perf_counter() - last, item=f"windows to {count}")
            last = time.perf_counter()
