"""Everything a user can run by name, in one ordered catalogue: the drafting policies our engine
steps (drafting/, `POLICIES`) and the black-box baselines (baselines.py, `BASELINES`).

The CLI's `--policy`, `policies --json`, the compare specs and every page's picker read this
module, so a new policy or baseline shows up everywhere once it is registered.
"""

from __future__ import annotations

from typing import Any

from dynatree_core import drafting  # noqa: F401  (registers the built-in policies)
from dynatree_core.decoding.baselines import BASELINES, Baseline
from dynatree_core.drafting.policy import POLICIES, Policy, Tunable
from dynatree_core.errors import DynaTreeError
from dynatree_core.verify.registry import resolve_verifier


def catalogue() -> dict[str, type[Tunable]]:
    """Name -> class, in the order every list shows: the drafting policies (drafting.ORDER, then
    any registered later), then the baselines."""
    return {**POLICIES, **BASELINES}


# The references every comparison and benchmark runs first: our own loop without drafting, and
# Hugging Face's generate, eager and with a static cache (compiled on CUDA: the fastest AR decoding
# a user would time against); speedups are over the fastest of them in the same run.
REFERENCES = ("ar", "hf_generate", "hf_static")


def candidates() -> list[str]:
    """The methods a comparison can pick (everything but the references it always includes)."""
    return [name for name in catalogue() if name not in REFERENCES]


def method_class(name: str) -> type[Tunable]:
    methods = catalogue()
    if name not in methods:
        raise DynaTreeError(f"unknown policy {name!r}; choose one of: {', '.join(methods)}")
    return methods[name]


def make_method(name: str, values: dict[str, Any] | None = None) -> Policy | Baseline:
    """Instantiate a registered policy or baseline by name, validating its parameters."""
    return method_class(name)(**(values or {}))


def is_baseline(name: str) -> bool:
    return name in BASELINES


def verifier_for(method: Policy | Baseline, config: Any) -> str:
    """The verifier a run of `method` under `config` (a DecodeConfig) uses: "hf" for a baseline
    (HF verifies inside its own generate), else the registry's resolution (refusing an invalid
    pairing with a DynaTreeError)."""
    if isinstance(method, Baseline):
        return "hf"
    return resolve_verifier(method.capabilities(), config.verifier, config.sampling)[0]
