"""The share of a tree's lines that are prose (comments and docstrings), and a check that a prose-only edit left the
code as it was (each file's syntax tree, docstrings removed, equal to the one at a git revision).

    python tools/prose_share.py [DIR] [-v]              (default dspark_ray; -v: per file)
    python tools/prose_share.py --check REV [DIR]       (exit 1 when a file's code differs from REV's)
"""
from __future__ import annotations

import argparse
import ast
import io
import pathlib
import subprocess
import sys
import tokenize

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstring(node) -> ast.Expr | None:
    b = node.body
    if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) and isinstance(b[0].value.value, str):
        return b[0]
    return None


def prose_lines(src: str) -> set[int]:
    lines = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, _DOCSTRING_OWNERS) and (doc := _docstring(node)):
            lines.update(range(doc.lineno, doc.end_lineno + 1))
    return lines


def code_of(src: str) -> str:
    """The syntax tree without docstrings (comments never reach it), as text."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_OWNERS) and _docstring(node):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def share(root: pathlib.Path, verbose: bool) -> None:
    total = prose = 0
    rows = []
    for p in sorted(root.rglob("*.py")):
        src = p.read_text()
        n, k = len(src.splitlines()), len(prose_lines(src))
        total, prose = total + n, prose + k
        rows.append((k, n, p))
    if verbose:
        for k, n, p in sorted(rows, reverse=True):
            print(f"{k:5d} {n:5d} {k / max(n, 1):5.0%} {p}")
    print(f"{root}: {total} lines, {prose} of them prose ({prose / max(total, 1):.1%})")


def check(rev: str, root: pathlib.Path) -> int:
    differ = 0
    for p in sorted(root.rglob("*.py")):
        old = subprocess.run(["git", "show", f"{rev}:{p}"], capture_output=True, text=True)
        if old.returncode != 0:
            print(f"not at {rev}: {p}")
            differ += 1
        elif code_of(old.stdout) != code_of(p.read_text()):
            print(f"code differs from {rev}: {p}")
            differ += 1
    print("code unchanged (comments and docstrings aside)" if not differ else f"{differ} file(s) differ in code")
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default="dspark_ray")
    ap.add_argument("-v", action="store_true", help="one line per file, most prose first")
    ap.add_argument("--check", metavar="REV", help="compare each file's code with the one at git revision REV")
    args = ap.parse_args()
    root = pathlib.Path(args.root)
    if args.check:
        sys.exit(1 if check(args.check, root) else 0)
    share(root, args.v)


if __name__ == "__main__":
    main()
