"""One registry for the run settings that a CLI flag and a page widget share.

Each `Setting` says once what a setting is: its name (the `RunSpec` field, `--name-with-dashes`
on the CLI), type, range or choices, default, label and help. The CLI's flags (`add_flags`) and
the pages' widgets (`ui.widgets.setting_widget`) are generated from it, so a range or a default cannot
drift between the app, the compare page, the benchmark page and the commands. `RunSpec` is the
frozen value they produce (checked against the registry) and `RunSpec.decode_config` the
engine's `DecodeConfig` for it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from dynatree_core.core.devices import DTYPES
from dynatree_core.core.sampling_config import SamplingConfig
from dynatree_core.decoding.engine import DecodeConfig
from dynatree_core.errors import DynaTreeError
from dynatree_core.verify.registry import VERIFIERS


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: type
    default: Any
    label: str  # the widget's label
    help: str  # the widget's help and the flag's
    lo: float | None = None
    hi: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()
    widget: str = "slider"  # how a page shows it: slider, number, select, radio, or "models" (ui.widgets.model_picker)
    hi_binds: bool = True  # False: `hi` is the widget's top only, the CLI may ask for more
    offered: tuple[str, ...] = ()  # what a page's select offers when `choices` do not bind (the CLI takes more)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """The value, or a DynaTreeError naming the setting, its flag and the allowed values."""
        if value is None and self.default is None:  # optional: the library decides (no draft, every core)
            return value
        if self.choices and value not in self.choices:
            raise DynaTreeError(f"{self.name} ({self.flag}) must be one of {', '.join(self.choices)}, got {value!r}")
        too_high = self.hi_binds and self.hi is not None and value > self.hi
        if (self.lo is not None and value < self.lo) or too_high:
            bound = f"between {self.lo} and {self.hi}" if self.hi_binds else f"at least {self.lo}"
            raise DynaTreeError(f"{self.name} ({self.flag}) must be {bound}, got {value}")
        return value


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        # the models and where they run: the pages place them with ui.widgets.model_picker, the CLI's
        # model flags (cli/parser.py) add --preset and --no-pack
        Setting(
            "target", str, None, "Target", "target: embedded (default), hub id, local dir or .gguf", widget="models"
        ),
        Setting("draft", str, None, "Draft", "draft model (default: the preset's draft)", widget="models"),
        Setting(
            "device",
            str,
            "auto",
            "Device",
            "auto (CUDA when available, else CPU), cpu, cuda, cuda:N",
            widget="select",
            offered=("auto", "cpu", "cuda"),
        ),
        Setting(
            "dtype",
            str,
            "auto",
            "Dtype",
            "auto: a saved probe, else the rule",
            choices=("auto", *DTYPES),
            widget="select",
        ),
        Setting(
            "threads",
            int,
            None,
            "Threads",
            "torch CPU threads (default: $DYNATREE_THREADS, else every core)",
            1,
            widget="models",
        ),
        # the slider stops at 512; the CLI may ask for more (the model's context ends the run)
        Setting(
            "max_new_tokens",
            int,
            64,
            "Max new tokens",
            "Stop after this many generated tokens.",
            1,
            512,
            1,
            hi_binds=False,
        ),
        Setting(
            "temperature",
            float,
            0.0,
            "Temperature",
            "0: greedy. Above 0 the same adjustment applies to target and draft.",
            0.0,
            2.0,
            0.05,
        ),
        Setting("top_p", float, 1.0, "Top-p", "Nucleus sampling, target and draft alike (1: off).", 0.05, 1.0, 0.05),
        Setting("top_k", int, 0, "Top-k", "Top-k sampling, target and draft alike (0: off).", 0, 1000, widget="number"),
        Setting(
            "verifier",
            str,
            "auto",
            "Verifier",
            "auto: greedy at temperature 0; else specinfer when the policy can draw i.i.d. children, nss otherwise. "
            + " ".join(f"{v.name}: {v.summary}." for v in VERIFIERS.values()),
            choices=("auto", *VERIFIERS),
            widget="select",
        ),
        Setting(
            "order",
            str,
            "bfs",
            "Node order sent to the target",
            "Changes the mask layout, not the result.",
            choices=("bfs", "dfs"),
            widget="radio",
        ),
        Setting(
            "seed",
            int,
            0,
            "Seed",
            "Seeds sampling (greedy runs do not depend on it); sample or repetition i uses seed + i.",
            0,
            2**31 - 1,
            widget="number",
        ),
    )
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run's settings apart from the policy and the prompt: the models and where they run,
    sampling, verifier, order, length and seed. Every field is a `Setting`; a LiveRun keeps it."""

    target: str = SETTINGS["target"].default
    draft: str | None = SETTINGS["draft"].default
    device: str = SETTINGS["device"].default
    dtype: str = SETTINGS["dtype"].default
    threads: int | None = SETTINGS["threads"].default
    max_new_tokens: int = SETTINGS["max_new_tokens"].default
    temperature: float = SETTINGS["temperature"].default
    top_p: float = SETTINGS["top_p"].default
    top_k: int = SETTINGS["top_k"].default
    verifier: str = SETTINGS["verifier"].default
    order: str = SETTINGS["order"].default
    seed: int = SETTINGS["seed"].default

    def __post_init__(self):
        for field in dataclasses.fields(self):
            SETTINGS[field.name].check(getattr(self, field.name))

    @classmethod
    def of(cls, values: Mapping[str, Any] | argparse.Namespace) -> RunSpec:
        """The spec from any mapping (or parsed CLI arguments) holding some of its fields."""
        if isinstance(values, argparse.Namespace):
            values = vars(values)
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in values.items() if k in names and v is not None}
        try:  # CLI strings (--threads 2) become the setting's type
            picked = {k: SETTINGS[k].kind(v) if isinstance(v, str) else v for k, v in picked.items()}
        except ValueError as exc:
            raise DynaTreeError(f"a run setting is not a valid value: {exc}") from None
        return cls(**picked)

    def models(self) -> dict[str, str]:
        """The model pair and where it runs, as comparison reports record them."""
        return {"target": self.target or "", "draft": self.draft or "", "device": self.device, "dtype": self.dtype}

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    def decode_config(self, **engine: Any) -> DecodeConfig:
        """The engine's config: these settings plus what only the run knows (EOS ids, context
        length, forward-path switches, a per-repetition seed, analysis)."""
        fields = dict(
            max_new_tokens=self.max_new_tokens,
            order=self.order,
            sampling=self.sampling,
            verifier=self.verifier,
            seed=self.seed,
        )
        return DecodeConfig(**(fields | engine))


def add_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | list[str]) -> None:
    """One CLI flag per named setting, with the registry's type, default, choices and help."""
    for name in names:
        s = SETTINGS[name]
        parser.add_argument(s.flag, type=s.kind, default=s.default, choices=s.choices or None, help=s.help)
