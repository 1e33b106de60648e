"""The house's layering (clipdist.LAYERS, docs/architecture.md): each module imports only its own layer and the
layers below, and no modules import each other in a loop — function-level imports included, since those are where
cycles hide."""

from __future__ import annotations

import ast
from pathlib import Path

import clipdist

PACKAGE = Path(__file__).resolve().parents[2] / "clipdist"

LAYERS = clipdist.LAYERS  # floors of packages, lowest first, declared in clipdist/__init__.py

# Caps a fifth above today's counts (31 function-level imports, 15 project modules in the largest hub): room for the
# next component, while a habit of lazy imports or a module that gathers everything still fails
LOCAL_IMPORTS_OUTSIDE_CLI = 37  # function-level imports outside cli/: optional dependencies and lazy starts


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The package a module belongs to: clipdist.data.stream -> data; a top-level module is its own (config)."""
    return (module.split(".") + ["__init__"])[1]


def _layer(module: str) -> int:
    for level, names in enumerate(LAYERS):
        if _package(module) in names:
            return level
    raise AssertionError(f"{module}: its package is on no floor; add it to LAYERS in clipdist/__init__.py")


def _imports(path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(clipdist module imported, whether the import is inside a function) for each import in `path`."""
    tree, found = ast.parse(path.read_text()), []
    local_nodes = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clipdist"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [name if name in modules else node.module for name in names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("clipdist")]
        else:
            continue
        found += [(target, id(node) in local_nodes) for target in targets]
    return found


def _graph() -> tuple[dict[str, set[str]], int]:
    files = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph, local = {}, 0
    for module, path in files.items():
        edges = _imports(path, set(files))
        graph[module] = {target for target, _ in edges if target in files and target != module}
        if not module.startswith("clipdist.cli"):
            local += sum(1 for _, inside in edges if inside)
    return graph, local


def _all_local_imports(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return sum(
        1
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def test_packages_are_layers():
    """A module imports its own package and the packages on lower floors: no arrow between packages runs sideways
    or back up (so the packages themselves form no loop)."""
    graph, _ = _graph()
    wrong = sorted(
        f"{module} (floor {_layer(module)}) -> {target} (floor {_layer(target)})"
        for module, targets in graph.items()
        for target in targets
        if target != "clipdist" and _package(target) != _package(module) and _layer(target) >= _layer(module)
    )
    assert not wrong, "imports from a package to one on its own floor or above:\n" + "\n".join(wrong)


def test_no_import_cycle():
    graph, _ = _graph()
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # a package's __init__ importing its own submodules is how a package hands names on, not a cycle
    cycles = [
        cycle
        for cycle in cycles
        if not all(
            part.rsplit(".", 1)[0] == cycle.split(" -> ")[0] or part == cycle.split(" -> ")[0]
            for part in cycle.split(" -> ")
        )
    ]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_level_imports_are_few():
    local = sum(_all_local_imports(path) for path in PACKAGE.rglob("*.py") if "cli" not in path.parent.parts)
    assert local <= LOCAL_IMPORTS_OUTSIDE_CLI, f"{local} function-level imports outside clipdist/cli"


def test_the_config_schema_imports_no_torch():
    """clipdist.config and everything it imports at module level import neither torch nor open_clip, so the
    schema (and `--help`, and Hydra's composition) loads without them."""
    files = {_module(path): path for path in PACKAGE.rglob("*.py")}
    seen, todo, heavy = set(), ["clipdist.config"], []
    while todo:
        module = todo.pop()
        if module in seen or module not in files:
            continue
        seen.add(module)
        for node in ast.parse(files[module].read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            heavy += [f"{module} imports {name}" for name in names if name.split(".")[0] in ("torch", "open_clip")]
            todo += [name for name in names if name in files]
    assert not heavy, heavy


MOST_PROJECT_IMPORTS = 18  # project modules one module may import, anywhere in it (a hub beyond it: split it)


def project_imports(path) -> set[str]:
    """The clipdist modules `path` imports anywhere: at module level, in functions, and for annotations alone."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "clipdist":
            for alias in node.names:
                module = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / (module.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / module.replace(".", "/")
                ).is_dir()
                found.add(module if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "clipdist")
    return found


def test_no_module_imports_more_than_a_few_project_modules():
    hubs = {
        str(path.relative_to(PACKAGE.parent)): len(imported)
        for path in PACKAGE.rglob("*.py")
        if len(imported := project_imports(path)) > MOST_PROJECT_IMPORTS
    }
    assert hubs == {}, hubs


LONGEST_FUNCTION = 60  # lines, decorators and docstring included: beyond it a function does more than one thing


def test_no_function_is_longer_than_sixty_lines():
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for folder in (PACKAGE,)
        for path in folder.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION
    }
    assert long == {}, long
