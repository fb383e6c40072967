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
  without_replacement  recursive rejection in drawing order for children drawn without
                       replacement: round i uses q renormalised over the tokens not yet drawn
                       (DySpec App. A.3 / Sequoia)
"""

from __future__ import annotations

import torch

EPS = 1e-12


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(p - q)+ renormalised; p itself when p <= q everywhere (then nothing is left to correct)."""
    res = (p - q).clamp_min(0)
    total = res.sum()
    return res / total if total > EPS else p


def _ratio(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    return 1.0 if q[x] <= EPS else min(1.0, float(p[x] / q[x]))


def _draw(dist: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(dist, 1, generator=gen))


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _onehot(x: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[x] = 1.0
    return out


# ----- NSS ----------------------------------------------------------------------------------------
def nss_sample(p, q, xs, gen=None):
    y = _draw(p, gen)
    return y, (xs.index(y) if y in xs else None)


def nss_distribution(p, q, xs):
    return p.clone()


# ----- Naive --------------------------------------------------------------------------------------
def naive_sample(p, q, xs, gen=None):
    if xs and _uniform(gen) <= _ratio(p, q, xs[0]):  # Alg. 2 lines 1-3
        return xs[0], 0
    y = _draw(_residual(p, q) if xs else p, gen)  # lines 5-6
    return y, (xs.index(y) if y in xs else None)


def naive_distribution(p, q, xs):
    if not xs:
        return p.clone()
    a = _ratio(p, q, xs[0])
    return a * _onehot(xs[0], p) + (1 - a) * _residual(p, q)


# ----- SpecTr (K-SEQ) -----------------------------------------------------------------------------
def spectr_rho(p: torch.Tensor, q: torch.Tensor, k: int, iters: int = 60) -> float:
    """rho* in [1, k]: the root of p_acc(rho) - rho * beta(rho), Eq. 6-7, by bisection."""

    def gap(rho: float) -> float:
        beta = float(torch.minimum(p / rho, q).sum())
        return 1 - (1 - beta) ** k - rho * beta

    lo, hi = 1.0, float(k)
    if gap(lo) <= 0:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def _spectr_residual(p, q, k, rho):
    beta = float(torch.minimum(p / rho, q).sum())
    gamma = (1 - (1 - beta) ** k) / beta if beta > EPS else 0.0
    res = (p - torch.minimum(p / rho, q) * gamma).clamp_min(0)  # Alg. 3 line 11
    return res / res.sum() if res.sum() > EPS else p


def spectr_sample(p, q, xs, gen=None):
    if not xs:
        return _draw(p, gen), None
    rho = spectr_rho(p, q, len(xs))
    for i, x in enumerate(xs):  # Alg. 3 lines 5-10
        if rho * _uniform(gen) <= (float(p[x] / q[x]) if q[x] > EPS else float("inf")):
            return x, i
    y = _draw(_spectr_residual(p, q, len(xs), rho), gen)
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
def specinfer_sample(p, q, xs, gen=None):
    remaining = list(range(len(xs)))
    while remaining:  # Alg. 4 lines 2-9
        i = remaining[int(torch.randint(len(remaining), (), generator=gen))]
        if _uniform(gen) <= _ratio(p, q, xs[i]):
            return xs[i], i
        p = _residual(p, q)
        remaining.remove(i)
    y = _draw(p, gen)
    return y, (xs.index(y) if y in xs else None)


def specinfer_distribution(p, q, xs):
    if not xs:
        return p.clone()
    out = torch.zeros_like(p)
    for i, x in enumerate(xs):  # each remaining child is tried first with probability 1/|S|
        a = _ratio(p, q, x)
        rest = xs[:i] + xs[i + 1 :]
        out += (a * _onehot(x, p) + (1 - a) * specinfer_distribution(_residual(p, q), q, rest)) / len(xs)
    return out


# ----- Without replacement ------------------------------------------------------------------------
def _without(q: torch.Tensor, drawn: list[int]) -> torch.Tensor:
    q = q.clone()
    q[drawn] = 0.0
    return q / q.sum() if q.sum() > EPS else q


def without_replacement_sample(p, q, xs, gen=None):
    for i, x in enumerate(xs):
        qi = _without(q, xs[:i])
        if _uniform(gen) <= _ratio(p, qi, x):
            return x, i
        p = _residual(p, qi)
    y = _draw(p, gen)
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


SOLVERS = {
    "nss": (nss_sample, nss_distribution),
    "naive": (naive_sample, naive_distribution),
    "spectr": (spectr_sample, spectr_distribution),
    "specinfer": (specinfer_sample, specinfer_distribution),
    "without_replacement": (without_replacement_sample, without_replacement_distribution),
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
    raise ValueError(f"no closed-form acceptance for {name!r}")
