"""Node-level solvers of lossless verification (delayed-tree-expansion paper §3.2 and App. B).

At one tree node the target's distribution is p, the draft's is q, and the node's children are
the draft tokens xs (drawn i.i.d. from q, or without replacement from q). A solver returns the
next token Y; it is lossless when Y ~ p once the draws of xs are averaged out. A top-down
verifier applies a solver at the root, moves to the child Y if Y is one of xs, and repeats.

Every solver has two forms that share their arithmetic:
  sample(p, q, xs, gen) -> (Y, index of the accepted child or None)
  distribution(p, q, xs) -> the exact law of Y given xs (for the exactness tests and the
                            closed-form acceptance shown in the app)

  nss                  sample Y ~ p, ignoring the draft (App. B.1, Alg. 1): the only one valid
                       on deterministic (top-k) trees
  naive                accept X1 with min(1, p/q), else Y ~ (p - q)+ (App. B.2, Alg. 2); with one
                       child this is standard speculative sampling (Leviathan / Chen)
  spectr               K-SEQ with the division factor rho* by bisection (App. B.3, Alg. 3)
  specinfer            recursive rejection, a uniformly chosen remaining child per round, the
                       residual updated after each rejection (App. B.4, Alg. 4)
  khisti               importance-weighted tournament selects one draft token x whose law r is
                       known exactly, then speculative sampling of x against r (App. B.5, Alg. 5;
                       Khisti et al. 2025's canonical decomposition); weights p/q, truncated
  without_replacement  recursive rejection in drawing order for children drawn without
                       replacement: round i uses q renormalised over the tokens not yet drawn
                       (DySpec App. A.3 / Sequoia)
"""

from __future__ import annotations

import numpy as np
import torch

EPS = 1e-12


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(p - q)+ renormalised; p itself when p <= q everywhere (then nothing is left to correct)."""
    res = (p - q).clamp_min(0)
    total = res.sum()
    return res / total if total > EPS else p


def _ratio(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    return 1.0 if q[x] <= EPS else min(1.0, float(p[x] / q[x]))


def draw_from(dist: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(dist, 1, generator=gen))


def uniform_draw(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _onehot(x: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[x] = 1.0
    return out


def top_tokens(dist: torch.Tensor, n: int = 5) -> list[list]:
    """[[token, probability], ...] of the n most likely tokens (what a trace shows of a residual)."""
    probs, toks = dist.topk(min(n, dist.numel()))
    return [[int(t), round(float(v), 6)] for t, v in zip(toks, probs, strict=True) if v > 0]


def _test(trace: list | None, x: int, prob: float, gen) -> bool:
    """Accept draft token x with probability `prob`; the trace keeps the draw and the decision."""
    u = uniform_draw(gen)
    if trace is not None:
        trace.append({"kind": "test", "token": int(x), "prob": prob, "u": u, "accepted": u <= prob})
    return u <= prob


def _sample(trace: list | None, dist: torch.Tensor, source: str, gen) -> int:
    y = draw_from(dist, gen)
    if trace is not None:
        if source != "p":
            trace.append({"kind": "residual", "top": top_tokens(dist)})
        trace.append({"kind": "sample", "token": y, "source": source})
    return y


# ----- NSS ----------------------------------------------------------------------------------------
def nss_sample(p, q, xs, gen=None, trace=None):
    y = _sample(trace, p, "p", gen)
    return y, (xs.index(y) if y in xs else None)


def nss_distribution(p, q, xs):
    return p.clone()


# ----- Naive --------------------------------------------------------------------------------------
def naive_sample(p, q, xs, gen=None, trace=None):
    if xs and _test(trace, xs[0], _ratio(p, q, xs[0]), gen):  # Alg. 2 lines 1-3
        return xs[0], 0
    y = _sample(trace, _residual(p, q), "residual", gen) if xs else _sample(trace, p, "p", gen)  # lines 5-6
    return y, (xs.index(y) if y in xs else None)


def naive_distribution(p, q, xs):
    if not xs:
        return p.clone()
    a = _ratio(p, q, xs[0])
    return a * _onehot(xs[0], p) + (1 - a) * _residual(p, q)


# ----- SpecTr (K-SEQ) -----------------------------------------------------------------------------
def spectr_rho(p: torch.Tensor, q: torch.Tensor, k: int, iters: int = 60) -> float:
    """rho* in [1, k]: the root of gap(rho) = p_acc(rho) - rho * beta(rho), Eq. 6-7, by bisection.

    beta(rho) = sum_i min(p_i / rho, q_i) = P / rho + Q, where P sums p over the tokens whose ratio
    p_i / q_i <= rho and Q sums q over the others: between two ratios, A / rho + B. gap does not
    rise with rho (p_acc falls with beta, rho * beta = P + rho * Q rises), so the root lies in one
    piece, found from gap at every ratio inside (1, k) in one vectorised pass; the bisection then
    runs on that piece's two scalars instead of a pass over the vocabulary per step."""
    p, q = (t.detach().to("cpu", torch.float64).numpy() for t in (p, q))  # scalar-sized work: numpy
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q > 0, p / q, np.inf)
    above = ratio > 1
    inside = above & (ratio < k)
    order = np.argsort(ratio[inside], kind="stable")
    at = np.concatenate([[1.0], ratio[inside][order]])  # piece j starts at at[j] (rho = 1 for the first)
    a = p[~above].sum() + np.concatenate([[0.0], np.cumsum(p[inside][order])])  # its P
    b = np.maximum(q[above].sum() - np.concatenate([[0.0], np.cumsum(q[inside][order])]), 0.0)  # its Q
    beta = a / at + b
    n = max(int(np.count_nonzero(1 - (1 - beta) ** k - at * beta > 0)), 1)  # gap > 0 on a prefix of the pieces
    start, end = float(at[n - 1]), float(at[n]) if n < at.size else float(k)
    a_n, b_n = float(a[n - 1]), float(b[n - 1])

    def positive(rho: float) -> bool:
        if rho < start or rho >= end:  # another piece: gap > 0 before the root's, <= 0 after it
            return rho < start
        beta = a_n / rho + b_n
        return 1 - (1 - beta) ** k - rho * beta > 0

    lo, hi = 1.0, float(k)
    if not positive(lo):
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if positive(mid) else (lo, mid)
    return (lo + hi) / 2


def _spectr_residual(p, q, k, rho):
    beta = float(torch.minimum(p / rho, q).sum())
    gamma = (1 - (1 - beta) ** k) / beta if beta > EPS else 0.0
    res = (p - torch.minimum(p / rho, q) * gamma).clamp_min(0)  # Alg. 3 line 11
    return res / res.sum() if res.sum() > EPS else p


def spectr_sample(p, q, xs, gen=None, trace=None):
    if not xs:
        return _sample(trace, p, "p", gen), None
    rho = spectr_rho(p, q, len(xs))
    for i, x in enumerate(xs):  # Alg. 3 lines 5-10: rho* U <= p/q, i.e. U <= p / (rho* q)
        if _test(trace, x, min(1.0, float(p[x] / (rho * q[x]))) if q[x] > EPS else 1.0, gen):
            return x, i
    y = _sample(trace, _spectr_residual(p, q, len(xs), rho), "residual", gen)
    return y, (xs.index(y) if y in xs else None)


def spectr_distribution(p, q, xs):
    if not xs:
        return p.clone()
    rho = spectr_rho(p, q, len(xs))
    out, alive = torch.zeros_like(p), 1.0
    for x in xs:
        a = min(1.0, float(p[x] / (rho * q[x]))) if q[x] > EPS else 1.0
        out[x] += alive * a
        alive *= 1 - a
    return out + alive * _spectr_residual(p, q, len(xs), rho)


# ----- SpecInfer ----------------------------------------------------------------------------------
def specinfer_sample(p, q, xs, gen=None, trace=None):
    remaining, source = list(range(len(xs))), "p"
    while remaining:  # Alg. 4 lines 2-9
        i = remaining[int(torch.randint(len(remaining), (), generator=gen))]
        if _test(trace, xs[i], _ratio(p, q, xs[i]), gen):
            return xs[i], i
        p, source = _residual(p, q), "residual"
        remaining.remove(i)
    y = _sample(trace, p, source, gen)
    return y, (xs.index(y) if y in xs else None)


def specinfer_distribution(p, q, xs):
    """Exact law by Alg. 14's recursion over the children not yet tried. The residual after i
    rejections is the same whichever children were rejected, so the law is a mix of the draft
    tokens and of the round-i residuals, with coefficients memoised per remaining multiset:
    O(2^k k) scalar work instead of k! vector work."""
    if not xs:
        return p.clone()
    rounds = [p]
    for _ in xs:
        rounds.append(_residual(rounds[-1], q))
    accept = [{x: _ratio(rounds[i], q, x) for x in set(xs)} for i in range(len(xs))]
    memo: dict[tuple[int, ...], tuple[dict[int, float], list[float]]] = {}

    def law(left: tuple[int, ...]) -> tuple[dict[int, float], list[float]]:
        """(mass on each draft token, mass on each round's residual) with `left` still to try."""
        if left not in memo:
            i = len(xs) - len(left)
            tokens, residuals = {}, [0.0] * (len(xs) + 1)
            if not left:
                residuals[i] = 1.0
            for j, t in enumerate(left):  # each remaining child is tried next with prob 1/|left|
                a = accept[i][t] / len(left)
                tokens[t] = tokens.get(t, 0.0) + a
                sub_tokens, sub_res = law(left[:j] + left[j + 1 :])
                scale = (1 - accept[i][t]) / len(left)
                for u, m in sub_tokens.items():
                    tokens[u] = tokens.get(u, 0.0) + scale * m
                residuals = [r + scale * s for r, s in zip(residuals, sub_res, strict=True)]
            memo[left] = tokens, residuals
        return memo[left]

    tokens, residuals = law(tuple(sorted(xs)))
    out = sum(w * r for w, r in zip(residuals, rounds, strict=True))
    for t, m in tokens.items():
        out[t] += m
    return out


# ----- Without replacement ------------------------------------------------------------------------
def _without(q: torch.Tensor, drawn: list[int]) -> torch.Tensor:
    q = q.clone()
    q[drawn] = 0.0
    return q / q.sum() if q.sum() > EPS else q


def without_replacement_sample(p, q, xs, gen=None, trace=None):
    source = "p"
    for i, x in enumerate(xs):
        qi = _without(q, xs[:i])
        if _test(trace, x, _ratio(p, qi, x), gen):
            return x, i
        p, source = _residual(p, qi), "residual"
    y = _sample(trace, p, source, gen)
    return y, (xs.index(y) if y in xs else None)


def without_replacement_distribution(p, q, xs):
    out, alive = torch.zeros_like(p), 1.0
    for i, x in enumerate(xs):
        qi = _without(q, xs[:i])
        a = _ratio(p, qi, x)
        out[x] += alive * a
        alive *= 1 - a
        p = _residual(p, qi)
    return out + alive * p


# ----- Khisti (importance-weighted selection, then single-draft speculative sampling) -------------
KHISTI_TOP = 64  # tokens with their own importance weight; the rest share one (truncation)


def _khisti_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Importance weights w = p/q on the draft's KHISTI_TOP likeliest tokens and one shared weight
    p(tail)/q(tail) on the others, so the selection law r costs O(top^2 + V) instead of O(V^2)."""
    idx = q.topk(min(KHISTI_TOP, q.numel())).indices
    tail_q, tail_p = float(1 - q[idx].sum()), float(1 - p[idx].sum())
    w = torch.full_like(p, max(tail_p, 0.0) / tail_q if tail_q > EPS else 0.0)
    w[idx] = p[idx] / q[idx].clamp_min(EPS)
    return w


def _beats(wa, wb):
    """P(a wins a pairwise match against b): w_a / (w_a + w_b), a fair coin when both are 0."""
    total = wa + wb
    return torch.where(total > 0, wa / torch.where(total > 0, total, 1), 0.5)


def _beats_scalar(wa: float, wb: float) -> float:
    """_beats on two Python floats (the same float64 division, without a tensor op per match)."""
    return wa / (wa + wb) if wa + wb > 0 else 0.5


def _match(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Law of the winner of a match between independent players with token laws a and b."""
    support = ((a + b) > 0).nonzero().flatten()
    if support.numel() > KHISTI_TOP + 1:  # many tokens share the tail weight: group them
        classes, inverse = torch.unique(w[support], return_inverse=True)
        a_mass = torch.zeros_like(classes).index_add_(0, inverse, a[support])
        b_mass = torch.zeros_like(classes).index_add_(0, inverse, b[support])
        beat = _beats(classes[:, None], classes[None, :])  # (classes, classes)
        win_vs_b, win_vs_a = (beat @ b_mass)[inverse], (beat @ a_mass)[inverse]
    else:
        beat = _beats(w[support][:, None], w[support][None, :])
        win_vs_b, win_vs_a = beat @ b[support], beat @ a[support]
    out = torch.zeros_like(a)
    out[support] = a[support] * win_vs_b + b[support] * win_vs_a
    return out


def _tournament_law(players: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """Law of the winner of a knockout bracket: pairs (1,2), (3,4), ..., an odd one out waits."""
    while len(players) > 1:
        nxt = [_match(players[i], players[i + 1], w) for i in range(0, len(players) - 1, 2)]
        players = nxt + players[len(nxt) * 2 :]
    return players[0]


def khisti_importance_sample(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, w): the law r of the tournament winner among k i.i.d. draws from q (App. B.5 line 1)."""
    w = _khisti_weights(p, q)
    return _tournament_law([q] * k, w), w


def khisti_sample(p, q, xs, gen=None, trace=None):
    if not xs:
        return _sample(trace, p, "p", gen), None
    r, w = khisti_importance_sample(p, q, len(xs))
    bracket, weight = list(xs), dict(zip(xs, w[xs].tolist(), strict=True))  # float64: _beats on scalars
    while len(bracket) > 1:  # line 2: tournament selection among the draft tokens
        nxt = [
            a if uniform_draw(gen) <= _beats_scalar(weight[a], weight[b]) else b
            for a, b in zip(bracket[0:-1:2], bracket[1::2], strict=True)
        ]
        bracket = nxt + bracket[len(nxt) * 2 :]
    x = bracket[0]
    if _test(trace, x, _ratio(p, r, x), gen):  # line 3: speculative sampling with r as the draft
        return x, xs.index(x)
    y = _sample(trace, _residual(p, r), "residual", gen)
    return y, (xs.index(y) if y in xs else None)


def khisti_distribution(p, q, xs):
    if not xs:
        return p.clone()
    r, w = khisti_importance_sample(p, q, len(xs))
    chosen = _tournament_law([_onehot(x, p) for x in xs], w)  # Alg. 15 line 3
    out = torch.zeros_like(p)
    for x in chosen.nonzero().flatten().tolist():
        out += chosen[x] * naive_distribution(p, r, [x])
    return out


SOLVERS = {
    "nss": (nss_sample, nss_distribution),
    "naive": (naive_sample, naive_distribution),
    "spectr": (spectr_sample, spectr_distribution),
    "specinfer": (specinfer_sample, specinfer_distribution),
    "without_replacement": (without_replacement_sample, without_replacement_distribution),
    "khisti": (khisti_sample, khisti_distribution),
}


# ----- closed-form acceptance rates (App. C) ------------------------------------------------------
def acceptance(name: str, p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    """P(the solver's output is one of the k i.i.d. draft tokens), averaged over the draws
    (Definition 5.1): what the app shows as the expected acceptance at a node."""
    if k <= 0:
        return 0.0
    if name == "nss":  # Alg. 6
        return float((p * (1 - (1 - q) ** k)).sum())
    if name == "naive":  # Alg. 7
        return float(torch.minimum(p, q).sum() + ((p - q).clamp_min(0) * (1 - (1 - q) ** (k - 1))).sum())
    if name == "spectr":  # Alg. 8
        rho = spectr_rho(p, q, k)
        beta = float(torch.minimum(p / rho, q).sum())
        p_acc = 1 - (1 - beta) ** k
        res = _spectr_residual(p, q, k, rho)
        r = (q - p / rho).clamp_min(0) / (1 - beta) if beta < 1 - EPS else torch.zeros_like(q)
        return p_acc + (1 - p_acc) * float((res * (1 - (1 - r) ** k)).sum())
    if name == "specinfer":  # Alg. 9
        p_rej, m = 1.0, torch.ones_like(p)
        for _ in range(k):
            r = float(torch.minimum(p, q).sum())
            p_rej *= 1 - r
            if 1 - r > EPS:
                m = m * (1 - (q - p).clamp_min(0) / (1 - r))
            p = _residual(p, q)
        return (1 - p_rej) + p_rej * float((p * (1 - m)).sum())
    if name == "khisti":  # Alg. 10: a lower bound (the residual may still land on a draft token)
        r, _ = khisti_importance_sample(p, q, k)
        return float(torch.minimum(p, r).sum())
    raise ValueError(f"no closed-form acceptance for {name!r}")
