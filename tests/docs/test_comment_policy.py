"""Comments keep the decision, the invariant and the command that re-checks it; figures, dates and the machine
they were measured on belong in benchmarks/results/ and in commit messages, where they cannot go stale unseen.
And no source points into a README section: topics live in docs/, which can move without breaking a pointer.

Scanned: the comments and docstrings of the Python, C, shell and config.pbtxt sources under backend/, kernels/,
client/, model_repository/ and scripts/. String literals that are data (a log line in a replayed document, an
error message about the running host) are not comments and are not scanned for dates or "this machine"; any
README citation is looked for in the whole text, since an error message that cites one is as stale as a comment.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("backend", "kernels", "client", "model_repository", "scripts")
SUFFIXES = {".py", ".c", ".h", ".sh", ".pbtxt"}

ISO_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
THIS_MACHINE = re.compile(r"\bthis (?:(?:amx|avx2|avx-512|zen ?\d|\d+-core|shared) )?(?:box|machine|xeon|vm)\b",
                          re.IGNORECASE)
# The top-level README cited: "README" not part of a path to another folder's README.md, e.g.
# client/ernie_client/openai/README.md and scripts/peers/README.md are documents of their own and may be named.
README_CITATION = re.compile(r"(?<![/\w])README(?!\w)(?!\.md\b)|(?<![/\w.])README\.md\b")

# path (relative to the repository root) -> why it may break a rule; keep it small and say why.
ALLOWED: dict[str, str] = {}


def _sources() -> list[Path]:
    files = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                files.append(path)
    return files


def _python_comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every # comment and every module / class / function docstring."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for offset, line in enumerate(first.value.value.splitlines()):
                    found.append((first.lineno + offset, line))
    return found


def _c_comments(text: str) -> list[tuple[int, str]]:
    found = []
    for match in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.DOTALL):
        start = text.count("\n", 0, match.start()) + 1
        for offset, line in enumerate(match.group(0).splitlines()):
            found.append((start + offset, line))
    return found


def _hash_comments(text: str) -> list[tuple[int, str]]:
    """Shell and pbtxt: from the first # outside quotes to the end of the line (a shebang is not a comment)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t;"):
                if not line.startswith("#!"):
                    found.append((number, line[i:]))
                break
    return found


def comments_of(path: Path, text: str) -> list[tuple[int, str]]:
    if path.suffix == ".py":
        return _python_comments(text)
    if path.suffix in (".c", ".h"):
        return _c_comments(text)
    return _hash_comments(text)


def violations(path: Path, text: str) -> list[str]:
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    found = []
    for line, comment in comments_of(path, text):
        for rule, pattern in (("an ISO date", ISO_DATE), ('"this box / this machine / this Xeon"', THIS_MACHINE)):
            if pattern.search(comment):
                found.append(f"{rel}:{line}: {rule} in a comment: {comment.strip()[:120]}")
    for line, source_line in enumerate(text.splitlines(), 1):
        if README_CITATION.search(source_line):
            found.append(f"{rel}:{line}: cites the README (point to a docs/ page): {source_line.strip()[:120]}")
    return found


def test_source_comments_carry_no_dates_machines_or_readme_citations():
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        problems += violations(path, path.read_text(errors="replace"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name, text", [
    ("a.py", '"""Measured on this box: 12 ms."""\n'),
    ("a.py", "x = 1  # since 2026-12-06 the default\n"),
    ("a.c", "/* on this Xeon\n * it was faster */\nint x;\n"),
    ("a.sh", "echo hi  # this machine only\n"),
    ("a.h", "/* overflowed the 48 KB L1 of this AMX Xeon */\n"),
    ("a.py", "# leaves this 2-core box running on one core\n"),
    ("a.py", 'raise ValueError("see README \'Structured outputs\'")\n'),
    ("a.pbtxt", '# checked by ernie_tokenizer (README.md, "Reliability")\n'),
])
def test_policy_catches(name, text):
    assert violations(Path(name), text)


@pytest.mark.parametrize("name, text", [
    ("a.py", 'LOG = "2026-06-13 04:55 INFO request finished"  # a replayed document\n'),
    ("a.py", 'raise RuntimeError("this machine shows NVIDIA GPUs but no CUDA build")\n'),
    ("a.py", "# the shim's endpoints: client/ernie_client/openai/README.md\n"),
    ("a.sh", 'echo "not checked on this box"\n'),
    ("a.c", "/* scripts/bench_kernels_ab.py --bits 8 re-checks this threshold */\n"),
])
def test_policy_leaves_alone(name, text):
    assert not violations(Path(name), text)
