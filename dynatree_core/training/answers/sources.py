"""`make draft-feature`'s `answers` stage: the prompts, from text available offline (no download).

Each source turns local text into jobs: a prompt (chat instruction or plain text to continue),
the temperature to answer it with (greedy or sampled) and a token limit. Kinds of source:

    templates      the project's topic x template generator (prompts.py)
    debian         Debian package names and one-line descriptions (`apt-cache dumpavail`)
    pydoc          passages of the Python documentation (Debian's python3.11-doc)
    stdlib         functions and classes of the Python standard library's own source (code)
    manpages       DESCRIPTION sections of the installed manual pages
    fortunes       quotations and jokes (Debian's fortunes)
    self-instruct  user questions the target wrote itself from seed topics (answered in a later stage)
    multi-turn     (kept so stored source indices stay; its follow-up stage never ran and was removed)
    written-*      the texts themselves as assistant turns, teacher-forced (written.py)
    package-docs, package-code, info, vim-help, perl-docs, readmes, man-translated
                   further offline text that only the prompt pack reads (passages.py, pack.py)

`build_pool` is deterministic for a given machine's files and seed; the pool is saved next to the
data so a run that resumes elsewhere answers the same prompts. The out-of-distribution set
(assets/prompts/ood/) is written separately and checked for disjointness from every pool.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import random
import re
import subprocess
import sysconfig
from pathlib import Path

from dynatree_core.training.prompts import DATA, TOPICS, sample_prompts

SOURCES = (
    *("templates", "debian", "pydoc", "stdlib", "manpages", "fortunes", "self-instruct", "multi-turn"),
    *("written-pydoc", "written-stdlib", "written-manpages", "written-fortunes"),  # written.py: text, not answers
    *("package-docs", "package-code", "info", "vim-help", "perl-docs", "readmes", "man-translated"),  # pack.py
)
DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
MAN_DIR = Path("/usr/share/man")
MAX_CHARS = 1400  # passages are cut here (~350 tokens): long prompts cost attention on every step


@dataclasses.dataclass(frozen=True)
class Job:
    source: str
    text: str
    chat: bool
    temperature: float = 0.0
    max_new: int = 256
    history: tuple[tuple[str, str], ...] = ()
    follow_ups: int = 0  # user turns the target writes itself after answering, each answered (pack.py)

    def to_json(self) -> dict:
        """Omits `follow_ups` when 0, so job lists saved before the field existed read and hash the same."""
        item = dataclasses.asdict(self) | {"history": [list(t) for t in self.history]}
        if not self.follow_ups:
            del item["follow_ups"]
        return item

    @classmethod
    def from_json(cls, item: dict) -> Job:
        return cls(**(item | {"history": tuple(tuple(t) for t in item.get("history", ()))}))


def _pick_temperature(rng: random.Random) -> float:
    """Half greedy (what greedy decoding will meet), half sampled at 0.7 or 1.0 (sampled decoding)."""
    return 0.0 if rng.random() < 0.5 else rng.choice((0.7, 1.0))


def _cut(text: str, limit: int = MAX_CHARS) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text[:limit]
    return cut[: max(cut.rfind("\n"), cut.rfind(". ") + 1, limit // 2)].rstrip()


# ----- text extraction, one function per source ---------------------------------------------


def debian_packages() -> list[tuple[str, str]]:
    """(package, one-line description) for every package apt knows (empty without apt)."""
    try:
        dump = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    out, name = {}, None
    for line in dump.splitlines():
        if line.startswith("Package: "):
            name = line[9:].strip()
        elif line.startswith("Description: ") and name:
            out.setdefault(name, line[13:].strip())
    return sorted(out.items())


def doc_passages(root: Path = DOCS_DIR) -> list[str]:
    """Runs of paragraphs (300-1400 characters) of the Python documentation's sources."""
    out = []
    for path in sorted(root.rglob("*.rst.txt")):
        paragraphs = [p.strip() for p in path.read_text(errors="replace").split("\n\n")]
        paragraphs = [p for p in paragraphs if p and not p.startswith((".. ", "===", "---", "***"))]
        run: list[str] = []
        for p in paragraphs:
            run.append(p)
            if sum(map(len, run)) >= 300:
                out.append(_cut("\n\n".join(run)))
                run = []
    return out


def stdlib_snippets(root: Path | None = None) -> list[str]:
    """Top-level functions and classes (5-40 lines) of the standard library's Python source."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            source = path.read_text(errors="replace")
            tree = ast.parse(source)
        except (SyntaxError, ValueError, OSError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and 5 <= node.end_lineno - node.lineno < 40:
                out.append(_cut("\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


_ROFF_ESCAPE = re.compile(r"\\f[BIRPC]|\\f\(..|\\[(]..|\\[&,/]|\\s[-+]?\d")


def roff_text(section: str) -> str:
    """Plain text of a section of a manual page: requests dropped, font escapes stripped."""
    text = []
    for line in section.splitlines():
        if line.startswith((".", "'")):
            if line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ")):
                text.append(line.split(" ", 1)[1].replace('"', ""))
            elif line.startswith((".PP", ".P", ".LP", ".TP", ".IP")):
                text.append("\n")
            continue
        text.append(line)
    body = _ROFF_ESCAPE.sub("", " ".join(text)).replace("\\-", "-").replace("\\e", "\\")
    return re.sub(r"[ \t]+", " ", body).replace(" \n ", "\n").strip()


def man_descriptions(root: Path = MAN_DIR) -> list[tuple[str, str]]:
    """(page name, DESCRIPTION text) of the English manual pages, roff markup stripped."""
    out = []
    for path in sorted(root.glob("man[1-8]/*.gz")):
        try:
            roff = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        match = re.search(r"^\.SH\s+\"?DESCRIPTION\"?\s*$(.*?)(^\.SH|\Z)", roff, re.M | re.S)
        if not match:
            continue
        body = roff_text(match.group(1))
        if len(body) >= 200:
            out.append((path.name.split(".")[0], _cut(body)))
    return out


def fortunes(root: Path = FORTUNES_DIR) -> list[str]:
    out = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix or path.is_symlink() or not path.is_file():
            continue
        for item in path.read_text(errors="replace").split("\n%\n"):
            item = item.strip()
            if 40 <= len(item) <= 700:
                out.append(item)
    return out


# ----- jobs ---------------------------------------------------------------------------------

ASK = {k: DATA[f"{k}_ask"] for k in ("debian", "doc", "code", "man", "fortune")}  # assets/draft-data/prompts.json
QUESTION_ASK = DATA["question_ask"]


def _plain_head(text: str, rng: random.Random) -> str:
    """The first part of a passage, for plain continuation (the target writes the rest)."""
    cut = max(80, int(len(text) * rng.uniform(0.3, 0.6)))
    head = text[:cut]
    return head[: head.rfind(" ")] if " " in head[40:] else head


def seed_topics(packages: list[tuple[str, str]], man: list[tuple[str, str]]) -> list[str]:
    """Topics for self-instruct questions: the template topics, package descriptions, commands."""
    topics = list(TOPICS)
    topics += [desc for _, desc in packages if 12 <= len(desc) <= 80]
    topics += [f"the `{name}` command" for name, _ in man]
    return topics


def build_pool(seed: int = 0, *, sizes: dict[str, int] | None = None, log=print) -> tuple[list[Job], list[Job]]:
    """(question-writing jobs for self-instruct, the main pool), both shuffled with `seed`.

    `sizes` caps each source's job count (defaults below); a source whose text is missing on
    this machine contributes nothing, and the log says so."""
    want = {"templates": 2500, "debian": 5000, "pydoc": 4000, "stdlib": 3500, "manpages": 3000, "fortunes": 3000}
    want |= sizes or {}
    want.setdefault("self-instruct", 3000)
    rng = random.Random(seed)
    packages, man = debian_packages(), man_descriptions()
    texts = {
        "debian": packages,
        "pydoc": doc_passages(),
        "stdlib": stdlib_snippets(),
        "manpages": man,
        "fortunes": fortunes(),
    }
    pool: list[Job] = []
    for text, chat in sample_prompts(want["templates"], seed=seed + 17):
        pool.append(Job("templates", text, chat, _pick_temperature(rng)))
    for source, items in texts.items():
        chosen = rng.sample(items, min(want[source], len(items)))
        log(f"sources: {source}: {len(items)} texts, {len(chosen)} used")
        for item in chosen:
            temp = _pick_temperature(rng)
            if source == "debian":
                name, desc = item
                pool.append(Job(source, rng.choice(ASK["debian"]).format(name=name, desc=desc), True, temp))
            elif source == "manpages":
                name, body = item
                pool.append(Job(source, rng.choice(ASK["man"]).format(name=name, text=body), True, temp))
            elif rng.random() < 0.3:  # plain continuation of the text itself
                pool.append(Job(source, _plain_head(item, rng), False, temp, max_new=192))
            else:
                ask = ASK[{"pydoc": "doc", "stdlib": "code", "fortunes": "fortune"}[source]]
                pool.append(Job(source, rng.choice(ask).format(text=item), True, temp))
    topics = seed_topics(packages, man)
    questions = [
        Job("self-instruct", QUESTION_ASK.format(topic=t), True, 1.0, max_new=48)
        for t in rng.sample(topics, min(want["self-instruct"], len(topics)))
    ]
    rng.shuffle(pool)
    return questions, pool


def question_from_answer(text: str) -> str | None:
    """The question a self-instruct job wrote, or None when the answer is not one question."""
    text = text.strip().strip('"').strip()
    first = text.split("\n")[0].strip()
    if not (12 <= len(first) <= 300) or "?" not in first:
        return None
    return first[: first.rfind("?") + 1]


def answered_jobs(questions: list[str], seed: int) -> list[Job]:
    rng = random.Random(seed + 1)
    return [Job("self-instruct", q, True, _pick_temperature(rng)) for q in questions]


def save_jobs(path: Path, jobs: list[Job]) -> str:
    """Write jobs as gzipped JSON lines; returns their digest (recorded with each data shard)."""
    body = "\n".join(json.dumps(j.to_json(), ensure_ascii=False) for j in jobs).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(body, mtime=0))
    tmp.rename(path)
    return hashlib.sha256(body).hexdigest()[:16]


def load_jobs(path: Path) -> list[Job]:
    body = gzip.decompress(path.read_bytes()).decode()
    return [Job.from_json(json.loads(line)) for line in body.splitlines() if line]
