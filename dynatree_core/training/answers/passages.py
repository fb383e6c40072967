"""Passages of offline text for the prompt pack (pack.py), one reader per source.

A `Passage` is a piece of text and what kind of text it is, which decides the instructions the
pack may wrap it in: prose, code (Python), a package's one-line description, a prompt that is
already complete (the project's templates), or prose in another language (to translate). The
readers of the answer pool's sources (sources.py) are reused; the others read what a Debian
machine with this project's virtual environment holds offline: the installed Python packages'
docstrings and code (read with `ast`, never imported), GNU info manuals, Vim's help, Perl's POD,
the READMEs under /usr/share/doc and the manual pages translated into other languages.

Every reader returns an empty list when its files are missing, and visits files in sorted order,
so what it returns depends only on the machine's files. `max_files` caps the files a reader opens
(small packs for tests); it does not apply to the pool's own readers, which are fast.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import inspect
import re
import sysconfig
import textwrap
import unicodedata
from collections.abc import Callable
from itertools import islice
from pathlib import Path

from dynatree_core.training.answers import sources
from dynatree_core.training.prompts import sample_prompts

INFO_DIR = Path("/usr/share/info")
VIM_DOCS = Path("/usr/share/vim")
PERL_DIRS = (Path("/usr/share/perl"), Path("/usr/share/perl5"))
DOC_DIR = Path("/usr/share/doc")
MAN_LANGUAGES = {
    **{"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese"},
    **{"pt_BR": "Portuguese", "nl": "Dutch", "pl": "Polish", "sv": "Swedish", "da": "Danish"},
    **{"cs": "Czech", "fi": "Finnish", "hu": "Hungarian", "ro": "Romanian", "ru": "Russian"},
    **{"uk": "Ukrainian", "tr": "Turkish", "ja": "Japanese", "ko": "Korean", "zh_CN": "Chinese"},
}
MAX_FILE_BYTES = 400_000  # larger .py files are generated tables, not code worth explaining


@dataclasses.dataclass(frozen=True)
class Passage:
    """`kind`: prose | code | package | prompt | foreign. `name`: a package's name; `language`:
    a foreign passage's language; `chat`: whether a complete prompt is a chat turn."""

    text: str
    kind: str = "prose"
    name: str = ""
    language: str = ""
    chat: bool = True


def paragraph_runs(text: str, min_chars: int = 300) -> list[str]:
    """Runs of paragraphs of at least `min_chars`, each cut at sources.MAX_CHARS."""
    out, run = [], []
    for p in (p.strip() for p in re.split(r"\n\s*\n", text)):
        if not p or set(p) <= set("=-*~_#. \t\n"):
            continue
        run.append(p)
        if sum(map(len, run)) >= min_chars:
            out.append(sources._cut("\n\n".join(run)))
            run = []
    return out


def _files(paths, max_files: int | None) -> list[Path]:
    return list(islice(sorted(paths), max_files))


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8", errors="replace")
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""


def _unique(items: list) -> list:
    return list(dict.fromkeys(items))


# ----- the installed Python packages ------------------------------------------------------------


def _python_pieces(source: str) -> tuple[list[str], list[str]]:
    """(docstrings of 200+ characters, functions and methods of 5-40 lines) of one module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return [], []
    lines, docs, code = source.splitlines(), [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc) >= 200:
            docs.append(sources._cut(inspect.cleandoc(doc)))
        if not isinstance(node, ast.Module) and 5 <= node.end_lineno - node.lineno < 40:
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            code.append(sources._cut(textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))))
    return docs, code


def package_texts(root: Path | None = None, max_files: int | None = None) -> tuple[list[str], list[str]]:
    """(docstrings, code) of the Python packages installed beside this interpreter, tests left out."""
    root = root or Path(sysconfig.get_paths()["purelib"])
    paths = (p for p in root.rglob("*.py") if not any("test" in part for part in p.relative_to(root).parts))
    docs, code = [], []
    for path in _files(paths, max_files):
        if path.stat().st_size <= MAX_FILE_BYTES:
            d, c = _python_pieces(_read(path))
            docs += d
            code += c
    return _unique(docs), _unique(code)


# ----- manuals and documentation ------------------------------------------------------------------


def info_passages(root: Path = INFO_DIR, max_files: int | None = None) -> list[str]:
    """Paragraph runs of the GNU info manuals, node headers and menus left out."""
    out = []
    for path in _files(root.glob("*.info*.gz"), max_files):
        for node in _read(path).split("\x1f"):
            body = node.split("\n", 2)[-1] if node.lstrip().startswith("File:") else ""
            body = body.split("* Menu:")[0]
            out += paragraph_runs(body)
    return _unique(out)


def vim_help(root: Path = VIM_DOCS, max_files: int | None = None) -> list[str]:
    """Paragraph runs of Vim's help files."""
    out = []
    for path in _files(root.glob("vim*/doc/*.txt"), max_files):
        out += paragraph_runs(_read(path))
    return _unique(out)


_POD_CODE = re.compile(r"[BCIFLSEX]<+\s*([^<>]*?)\s*>+")


def perl_pod(roots: tuple[Path, ...] = PERL_DIRS, max_files: int | None = None) -> list[str]:
    """Paragraph runs of the POD documentation in Perl's modules, formatting codes stripped."""
    out = []
    paths = [p for root in roots for p in root.rglob("*") if p.suffix in (".pm", ".pod")]
    for path in _files(paths, max_files):
        text = _read(path)
        pods = re.findall(r"^=(?:head\d|pod|item|over|begin)\b.*?(?=^=cut\b|\Z)", text, re.M | re.S)
        paragraphs = "\n\n".join(p for pod in pods for p in pod.split("\n\n") if not p.startswith("="))
        out += paragraph_runs(_POD_CODE.sub(r"\1", paragraphs))
    return _unique(out)


def readmes(root: Path = DOC_DIR, max_files: int | None = None) -> list[str]:
    """Paragraph runs of the packages' README files under /usr/share/doc."""
    out = []
    for path in _files(root.glob("*/README*"), max_files):
        if path.is_file() and path.suffix in ("", ".gz", ".md", ".txt", ".Debian", ".rst"):
            out += paragraph_runs(_read(path))
    return _unique(out)


_ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", ",": "\u0327"}
_GLYPHS = {"oa": "å", "oA": "Å", "ss": "ß", "Fo": "«", "Fc": "»", "lq": "“", "rq": "”", "oq": "‘", "cq": "’", "aq": "'"}


def roff_glyphs(roff: str) -> str:
    """Accented letters and quotes written as groff escapes (f\\(:ur, \\[u00E9]) as characters."""

    def glyph(m: re.Match) -> str:
        name = m.group(1)
        if name[0] in _ACCENTS and name[1].isalpha():
            return unicodedata.normalize("NFC", name[1] + _ACCENTS[name[0]])
        return _GLYPHS.get(name, m.group(0))

    roff = re.sub(r"\\\[u([0-9A-Fa-f]{4})\]", lambda m: chr(int(m.group(1), 16)), roff)
    return re.sub(r"\\\((..)", glyph, roff)


def translated_man_pages(root: Path = sources.MAN_DIR, max_files: int | None = None) -> list[Passage]:
    """The first section of 200+ characters after NAME (past the synopsis) of the manual pages
    translated into other languages."""
    out = []
    for code, language in MAN_LANGUAGES.items():
        for path in _files((root / code).glob("man[1-8]/*.gz"), max_files):
            sections = re.split(r"^\.SH\b.*$", roff_glyphs(_read(path)), flags=re.M)[2:]
            body = next((b for b in map(sources.roff_text, sections) if len(b) >= 200), "")
            if body:
                out.append(Passage(sources._cut(body), "foreign", language=language))
    return _unique(out)


# ----- every source, as passages ------------------------------------------------------------------


def _pool_readers() -> dict[str, Callable[[], list[Passage]]]:
    """The answer pool's sources (sources.py), as passages."""
    return {
        "templates": lambda: [Passage(t, "prompt", chat=c) for t, c in _unique(sample_prompts(30_000, seed=17))],
        "debian": lambda: [Passage(d, "package", name=n) for n, d in sources.debian_packages()],
        "pydoc": lambda: [Passage(t) for t in sources.doc_passages()],
        "stdlib": lambda: [Passage(t, "code") for t in sources.stdlib_snippets()],
        "manpages": lambda: [Passage(t, name=n) for n, t in sources.man_descriptions()],
        "fortunes": lambda: [Passage(t) for t in sources.fortunes()],
    }


def read_passages(max_files: int | None = None, log=print) -> dict[str, list[Passage]]:
    """Every source's passages, each text once (sources.SOURCES order; a source with none is in
    it, empty)."""
    out = {name: read() for name, read in _pool_readers().items()}
    log(f"passages: the answer pool's sources: {', '.join(f'{k} {len(v)}' for k, v in out.items())}")
    docs, code = package_texts(max_files=max_files)
    out["package-docs"] = [Passage(t) for t in docs]
    out["package-code"] = [Passage(t, "code") for t in code]
    log(f"passages: installed Python packages: {len(docs)} docstrings, {len(code)} functions")
    for name, read in (("info", info_passages), ("vim-help", vim_help), ("perl-docs", perl_pod), ("readmes", readmes)):
        out[name] = [Passage(t) for t in read(max_files=max_files)]
        log(f"passages: {name}: {len(out[name])}")
    out["man-translated"] = translated_man_pages(max_files=max_files)
    log(f"passages: man-translated: {len(out['man-translated'])}")
    return {name: _unique_texts(out[name]) for name in sources.SOURCES if name in out}


def _unique_texts(passages: list[Passage]) -> list[Passage]:
    """The first passage of each text (manual pages of one family share their description)."""
    first: dict[str, Passage] = {}
    for p in passages:
        first.setdefault(p.text, p)
    return list(first.values())
