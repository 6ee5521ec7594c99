"""The layering of docs/architecture.md holds: imports go one way, and the only import cycle is the
Tensor <-> op one every autograd engine has."""

import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "minimp")

# Lowest first; a module may import its own layer and the layers below it, never one above.
LAYERS = [
    (
        "arrays",
        ("minimp.backend", "minimp.memory_pool", "minimp.npz", "minimp.precision.casting")
        + ("minimp.precision.halfcast", "minimp.precision.halfcast_numba", "minimp.precision.fp8")
        # the block-scaled formats, their GEMM and the recipes built of them: arrays in, arrays out
        + ("minimp.precision.blocks", "minimp.precision.accumulate", "minimp.precision.recipes")
        # and NVFP4's pieces the recipes use: stochastic rounding, the Hadamard transform
        + ("minimp.precision.stochastic", "minimp.precision.hadamard")
        # and the compiled loops under them: the formats' codes, the limited accumulator
        + ("minimp.precision.codes", "minimp.precision.accumulate_numba"),
    ),
    (
        "autograd",
        ("minimp.function", "minimp.tensor", "minimp.ops", "minimp.functional")
        + ("minimp.split_backward",),
    ),
    (
        "nn/optim/precision",
        ("minimp.nn", "minimp.optim", "minimp.precision", "minimp.data", "minimp.datasets"),
    ),
    ("models", ("minimp.models",)),
    ("distributed", ("minimp.distributed",)),
    ("measure", ("minimp.measure",)),
    ("parallel", ("minimp.parallel",)),
    ("plan", ("minimp.plan",)),
    ("checkpoints", ("minimp.checkpoints",)),
    ("train", ("minimp.train", "minimp.sample", "minimp.export")),
    ("lessons", ("minimp.lessons",)),  # the notebooks' checkers and figures: nothing imports them
]
# The Tensor <-> op cycle: a Tensor's operators are Functions, and a Function makes Tensors.
AUTOGRAD_CYCLE = {"minimp.tensor", "minimp.function", "minimp.ops"}


def module_name(path):
    relative = os.path.relpath(path, os.path.join(PACKAGE, ".."))
    name = relative[: -len(".py")].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def all_modules():
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                yield module_name(path), path


MODULES = dict(all_modules())


def imported_modules(path):
    """Every minimp module a file imports when it runs (`from minimp.x import y` names minimp.x.y
    when y is a module). Imports under `if TYPE_CHECKING:` are for annotations only: they run
    under mypy, never in the program, so they make no cycle and break no layer."""
    found = set()
    tree = ast.parse(open(path).read())
    typing_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for child in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("minimp")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minimp"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
    return found


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


@pytest.mark.parametrize("module", sorted(name for name in MODULES if name != "minimp"))
def test_imports_go_one_way(module):
    own = layer_of(module)
    assert own is not None, f"{module} belongs to no layer: add it to docs/architecture.md and here"
    for imported in imported_modules(MODULES[module]):
        if imported == "minimp":
            continue
        theirs = layer_of(imported)
        assert theirs is not None and theirs <= own, (
            f"{module} ({LAYERS[own][0]}) imports {imported} "
            f"({LAYERS[theirs][0] if theirs is not None else '?'}), a layer above it"
        )


# What a wing must never import, whatever the layers above say: the transport knows no strategy,
# meter, planner or trainer; the strategies know no planner or trainer; the commands that read
# checkpoints share minimp.checkpoints with the trainer and import nothing else of it.
FORBIDDEN = {
    "minimp.distributed": ("minimp.measure", "minimp.plan", "minimp.parallel", "minimp.train"),
    "minimp.parallel": ("minimp.train", "minimp.plan"),
    "minimp.checkpoints": ("minimp.train",),
    "minimp.sample": ("minimp.train",),
    "minimp.export": ("minimp.train",),
}


@pytest.mark.parametrize("wing", sorted(FORBIDDEN))
def test_the_transport_and_the_strategies_import_nothing_above_them(wing):
    for module, path in MODULES.items():
        if module == wing or module.startswith(wing + "."):
            for imported in imported_modules(path):
                assert not imported.startswith(FORBIDDEN[wing]), f"{module} imports {imported}"


def test_no_import_cycle_but_the_autograd_one():
    def group(module):
        return "autograd core" if any(module.startswith(m) for m in AUTOGRAD_CYCLE) else module

    graph = {}
    for module, path in MODULES.items():
        edges = {group(i) for i in imported_modules(path) if i in MODULES and i != "minimp"}
        graph.setdefault(group(module), set()).update(edges - {group(module)})
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in list(graph):
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_file_says_its_one_job_first_and_stays_under_the_hard_limit(module):
    """A file is one job, said in its docstring's first line (one sentence, ending in a period or
    a colon); a long file is fine when it is one idea read top to bottom, up to 500 lines."""
    text = open(MODULES[module]).read()
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring, f"{module}: the first docstring line says the file's one job"
    first = docstring.split("\n\n")[0].replace("\n", " ")
    assert first.rstrip().endswith((".", ":", "?", ".)")), f"{module}: one sentence: {first!r}"
    assert len(text.splitlines()) <= 500, f"{module}: over 500 lines; split where a job hides"


def test_every_file_and_function_the_architecture_map_names_exists():
    """docs/architecture.md walks one step as `file.py:function` (or `file.py:Class.method`)
    references: each file is in minimp/ and defines that name."""
    doc = open(os.path.join(PACKAGE, "..", "docs", "architecture.md")).read()
    named = set(re.findall(r"`([\w/]+\.py):([\w.]+)`", doc))
    assert len(named) > 30  # the walk is there
    missing = []
    for path, dotted in sorted(named):
        tree = ast.parse(open(os.path.join(PACKAGE, path)).read())
        scope = tree.body
        for name in dotted.split("."):
            found = [
                node for node in scope
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
            ]
            if not found:
                missing.append(f"{path}:{dotted}")
                break
            scope = found[0].body
    assert not missing, missing
