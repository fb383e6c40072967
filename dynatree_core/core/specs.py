"""Which model specs this instance serves: the deployer's allow-list.

A public instance started with DYNATREE_PRESETS_ONLY=1 serves the preset model pairs
(core/presets.py) and nothing else, so nobody can point it at arbitrary paths or hub ids.
Nothing here loads a model.
"""

from __future__ import annotations

from dynatree_core.core.presets import PRESETS
from dynatree_core.core.settings import env
from dynatree_core.errors import DynaTreeError


def presets_only() -> bool:
    """A deployer's switch (DYNATREE_PRESETS_ONLY=1): serve the preset model pairs and nothing
    else, so a public instance cannot be pointed at arbitrary paths or hub ids."""
    return env("DYNATREE_PRESETS_ONLY").lower() in ("1", "true", "yes", "on")


def check_spec_allowed(spec: str) -> None:
    """Raise DynaTreeError when the allow-list is on and `spec` is no preset's target or draft."""
    if not presets_only():
        return
    allowed = {p.target for p in PRESETS.values()} | {p.draft for p in PRESETS.values() if p.draft}
    if spec not in allowed:
        raise DynaTreeError(
            f"this instance serves only its preset models (DYNATREE_PRESETS_ONLY is set); {spec!r} is not one "
            f"of them: pick a preset ({', '.join(PRESETS)})"
        )
