"""The prompt pack (`python -m dynatree_core.training prompt-pack`): the answer pool's prompts, ten
times over, in one file a GPU machine without the offline sources can read.

Every source passages.py can read on this machine gives passages; each passage is wrapped in
several instructions, one job each:

    explain    explain the passage (or the code, or what a package is for) to a beginner
    summarise  its gist in a few sentences (code: what it does, its inputs and outputs)
    question   ask something about it and answer it
    continue   the passage's opening as plain text (chat off): the target writes on
    translate  into French, Spanish, German or Italian (passages in other languages: into English)
    fix        Python code with one small deterministic bug put in (an operator swapped, a
               `return` dropped, a name misspelt): find the bug, explain it, fix it
    template   the project's topic x template prompts (prompts.py), as they are

Temperatures are half greedy and half sampled, as in the pool; token limits vary by instruction.
Sources share the prompts evenly, a source with fewer passages giving all it has.

`Job.follow_ups` marks about one chat job in ten with 1 or 2: after answering such a job, the
recipe has the target write the user's next turn itself (a follow-up question or request on the
conversation so far), then answers it, and does so `follow_ups` times. The pack stores only the
mark; the turns are written on the GPU.

The file is one gzip stream of JSON lines: a header (format, version, seed, per-source counts of
passages, prompts and characters, per-instruction counts, the OOD check, the SHA-256 of the job
lines), then one `Job.to_json()` per line, a passage's instructions on adjacent lines so the
compressor finds the repeated passage. The out-of-distribution set (assets/prompts/ood/) is kept
out: a job sharing any 8-word run with an OOD prompt or one of its turns (or containing a whole
OOD text of fewer words) is dropped, and the header says how many were; so is a job whose text
and chat flag repeat one kept before (passages that begin alike). The pack is deterministic
for a given machine's files and seed.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import keyword
import math
import random
import re
from collections import Counter
from pathlib import Path

from dynatree_core.measure.prompt_sets import load_prompts
from dynatree_core.training.answers import sources
from dynatree_core.training.answers.passages import Passage, read_passages
from dynatree_core.training.answers.sources import Job

FORMAT, VERSION = "dynatree-prompt-pack", 1
LANGUAGES = ("French", "Spanish", "German", "Italian")
KINDS = {
    "prose": ("explain", "summarise", "question", "continue", "translate"),
    "code": ("explain", "summarise", "question", "continue", "fix"),
    "package": ("explain", "question", "translate"),
    "foreign": ("translate", "explain", "summarise"),
    "prompt": ("template",),
}
INSTRUCTIONS = ("template", "explain", "summarise", "question", "continue", "translate", "fix")
MIN_PER_PASSAGE = 3  # instructions per passage before a source may give more passages
FOLLOW_UP_SHARE = 0.12  # of chat jobs: about one job in ten of the pack
MAX_NEW = {"explain": (256, 384), "summarise": (128, 192), "question": (192, 256), "continue": (192,)}
MAX_NEW |= {"translate": (256, 384), "fix": (256, 384), "template": (256,)}
CODE = "```python\n{text}\n```"
ASK = {
    ("explain", "prose"): (
        "Explain this passage to someone new to the subject, in plain words.\n\n{text}",
        "{text}\n\nWhat does the text above mean? Explain it with a small example.",
        "I am reading some documentation and do not follow it. Can you explain what it says?\n\n{text}",
    ),
    ("explain", "code"): (
        "Explain what this code does, line by line where it matters.\n\n" + CODE,
        CODE + "\n\nWalk me through this function: what happens when it runs?",
        "I found this in a library I use. What is it for and how does it work?\n\n" + CODE,
    ),
    ("explain", "package"): sources.ASK["debian"],
    ("explain", "foreign"): (
        "This text is in {language}. Tell me in English what it explains and who it is for.\n\n{text}",
    ),
    ("summarise", "prose"): (
        "Give me the gist of this passage in three sentences or fewer.\n\n{text}",
        "{text}\n\nSum up the text above as a short bulleted list of its main points.",
        "Write a one-paragraph summary of the following documentation.\n\n{text}",
    ),
    ("summarise", "code"): (
        "Describe the inputs, the outputs and the side effects of this code, briefly.\n\n" + CODE,
        CODE + "\n\nWrite a short docstring that sums up what this code does.",
    ),
    ("summarise", "foreign"): ("Sum up this {language} text in two or three English sentences.\n\n{text}",),
    ("question", "prose"): (
        "Read this, then ask one good question about it and answer that question.\n\n{text}",
        "{text}\n\nWhat would a careful reader still wonder about after reading this? Answer it as well.",
        "Write a quiz question with its answer, based only on this text.\n\n{text}",
    ),
    ("question", "code"): (
        CODE + "\n\nWhat happens if this code gets an empty or unusual input? Explain.",
        "Ask one question a reviewer might raise about this code, then answer it.\n\n" + CODE,
    ),
    ("question", "package"): (
        "What problem does {name} solve ({text}), and what would I use instead if it did not exist?",
        "Is {name} ({text}) something a home user needs, or mainly for specialists? Why?",
    ),
    ("translate", "prose"): (
        "Translate the following text into {language}.\n\n{text}",
        "Please put this into {language}, keeping technical terms and names as they are:\n\n{text}",
    ),
    ("translate", "package"): ("How would you say this package description in {language}? {name}: {text}",),
    ("translate", "foreign"): (
        "Translate this {language} text into English.\n\n{text}",
        "What does this say? Give an English translation.\n\n{text}",
    ),
    ("fix", "code"): (
        "This Python code has a bug. Find it, explain it and show the corrected code.\n\n" + CODE,
        CODE + "\n\nSomething in this code is wrong. What is the mistake, and how do I fix it?",
        "My tests fail with this function. Spot the error and give me a fixed version.\n\n" + CODE,
    ),
}


# ----- one job ------------------------------------------------------------------------------------

_SWAPS = (" == ", " != "), (" != ", " == "), (" < ", " <= "), (" > ", " >= "), (" <= ", " < "), (" >= ", " > ")
_SWAPS += (" + ", " - "), (" - ", " + "), (" and ", " or "), (" or ", " and "), (" is not ", " is ")
_NAME = re.compile(r"\b[a-z_][a-z0-9_]{3,}\b")


def break_code(code: str, rng: random.Random) -> str | None:
    """`code` with one small bug put in: an operator swapped, a `return` dropped or one use of a
    name misspelt (never on the first line, the signature); None when there is nowhere to put one."""
    lines = code.split("\n")
    body = [i for i in range(1, len(lines)) if not lines[i].lstrip().startswith(("#", '"', "'"))]
    edits = [(i, old, new) for i in body for old, new in _SWAPS if old in lines[i]]
    edits += [(i, "return ", "") for i in body if lines[i].lstrip().startswith("return ")]
    uses = Counter(n for i in body for n in _NAME.findall(lines[i]) if not keyword.iskeyword(n))
    names = sorted(n for n, k in uses.items() if k >= 2 and n[-1] != n[-2])
    if names:
        name = rng.choice(names)
        edits += [(i, name, name[:-2] + name[-1] + name[-2]) for i in body if re.search(rf"\b{name}\b", lines[i])][1:]
    if not edits:
        return None
    i, old, new = rng.choice(edits)
    lines[i] = re.sub(rf"\b{old}\b", new, lines[i], count=1) if old in names else lines[i].replace(old, new, 1)
    return "\n".join(lines)


def make_job(source: str, passage: Passage, kind: str, rng: random.Random) -> Job | None:
    """One instruction wrapped around one passage (None: a `fix` with nowhere to put a bug)."""
    temperature, max_new = sources._pick_temperature(rng), rng.choice(MAX_NEW[kind])
    if kind == "template":
        return Job(source, passage.text, passage.chat, temperature, max_new)
    if kind == "continue":
        return Job(source, sources._plain_head(passage.text, rng), False, temperature, max_new)
    text = passage.text
    if kind == "fix":
        text = break_code(text, rng)
        if text is None:
            return None
    if kind == "translate" and passage.kind == "prose":
        text = sources._cut(text, sources.MAX_CHARS // 2)  # the answer is as long as the passage
    language = passage.language or rng.choice(LANGUAGES)
    ask = rng.choice(ASK[kind, passage.kind])
    prompt = ask.format(text=text, desc=text, name=passage.name, language=language)
    return Job(source, prompt, True, temperature, max_new)


# ----- the OOD set --------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")
SHINGLE = 8


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return set(zip(*(words[i:] for i in range(n)), strict=False))


class OodCheck:
    """Whether a text shares any SHINGLE-word run with the OOD prompt set (prompts and earlier
    turns), or holds a whole OOD text shorter than that."""

    def __init__(self):
        texts = [t for p in load_prompts("ood") for t in (p.text, *(s for turn in p.history for s in turn))]
        words = [_WORD.findall(t.lower()) for t in texts]
        self.shingles = set().union(*(_ngrams(w, SHINGLE) for w in words))
        self.short = {tuple(w) for w in words if 0 < len(w) < SHINGLE}
        self.texts = len(texts)

    def shares(self, text: str) -> bool:
        words = _WORD.findall(text.lower())
        if not self.shingles.isdisjoint(_ngrams(words, SHINGLE)):
            return True
        return any(not self.short.isdisjoint(_ngrams(words, n)) for n in {len(s) for s in self.short})


# ----- the pack -----------------------------------------------------------------------------------


def share_out(capacity: dict[str, int], total: int) -> dict[str, int]:
    """Prompts per source: an even share of `total`, a source that cannot fill its share giving all
    it has and the rest going to the others (water-filling)."""
    out, left = {}, {s: c for s, c in capacity.items() if c > 0}
    while left:
        share = (total - sum(out.values())) // len(left)
        small = {s: c for s, c in left.items() if c <= share}
        if not small:
            extra = total - sum(out.values()) - share * len(left)
            out |= {s: share + (k < extra) for k, s in enumerate(left)}
            break
        out |= small
        left = {s: c for s, c in left.items() if s not in small}
    return out


def _source_groups(source: str, passages: list[Passage], quota: int, rng: random.Random) -> list[list]:
    """The source's (instruction, job) pairs, one group (adjacent lines in the file) per passage used."""
    kinds = KINDS[passages[0].kind]
    per = min(len(kinds), max(MIN_PER_PASSAGE, math.ceil(quota / len(passages))))
    chosen = rng.sample(passages, min(len(passages), math.ceil(quota / per)))
    groups = []
    for passage in chosen:
        pairs = [(kind, make_job(source, passage, kind, rng)) for kind in rng.sample(kinds, per)]
        groups.append([(kind, job) for kind, job in pairs if job is not None])
    return groups


def _mark_follow_ups(jobs: list[Job], rng: random.Random) -> list[Job]:
    """Chat jobs marked with FOLLOW_UP_SHARE odds: 1 follow-up, or 2 in a quarter of them."""
    out = []
    for job in jobs:
        if job.chat and rng.random() < FOLLOW_UP_SHARE:
            job = dataclasses.replace(job, follow_ups=2 if rng.random() < 0.25 else 1)
        out.append(job)
    return out


def _job_lines(jobs: list[Job]) -> list[str]:
    return [json.dumps(j.to_json(), ensure_ascii=False) for j in jobs]


def build_pack(
    seed: int = 0, *, target_prompts: int = 260_000, max_files: int | None = None, log=print
) -> tuple[dict, list[Job]]:
    """(header, jobs) of a pack of about `target_prompts` prompts from every source this machine has.

    `max_files`: each file-reading source opens at most this many files (small packs for tests).
    A source with no text here gives nothing; the log and the header's "skipped" say so."""
    texts = read_passages(max_files=max_files, log=log)
    capacity = {s: len(p) * len(KINDS[p[0].kind]) if p else 0 for s, p in texts.items()}
    quotas = share_out(capacity, target_prompts)
    ood, rng, seen = OodCheck(), random.Random(seed), set()
    groups, stats, dropped = [], {}, Counter()
    for source, passages in texts.items():
        if not passages:
            log(f"prompt-pack: {source}: skipped, no text on this machine")
            stats[source] = {"passages": 0, "prompts": 0, "chars": 0, "skipped": "no text on this machine"}
            continue
        made = _source_groups(source, passages, quotas[source], rng)
        kept = [g for g in ([(k, j) for k, j in g if _keep(j, ood, seen, dropped)] for g in made) if g]
        pairs = [pair for g in kept for pair in g]
        stats[source] = {
            "passages": len(kept),
            "prompts": len(pairs),
            "chars": sum(len(j.text) for _, j in pairs),
            "kinds": dict(sorted(Counter(k for k, _ in pairs).items())),
        }
        log(f"prompt-pack: {source}: {len(passages)} passages here, {len(kept)} used, {len(pairs)} prompts")
        groups += kept
    rng.shuffle(groups)
    jobs = _mark_follow_ups([j for g in groups for _, j in g], rng)
    return _header(seed, target_prompts, stats, jobs, ood, dropped), jobs


def _keep(job: Job, ood: OodCheck, seen: set, dropped: Counter) -> bool:
    """False for a job sharing text with the OOD set, or the same as one kept before (counted)."""
    why = "ood" if ood.shares(job.text) else "duplicate" if (job.text, job.chat) in seen else ""
    if why:
        dropped[why] += 1
    seen.add((job.text, job.chat))
    return not why


def _header(seed: int, target: int, stats: dict, jobs: list[Job], ood: OodCheck, dropped: Counter) -> dict:
    follow = Counter(j.follow_ups for j in jobs if j.follow_ups)
    return {
        "format": FORMAT,
        "version": VERSION,
        "seed": seed,
        "target_prompts": target,
        "prompts": len(jobs),
        "sources": stats,
        "instructions": dict(sum((Counter(s.get("kinds", {})) for s in stats.values()), Counter()).most_common()),
        "follow_ups": {str(k): follow[k] for k in sorted(follow)},
        "ood_checked": True,
        "ood_texts": ood.texts,
        "ood_dropped": dropped["ood"],
        "duplicates_dropped": dropped["duplicate"],
        "sha256_of_jobs": hashlib.sha256("\n".join(_job_lines(jobs)).encode()).hexdigest(),
    }


def write_pack(path: Path, header: dict, jobs: list[Job]) -> int:
    """Write the pack (a temporary file beside it, then renamed); returns its size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(json.dumps(header, ensure_ascii=False).encode() + b"\n")
        f.write("\n".join(_job_lines(jobs)).encode())
    tmp.rename(path)
    return path.stat().st_size


def read_pack(path: Path) -> tuple[dict, list[Job]]:
    """(header, jobs) of a pack file, its format and job digest checked."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            header = json.loads(f.readline())
            body = f.read()
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a {FORMAT} file ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} version {VERSION} file")
    if hashlib.sha256(body.encode()).hexdigest() != header["sha256_of_jobs"]:
        raise ValueError(f"{path}: the jobs do not match the header's digest")
    return header, [Job.from_json(json.loads(line)) for line in body.split("\n") if line]


def take(header: dict, jobs: list[Job], n: int) -> tuple[dict, list[Job]]:
    """The first `n` jobs as a pack of their own (a smoke test's): its count and digest are theirs,
    its per-source counts still the whole pack's, which `taken_from` names by digest."""
    jobs = jobs[:n]
    digest = hashlib.sha256("\n".join(_job_lines(jobs)).encode()).hexdigest()
    return header | {"prompts": len(jobs), "taken_from": header["sha256_of_jobs"], "sha256_of_jobs": digest}, jobs


def source_table(header: dict) -> list[dict]:
    """One row per source (source, passages, prompts, instructions, chars) for a model card."""
    rows = []
    for source, s in header["sources"].items():
        kinds = ", ".join(f"{k} {n:,}" for k, n in s.get("kinds", {}).items()) or s.get("skipped", "")
        rows.append({"source": source, "passages": s["passages"], "prompts": s["prompts"],
                     "instructions": kinds, "chars": s["chars"]})  # fmt: skip
    return rows


def table_markdown(rows: list[dict]) -> str:
    lines = ["| source | passages | prompts | instructions | characters |", "|---|---:|---:|---|---:|"]
    lines += [f"| {r['source']} | {r['passages']:,} | {r['prompts']:,} | {r['instructions']} | {r['chars']:,} |"
              for r in rows]  # fmt: skip
    total = {k: sum(r[k] for r in rows) for k in ("passages", "prompts", "chars")}
    return "\n".join([*lines, f"| all | {total['passages']:,} | {total['prompts']:,} | | {total['chars']:,} |"])
