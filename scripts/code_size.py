"""How large the package is: its lines of code, and how many of its parameters are typed Any.

    python scripts/code_size.py            # minimp/ without minimp/lessons/, in total
    python scripts/code_size.py -v         # and per file; and each parameter typed Any

A line of code is a line with a token of code on it: blank lines, comments and docstrings (a
module's, a class's or a function's first statement when it is a string) do not count, so a
docstring is never shortened to make the package look smaller (issue 34 set its target so).
A parameter (self and cls aside) counts as typed Any when its annotation is Any, a union with Any
(`Any | None`, `int | Any`), or missing.
"""

import argparse
import ast
import io
import pathlib
import sys
import tokenize

SKIPPED_TOKENS = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                  tokenize.DEDENT, tokenize.ENDMARKER)


def _docstring(node: ast.AST) -> ast.Expr | None:
    """A module's, class's or function's docstring statement, if it has one."""
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first if isinstance(first.value.value, str) else None
    return None


def lines_of_code(source: str) -> int:
    """The lines of `source` that hold code, docstrings not counted."""
    documented: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        docstring = _docstring(node)
        if docstring is not None:
            documented.update(range(docstring.lineno, (docstring.end_lineno or 0) + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED_TOKENS:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - documented)


def any_parameters(source: str) -> list[str]:
    """`function(parameter)` for every parameter typed Any or not annotated."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            for argument in every:
                text = _annotation(argument.annotation)
                is_any = text == "Any" or "| Any" in text or text.startswith("Any |")
                if argument.arg not in ("self", "cls") and is_any:
                    found.append(f"{node.name}({argument.arg})")
    return found


def _annotation(node: ast.expr | None) -> str:
    """An annotation's text, a quoted one ("TrainConfig") unquoted; "Any" when there is none."""
    if node is None:
        return "Any"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def parameter_count(source: str) -> int:
    """Every parameter of every function, self and cls aside."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            count += sum(argument.arg not in ("self", "cls") for argument in every)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="minimp", help="the package (default minimp)")
    parser.add_argument("-v", "--verbose", action="store_true", help="per file, and each Any")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.root)
    total = parameters = 0
    typed_any: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if "lessons" in path.relative_to(root).parts:
            continue
        source = path.read_text()
        lines, found = lines_of_code(source), any_parameters(source)
        total, parameters = total + lines, parameters + parameter_count(source)
        typed_any += [f"{path}: {name}" for name in found]
        if args.verbose:
            print(f"{lines:6d} {path}")
    if args.verbose:
        print("\n".join(typed_any))
    share = len(typed_any) / max(parameters, 1)
    print(f"lines of code: {total:,}; parameters typed Any: {len(typed_any)} of {parameters:,} "
          f"({share:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
