"""The house's measures: prose share, history in comments, sizes, import cycles.

Run as ``python -m benchmarks.house`` (prints a table, writes ``--out`` JSON);
``tests/test_house.py`` holds the limits. Definitions:

- prose: lines that hold only a comment, plus every line of a module, class or
  function docstring, over all lines of the package's ``.py`` files;
- history: comment or docstring lines matching ``HISTORY_PATTERNS``;
- sizes: a module's lines, a class's and a function's span (decorators excluded);
- import cycles: edges go to the module each import names (``from P import X`` to
  ``P.X`` when that is a module, and to ``P``); imports inside functions count,
  ``if TYPE_CHECKING:`` imports do not, and a module has no implicit edge to its
  parent package.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import tokenize
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_PACKAGES = ("superinfer_jax", "models", "serving")
HISTORY_PATTERNS = (r"\d ?ms\b", r"\d+ ?-> ?\d", r"seeds? \d")
SESSION_PATTERN = r"(?i)session[ -]?[0-9]"
EXCLUDED_PARTS = ("proto_gen",)


@dataclass
class PackageProse:
    package: str
    lines: int = 0
    prose_lines: int = 0

    @property
    def share(self) -> float:
        return self.prose_lines / self.lines if self.lines else 0.0


@dataclass
class Oversize:
    kind: str  # module | class | function
    where: str
    lines: int


@dataclass
class HouseReport:
    prose: list[PackageProse] = field(default_factory=list)
    history_lines: list[str] = field(default_factory=list)
    session_lines: list[str] = field(default_factory=list)
    root_modules: int = 0
    largest: dict[str, Oversize] = field(default_factory=dict)
    cycles: list[list[str]] = field(default_factory=list)
    sizes: list[Oversize] = field(default_factory=list)  # every one outside ops/


def python_files(package: str) -> Iterator[Path]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if not any(part in EXCLUDED_PARTS for part in path.parts):
            yield path


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first = body[0]
                end = first.end_lineno or first.lineno
                lines.update(range(first.lineno, end + 1))
    return lines


def _comment_lines(source: str) -> dict[int, str]:
    """Line number -> comment text, for every comment (own-line or trailing)."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def file_prose(source: str, tree: ast.AST) -> tuple[int, list[str]]:
    """(prose line count, the text of every comment or docstring line)."""
    lines = source.splitlines()
    doc = _docstring_lines(tree)
    comments = _comment_lines(source)
    own_line_comments = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    prose = len(doc | own_line_comments)
    texts = [lines[n - 1] for n in sorted(doc)] + list(comments.values())
    return prose, texts


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    def visit(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    yield from visit_one(orelse)
                continue
            yield from visit_one(child)

    def visit_one(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from visit(node)

    yield from visit(tree)


def import_edges(name: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    edges: set[str] = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    edges.add(alias.name)
            continue
        if node.level:
            base_parts = name.split(".") if is_package else name.split(".")[:-1]
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base in known:
            edges.add(base)
        for alias in node.names:
            target = f"{base}.{alias.name}"
            if target in known:
                edges.add(target)
    edges.discard(name)
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def _span(node: ast.AST) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def measure() -> HouseReport:
    report = HouseReport()
    history = [re.compile(p) for p in HISTORY_PATTERNS]
    session = re.compile(SESSION_PATTERN)
    trees: dict[str, tuple[ast.AST, bool]] = {}
    largest: dict[str, Oversize] = {}

    def keep_largest(kind: str, where: str, lines: int, in_ops: bool) -> None:
        key = kind + ("_ops" if in_ops else "")
        if key not in largest or lines > largest[key].lines:
            largest[key] = Oversize(kind, where, lines)
        if not in_ops:
            report.sizes.append(Oversize(kind, where, lines))

    for package in CODE_PACKAGES:
        tally = PackageProse(package)
        for path in python_files(package):
            source = path.read_text()
            tree = ast.parse(source)
            name = module_name(path)
            trees[name] = (tree, path.name == "__init__.py")
            prose, texts = file_prose(source, tree)
            tally.lines += len(source.splitlines())
            tally.prose_lines += prose
            rel = str(path.relative_to(ROOT))
            for text in texts:
                if any(p.search(text) for p in history):
                    report.history_lines.append(f"{rel}: {text.strip()}")
                if session.search(text):
                    report.session_lines.append(f"{rel}: {text.strip()}")
            in_ops = name.startswith("superinfer_jax.ops")
            keep_largest("module", rel, len(source.splitlines()), in_ops)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    keep_largest("class", f"{rel}:{node.name}", _span(node), in_ops)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    keep_largest("function", f"{rel}:{node.name}", _span(node), in_ops)
        report.prose.append(tally)
    report.root_modules = sum(
        1 for p in (ROOT / "superinfer_jax").glob("*.py") if p.name != "__init__.py"
    )
    report.largest = largest
    known = set(trees)
    graph = {
        name: import_edges(name, is_package, tree, known)
        for name, (tree, is_package) in trees.items()
    }
    report.cycles = find_cycles(graph)
    return report


def sizes_over(report: HouseReport, limit_module: int, limit_class: int,
               limit_function: int) -> list[Oversize]:
    """Every module, class and function outside ``superinfer_jax/ops`` over its limit."""
    limits = {"module": limit_module, "class": limit_class, "function": limit_function}
    return [o for o in report.sizes if o.lines > limits[o.kind]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/house.json")
    parser.add_argument("--quick", action="store_true", help="the same (it takes seconds)")
    parser.add_argument("--list", action="store_true", help="print every matching line")
    args = parser.parse_args()
    report = measure()
    print(f"{'measure':<40} value")
    for tally in report.prose:
        label = f"prose share, {tally.package}/"
        print(f"{label:<40} {tally.share:.1%} ({tally.prose_lines}/{tally.lines})")
    print(f"{'history lines (ms, a -> b, seeds)':<40} {len(report.history_lines)}")
    print(f"{'session lines':<40} {len(report.session_lines)}")
    print(f"{'modules at superinfer_jax/ root':<40} {report.root_modules}")
    for key, item in sorted(report.largest.items()):
        print(f"{'largest ' + key:<40} {item.lines} ({item.where})")
    print(f"{'import cycles':<40} {len(report.cycles)}")
    for cycle in report.cycles:
        print(f"  {' '.join(cycle)}")
    over = sizes_over(report, 600, 450, 80)
    print(f"{'over 600/450/80 lines outside ops/':<40} {len(over)}")
    if args.list:
        for line in report.history_lines + report.session_lines:
            print("  " + line)
        for item in over:
            print(f"  {item.kind} {item.where} {item.lines}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    del data["sizes"]  # every span: the oversize ones follow
    data["prose_share"] = {t.package: t.share for t in report.prose}
    data["oversize"] = [asdict(o) for o in over]
    out.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
