"""Character-level text corpora for the Table 3 experiment, offline and deterministic.

The default corpus is English prose from the docstrings of the installed Python standard
library: every ``*.py`` file under the stdlib directory, in sorted path order (test suites,
IDLE, site-packages and ``__pycache__`` left out), parsed with :mod:`ast`; the module, class
and function docstrings whose lines are mostly prose (doctest prompts, indented code and
very short lines dropped) are joined with blank lines and cut at a fixed number of
characters. It needs no download and is the same on every run of a given Python installation
(a different Python version gives a slightly different text).

Any text file can be used instead (:func:`load_text`). A :class:`Corpus` holds the encoded
text, its character vocabulary and a contiguous 90/10 train/validation split;
:func:`sample_windows` draws the ``(inputs, targets)`` batches of next-character prediction.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__"})
DEFAULT_CHARS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Corpus:
    """An encoded text: ``train`` and ``validation`` token ids over the ``vocab`` characters.

    Token ``i`` is the character ``vocab[i]``; ids are ``uint8`` for vocabularies of up to 256
    characters, else ``int32``.
    """

    vocab: str
    train: np.ndarray
    validation: np.ndarray
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (every character must be in the vocabulary).

        Example:
            >>> corpus = from_text("abcabc", validation_fraction=0.5, source="example")
            >>> corpus.encode("cab").tolist(), corpus.decode([0, 1])
            ([2, 0, 1], 'ab')
        """
        index = {c: i for i, c in enumerate(self.vocab)}
        missing = sorted(set(text) - index.keys())
        if missing:
            raise ValueError(f"characters not in the vocabulary: {missing[:10]!r}")
        return np.array([index[c] for c in text], dtype=_id_dtype(len(self.vocab)))

    def decode(self, ids) -> str:
        """The text of token ids ``ids``."""
        return "".join(self.vocab[int(i)] for i in ids)


def _id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.int32)


def from_text(text: str, validation_fraction: float = 0.1, *, source: str = "text") -> Corpus:
    """Encode ``text`` and split it: the first ``1 - validation_fraction`` for training, the
    rest for validation (contiguous, so no window straddles the two).

    Example:
        >>> corpus = from_text("hello world" * 10, source="example")
        >>> corpus.vocab, len(corpus.train), len(corpus.validation)
        (' dehlorw', 99, 11)
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    if len(text) < 2:
        raise ValueError("the text needs at least two characters")
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((index[c] for c in text), dtype=_id_dtype(len(vocab)), count=len(text))
    cut = round(len(ids) * (1 - validation_fraction))
    return Corpus(vocab=vocab, train=ids[:cut], validation=ids[cut:], source=source)


def load_text(path: str | pathlib.Path, validation_fraction: float = 0.1) -> Corpus:
    """A :class:`Corpus` of the UTF-8 text file ``path`` (line endings normalised to ``\\n``).

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.txt"
        >>> _ = path.write_text("to be or not to be\\r\\n" * 5)
        >>> load_text(path).vocab  # CRLF line endings are read as "\\n"
        '\\n benort'
    """
    text = pathlib.Path(path).read_text(encoding="utf-8")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return from_text(text, validation_fraction, source=str(path))


def stdlib_dir() -> pathlib.Path:
    """The directory of the running Python's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def python_files(root: pathlib.Path) -> Iterator[pathlib.Path]:
    """``*.py`` files under ``root`` in sorted order, skipping :data:`SKIPPED_DIRS`."""
    for path in sorted(root.rglob("*.py")):
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            yield path


def docstrings(source: str) -> Iterator[str]:
    """The module, class and function docstrings of Python ``source``, in source order.

    Unparsable sources yield nothing.

    Example:
        >>> src = "class A:\\n    'Doc of A.'\\n    def f(self):\\n        'Doc of f.'\\n"
        >>> list(docstrings(src))
        ['Doc of A.', 'Doc of f.']
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, kinds)), key=lambda n: getattr(n, "lineno", 0)
    )
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc


def is_prose_line(line: str) -> bool:
    """True for a line of running English text: not code, not a doctest, not a heading rule.

    Example:
        >>> is_prose_line("Return the number of items in the queue."), is_prose_line(">>> f(1)")
        (True, False)
    """
    stripped = line.strip()
    if len(stripped) < 20 or not stripped.isascii() or line.startswith(("    ", "\t")):
        return False
    if stripped.startswith((">>>", "...", "$ ", "#", "|", "+-", "==", "--")):
        return False
    letters = sum(c.isalpha() or c == " " for c in stripped)
    return letters >= 0.8 * len(stripped)


def prose(doc: str) -> str:
    """The prose lines of a docstring, as one paragraph per run of consecutive prose lines."""
    paragraphs, current = [], []
    for line in doc.splitlines():
        if is_prose_line(line):
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n".join(paragraphs)


def docstring_text(root: pathlib.Path, max_chars: int) -> str:
    """The prose of the docstrings of the Python files under ``root``, joined by blank lines
    and cut at ``max_chars`` characters (fewer if the files hold less)."""
    parts, total = [], 0
    for path in python_files(root):
        source = path.read_text(encoding="utf-8", errors="replace")
        for doc in docstrings(source):
            text = prose(doc)
            if text:
                parts.append(text)
                total += len(text) + 2
                if total >= max_chars:
                    return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)


def load_stdlib_docstrings(
    max_chars: int = DEFAULT_CHARS,
    validation_fraction: float = 0.1,
    root: pathlib.Path | None = None,
) -> Corpus:
    """The default corpus: prose from the standard library's docstrings (see module doc).

    ``root`` replaces the standard library directory (for tests). Raises ``ValueError`` if the
    files hold fewer than ``max_chars // 10`` characters of prose.
    """
    root = stdlib_dir() if root is None else pathlib.Path(root)
    text = docstring_text(root, max_chars)
    if len(text) < max_chars // 10:
        raise ValueError(f"only {len(text)} characters of docstring prose under {root}")
    return from_text(text, validation_fraction, source=f"docstrings of {root}")


def sample_windows(
    ids: np.ndarray, context: int, batch_size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of next-character windows: ``inputs[b] = ids[o : o + context]`` and
    ``targets[b] = ids[o + 1 : o + context + 1]`` at random offsets ``o``, as ``int32``.

    Example:
        >>> x, y = sample_windows(np.arange(10), 3, 2, np.random.default_rng(0))
        >>> x.shape, bool(np.all(y == x + 1))
        ((2, 3), True)
    """
    if len(ids) < context + 1:
        raise ValueError(f"{len(ids)} tokens cannot hold a window of {context} + 1")
    offsets = rng.integers(0, len(ids) - context, size=batch_size)
    window = offsets[:, None] + np.arange(context + 1)
    tokens = np.asarray(ids, np.int32)[window]
    return tokens[:, :-1], tokens[:, 1:]


def fixed_windows(
    ids: np.ndarray, context: int, batch_size: int, num_batches: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``num_batches`` batches from :func:`sample_windows` with their own fixed ``seed`` (the
    validation set every configuration is evaluated on)."""
    rng = np.random.default_rng(seed)
    return [sample_windows(ids, context, batch_size, rng) for _ in range(num_batches)]
