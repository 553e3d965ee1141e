"""The package's layering, read from its source: heads/ never imports training/ (nor any other layer above it),
drafters do not import each other, training/ imports none of the faces above it and its jobs import downward only
(data, trainer, recipes, studies), only scripts/ and the device program run the studies, and the module import graph
has no cycle (lazy imports inside functions count)."""

from __future__ import annotations

import ast
from pathlib import Path

import selfspec

PACKAGE = Path(selfspec.__file__).parent
SHARED_HEAD_MODULES = {
    "selfspec.heads",
    "selfspec.heads.base",
    "selfspec.heads.artifacts",
    "selfspec.heads.vocab",
    "selfspec.heads.speculators",
    "selfspec.heads.calibration",
    "selfspec.heads.paced",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the selfspec modules it imports (absolute, relative, at top level or inside functions)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(0, node.level - 1)):
                    base = base.rpartition(".")[0]
                source = (
                    f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
                )
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    edges.add(candidate if candidate in modules else source)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def test_heads_import_nothing_above_them_and_not_each_other():
    graph = import_graph()
    for module, imports in graph.items():
        if not module.startswith("selfspec.heads"):
            continue
        upward = sorted(
            i for i in imports if i.startswith(("selfspec.training", "selfspec.bench", "selfspec.cli", "selfspec.api"))
        )
        assert not upward, f"{module} imports {upward}: heads/ must not depend on the layers that use it"
        if module not in SHARED_HEAD_MODULES:  # a drafter is a module or a package (heads/eagle/: eagle and eagle3)
            siblings = sorted(
                i
                for i in imports
                if i.startswith("selfspec.heads.")
                and i not in SHARED_HEAD_MODULES
                and _drafter_of(i) != _drafter_of(module)
            )
            assert not siblings, f"drafter module {module} imports other drafters {siblings}: share through base/vocab"


# The faces above training/: the public API and its package face, the CLI, the benchmark harness, the terminal chat,
# the web demo and the device program. `selfspec` alone is the package's __init__ (the public API's names).
ABOVE_TRAINING = ("selfspec.api", "selfspec.bench", "selfspec.chat", "selfspec.cli", "selfspec.demo", "selfspec.device")
# training/'s jobs from the ground up: a module imports its own job's modules and those of the jobs below it, never
# one above (the pipeline finds the recipes through the drafter registry, not by an import).
TRAINING_FLOORS = (
    ("selfspec.training", "selfspec.training.config", "selfspec.training.clock", "selfspec.training.throughput"),
    ("selfspec.training.data",),
    ("selfspec.training.trainer",),
    ("selfspec.training.recipes",),
    ("selfspec.training.studies",),
)
STUDIES = "selfspec.training.studies"
# What may run a study besides the studies themselves (and scripts/, which are no part of the package): the device
# program, whose evaluation stage measures the new heads' draft accuracy on a lent GPU.
STUDY_RUNNERS = ("selfspec.device",)


def _within(module: str, *packages: str) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _training_floor(module: str) -> int:
    """The floor of a training module: that of the longest name in TRAINING_FLOORS it falls under (a module at
    training/'s top level that is not named there is on the ground floor)."""
    return max(
        (len(name), floor) for floor, names in enumerate(TRAINING_FLOORS) for name in names if _within(module, name)
    )[1]


def test_training_imports_none_of_the_faces_above_it():
    graph = import_graph()
    for module, imports in graph.items():
        if _within(module, "selfspec.training"):
            upward = sorted(i for i in imports if i == "selfspec" or _within(i, *ABOVE_TRAINING))
            assert not upward, f"{module} imports {upward}: training/ must not depend on the layers that use it"


def test_training_jobs_import_downward_only():
    graph = import_graph()
    for module, imports in graph.items():
        if not _within(module, "selfspec.training"):
            continue
        floor = _training_floor(module)
        upward = sorted(i for i in imports if _within(i, "selfspec.training") and _training_floor(i) > floor)
        assert not upward, (
            f"{module} imports {upward}: a training job imports its own and lower jobs only "
            f"({' < '.join(names[0].rpartition('.')[2] for names in TRAINING_FLOORS[1:])})"
        )


def test_only_scripts_and_the_device_program_import_the_studies():
    graph = import_graph()
    offenders = [
        f"{module} imports {sorted(i for i in imports if _within(i, STUDIES))}"
        for module, imports in graph.items()
        if not _within(module, STUDIES, *STUDY_RUNNERS) and any(_within(i, STUDIES) for i in imports)
    ]
    assert not offenders, "the package runs no study (scripts/ and the device program do): " + "; ".join(offenders)


def _drafter_of(module: str) -> str:
    return ".".join(module.split(".")[:3])  # selfspec.heads.<drafter module or package>


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    # A package __init__ that re-exports its modules is not a cycle of logic: drop package -> own-submodule edges.
    graph = {m: {i for i in imports if not i.startswith(m + ".")} for m, imports in graph.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycle = path[path.index(imported) :] + [imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: its `_functions` and `_Classes`, names it assigns (module and class
    level, dataclass fields) and attributes it sets on `self` or `cls`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if _is_private(name)}


def cross_module_private_reads(trees: dict[str, ast.AST]) -> list[str]:
    """'module:line what' for every read of a private name (`_x`) that some module in `trees` defines, by a module
    that does not define it, on anything but `self`, `cls` or `super()`; and for every import of a private name from
    a selfspec module."""
    defined = {module: _private_names_defined(tree) for module, tree in trees.items()}
    ours = set().union(*defined.values())
    offences = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("selfspec")):
                offences += [
                    f"{module}:{node.lineno} imports {alias.name}" for alias in node.names if _is_private(alias.name)
                ]
            if not isinstance(node, ast.Attribute) or node.attr not in ours or node.attr in defined[module]:
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            ):
                continue
            offences.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    return offences


def test_no_module_reads_another_modules_private_names():
    """A selfspec module reads a private name only on `self`, `cls` or `super()`, or where it defines that name
    itself, and never imports another module's: a class's storage and helpers can change without breaking a reader
    elsewhere (the compiled steps use the in-place KV layer's public `storage`/`reserve`/`mark_filled`, not its
    `_key_store`). Private names of other libraries (`torch.ops.mkldnn._linear_pointwise`,
    `config._attn_implementation`) are not selfspec's to police: only names a selfspec module defines count."""
    offences = cross_module_private_reads(
        {module_name(path): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    )
    assert not offences, "private names read across modules: " + "; ".join(offences)


def test_the_private_name_check_flags_reaches_into_another_module():
    trees = {
        "selfspec.storage": ast.parse(
            "class Layer:\n    def __init__(self):\n        self._store = None\n"
            "    def grow(self):\n        self._store = self._store\n_TABLE = {}\n"
        ),
        "selfspec.reader": ast.parse(
            "from .storage import _TABLE\n"
            "def read(layer, config):\n    config._attn_implementation\n    return layer._store\n"
            "class Sub:\n    def f(self):\n        self._store, super()._store\n"
        ),
    }
    assert cross_module_private_reads(trees) == [
        "selfspec.reader:1 imports _TABLE",
        "selfspec.reader:4 reads layer._store",
    ]
