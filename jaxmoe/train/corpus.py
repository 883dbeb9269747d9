"""Training text: the Python standard library every interpreter ships with, or a folder / text file.

The standard-library corpus is three kinds of document: the English help topics of ``pydoc_data.topics``,
the docstrings of each module (module, classes, functions: English), and each module's Python source.
Tests, codec tables and the topics' own source are left out.  Documents are split into train and
held-out parts *by file*: a file is held out when the hash of its name (path relative to the corpus
root, or the topic name) falls in the held-out fraction, so the split does not depend on which other
files exist, and a module's docstrings always land in the same part as its source.

The corpus depends on the interpreter's version (3.11's standard library is not 3.12's); the training
command records which one it used.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import sysconfig
from pathlib import Path

STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_STDLIB_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "encodings",
    "pydoc_data",
    "__pycache__",
    "lib-dynload",
    "turtledemo",
}


class CorpusError(ValueError):
    """The corpus cannot be used (missing, or no text in it)."""


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # what decides its split: a file path relative to the corpus root, or "topic:NAME"
    text: str


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]

    def describe(self) -> str:
        def size(docs):
            return sum(len(d.text) for d in docs)

        return (
            f"{len(self.train)} train documents ({size(self.train) / 1e6:.1f} M chars), "
            f"{len(self.heldout)} held-out ({size(self.heldout) / 1e6:.2f} M chars)"
        )


def is_heldout(name: str, fraction: float) -> bool:
    """Deterministic, order-free split: the first 8 bytes of sha256(name) as a number in [0, 1)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def load_corpus(source: str | Path = STDLIB, heldout_fraction: float = 0.05) -> Corpus:
    """``source``: ``"stdlib"``, a folder (its text files, recursively) or one text file (split by
    paragraphs of blank lines into chunks of about 4k characters, named by their index)."""
    if not 0 < heldout_fraction < 1:
        raise CorpusError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    docs = documents(source)
    train = [d for d in docs if not is_heldout(d.name, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d.name, heldout_fraction)]
    if not train or not heldout:
        part = "training" if not train else "held-out"
        raise CorpusError(
            f"corpus {str(source)!r} has {len(docs)} document(s): none falls in the {part} "
            f"part (held-out fraction {heldout_fraction}); give more files"
        )
    return Corpus(train, heldout)


def documents(source: str | Path = STDLIB) -> list[Document]:
    """Every non-empty document of ``source`` (see ``load_corpus``), unsplit."""
    if str(source) == STDLIB:
        docs = stdlib_documents()
    else:
        path = Path(source)
        if path.is_dir():
            docs = folder_documents(path)
        elif path.is_file():
            docs = text_file_documents(path)
        else:
            raise CorpusError(f"corpus {str(source)!r} is neither 'stdlib', a folder nor a text file")
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise CorpusError(f"corpus {str(source)!r} holds no text (looked for {', '.join(TEXT_SUFFIXES)} files)")
    return docs


def stdlib_documents(root: Path | None = None) -> list[Document]:
    """Help topics, module docstrings and module sources of the running interpreter's standard library."""
    import pydoc_data.topics

    docs = [Document(f"topic:{name}", text) for name, text in sorted(pydoc_data.topics.topics.items())]
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if (
            _STDLIB_SKIP_DIRS.intersection(rel.parts[:-1])
            or rel.name.startswith("_sysconfigdata")
            or (rel.parts[0].startswith("config-"))
        ):
            continue
        source = _read_text(path)
        if source is None:
            continue
        name = rel.as_posix()
        docstrings = module_docstrings(source)
        if docstrings:
            docs.append(Document(name, docstrings))  # same name as the source: same split
        docs.append(Document(name, source))
    return docs


def module_docstrings(source: str) -> str:
    """The docstrings of a module, its classes and functions, each under a heading naming its owner."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]:
        doc = ast.get_docstring(node)
        if doc and len(doc) > 40:
            title = "" if isinstance(node, ast.Module) else f"{node.name}\n{'-' * len(node.name)}\n"
            parts.append(title + doc)
    return "\n\n".join(parts)


def folder_documents(folder: Path) -> list[Document]:
    docs = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            text = _read_text(path)
            if text is not None:
                docs.append(Document(path.relative_to(folder).as_posix(), text))
    return docs


def text_file_documents(path: Path, chunk_chars: int = 4096) -> list[Document]:
    text = _read_text(path)
    if text is None:
        raise CorpusError(f"{path} is not UTF-8 text")
    chunks, current = [], ""
    for paragraph in text.split("\n\n"):
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= chunk_chars:
            chunks.append(current)
            current = ""
    if current:
        chunks.append(current)
    return [Document(f"{path.name}#{i}", chunk) for i, chunk in enumerate(chunks)]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
