"""Prompt sets: bundled files, user files, and the DynaTree papers' corpora.

A prompt set is a list of `Prompt(text, chat)`. Specs `load_prompts` understands:
  all | chat | code | ...       the bundled sets (assets/prompts/*.jsonl); "all" is every domain
  ood | ood:CATEGORY            the out-of-distribution evaluation set (assets/prompts/ood/): prompts
                                the draft never trained on, by Spec-Bench category; "ood" is all of them
  A,B                           several of the above, e.g. "all,ood" (reports show each side apart)
  path.jsonl                    objects with "prompt" and optional "chat"
  path.txt                      one prompt per non-empty line (chat off)
  wikitext2 | pg19              the corpora of the DynaTree papers, through `datasets` (online)
  wikitext2:FILE  pg19:FILE|DIR the same corpora from local copies, with the same preprocessing:
                                WikiText-2's raw test file (wiki.test.raw) cut into articles at
                                its " = Title = " headings; PG-19 books as .txt files, one each
A corpus gives one document per prompt, in order (the first N with `limit`); the benchmark then
cuts each to L_max tokens (bench.encode_prompts), as the papers' protocol does.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from dynatree_core.errors import DynaTreeError

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "prompts"
OOD_DIR = PROMPTS_DIR / "ood"
OOD_PREFIX = "ood/"  # the domain of an OOD prompt: "ood/<category>"


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool = False
    domain: str = ""
    history: tuple[tuple[str, str], ...] = ()  # earlier (user, assistant) turns of a chat prompt


def bundled_sets() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def ood_categories() -> list[str]:
    return sorted(p.stem for p in OOD_DIR.glob("*.jsonl"))


def _history(item: dict) -> tuple[tuple[str, str], ...]:
    turns = item.get("history")
    if not turns:
        return ()
    if not isinstance(turns, list) or not all(isinstance(t, list) and len(t) == 2 for t in turns):
        raise TypeError("history must be a list of [user, assistant] pairs")
    return tuple((str(u), str(a)) for u, a in turns)


def _read_jsonl(path: Path, domain: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append(Prompt(str(item["prompt"]), bool(item.get("chat", False)), domain, _history(item)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DynaTreeError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from exc
    return out


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Where a paper's corpus lives on the hub and how one row becomes text."""

    hub_id: str
    config: str | None
    split: str
    streaming: bool  # PG-19 is ~11 GB: stream only the books asked for


CORPORA = {
    "wikitext2": Corpus("Salesforce/wikitext", "wikitext-2-raw-v1", "test", streaming=False),
    "pg19": Corpus("emozilla/pg19", None, "test", streaming=True),
}
MIN_DOCUMENT_CHARS = 400  # WikiText-2 has stub articles; too short to fill L_max
MAX_DOCUMENT_CHARS = 40_000  # a PG-19 book is ~400k characters; L_max <= 2048 tokens needs far less
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """WikiText-2's raw lines (one paragraph per line, " = Title = " starting an article, " = = Section
    = = " inside one) grouped into articles, title line dropped, short stubs skipped."""
    article: list[str] = []

    def flush() -> Iterator[str]:
        text = "".join(article).strip()
        if len(text) >= MIN_DOCUMENT_CHARS:
            yield text

    for line in lines:
        if _WIKI_TITLE.match(line.rstrip("\n")):
            yield from flush()
            article = []
        else:
            article.append(line if line.endswith("\n") else line + "\n")
    yield from flush()


def _documents(name: str, texts: Iterable[str], limit: int | None) -> list[Prompt]:
    out = []
    for text in texts:
        text = text.strip()[:MAX_DOCUMENT_CHARS]
        if len(text) < MIN_DOCUMENT_CHARS:
            continue
        out.append(Prompt(text, False, name))
        if limit and len(out) >= limit:
            break
    return out


def _hub_corpus(name: str, limit: int | None) -> list[Prompt]:
    corpus = CORPORA[name]
    try:
        import datasets
    except ImportError as exc:
        raise DynaTreeError(
            f"the {name} prompt set needs the `datasets` package (pip install datasets) and network access; "
            f"offline, pass a local copy: --prompts {name}:PATH"
        ) from exc
    try:
        rows = datasets.load_dataset(corpus.hub_id, corpus.config, split=corpus.split, streaming=corpus.streaming)
        texts = (row["text"] for row in rows)
        if name == "wikitext2":
            texts = wikitext_articles(texts)
        return _documents(name, texts, limit)
    except Exception as exc:  # network, hub and format errors all end the same way for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DynaTreeError(
            f"cannot load {name} ({corpus.hub_id}) from the hub: {first}; offline, pass a local copy: "
            f"--prompts {name}:PATH"
        ) from exc


def _local_corpus(name: str, location: str, limit: int | None) -> list[Prompt]:
    path = Path(location).expanduser()
    if name == "pg19" and path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise DynaTreeError(f"{location}: no .txt books in this directory")
        return _documents(name, (f.read_text(encoding="utf-8", errors="replace") for f in files), limit)
    if not path.is_file():
        raise DynaTreeError(f"{name}: local copy {location!r} not found")
    with path.open(encoding="utf-8", errors="replace") as handle:
        if name == "wikitext2":
            return _documents(name, wikitext_articles(handle), limit)
        return _documents(name, [handle.read(MAX_DOCUMENT_CHARS)], limit)


def load_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """The prompts of `spec` (see the module docstring). `limit` only bounds what a corpus loader
    reads (the first N documents); bundled and user files are returned whole."""
    if "," in spec:  # several sets: "all,ood" (a report then shows each side apart)
        return [p for part in spec.split(",") if part.strip() for p in load_prompts(part.strip(), limit)]
    name, colon, location = spec.partition(":")
    if name == "ood":
        wanted = [location] if colon else ood_categories()
        unknown = [c for c in wanted if c not in ood_categories()]
        if unknown:
            raise DynaTreeError(f"unknown OOD category {unknown[0]!r}: use one of {', '.join(ood_categories())}")
        return [p for c in wanted for p in _read_jsonl(OOD_DIR / f"{c}.jsonl", f"{OOD_PREFIX}{c}")]
    if name in CORPORA:
        return _local_corpus(name, location, limit) if colon else _hub_corpus(name, limit)
    if spec == "all":
        return [p for name in bundled_sets() for p in load_prompts(name)]
    if spec in bundled_sets():
        return _read_jsonl(PROMPTS_DIR / f"{spec}.jsonl", spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        choices = ", ".join([*bundled_sets(), "ood", *CORPORA])
        raise DynaTreeError(f"unknown prompt set {spec!r}: use all, {choices}, a corpus:PATH or a file path")
    if path.suffix == ".jsonl":
        return _read_jsonl(path, path.stem)
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt(line, False, path.stem) for line in lines]


def choose_prompts(spec: str, n: int, skip: int = 0) -> list[Prompt]:
    """The first `n` prompts of `spec` taken round-robin over its domains (n <= 0: all of them),
    after the first `skip` of that order: the one rule by which the CLI's bench, the benchmark page
    and the dtype probe pick prompts (`skip` keeps a tuning split apart from a reported one)."""
    by_domain: dict[str, list[Prompt]] = {}
    for p in load_prompts(spec, limit=n if n > 0 else None):
        by_domain.setdefault(p.domain, []).append(p)
    spread = [p for group in itertools.zip_longest(*by_domain.values()) for p in group if p is not None]
    spread = spread[max(skip, 0) :]
    return spread[:n] if n > 0 else spread
