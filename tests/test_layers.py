"""The packages' import graph: no import cycle, and each layer imports only the layers below it.

Every module of `maxsim_cli` and of `maxsim_kernels` (the ``kernels/`` folder) is parsed, not imported;
every import statement counts, at module level or inside a function (a lazy import is still a
dependency), and so does a package ``__init__`` that re-exports a submodule's names. ``from P import x``
is an edge to the module ``P.x`` when there is one, else to ``P``. The layers (docs: the target shape):

    commands, cli  >  service  >  api, score  >  scoring.dispatch  >  parallel  >  scoring
                   >  pipeline, topk, runs, shards, devices, ...  >  maxsim_kernels

And every package found is one that pyproject.toml installs.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGES = ("maxsim_cli", "maxsim_kernels")
REPO = Path(__file__).resolve().parents[1]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of `PACKAGES`."""
    out = {}
    for package in PACKAGES:
        root = _package_dir(package)
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (file ``path``) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1 packages
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {target for target in found if target in modules and target != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def test_the_graph_sees_the_layers(graph: dict[str, set[str]]) -> None:
    """The parser finds what it checks: a function-level import, a relative one, a package re-export."""
    assert {"maxsim_cli.scoring.engine", "maxsim_cli.scoring.dispatch", "maxsim_kernels"} <= graph.keys()
    assert "maxsim_cli.scoring.dispatch" in graph["maxsim_cli.scoring.entry"]
    assert "maxsim_cli.scoring.files" in graph["maxsim_cli.scoring.dispatch"]  # imported inside `run_files`
    assert any(_within(m, ("maxsim_kernels",)) for m in graph["maxsim_kernels"])  # __init__ re-exports


# Cycles known and left for now: each is named with why it is there. Any other cycle fails the test.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    cycles = [c for c in _cycles(graph) if tuple(c) not in KNOWN_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


# Every module's layer, from the top: a module imports only modules of its own layer or of layers below it
# (directly; the graph then holds the rule for every path). A prefix names a module and the modules under
# it; the longest prefix that names a module decides its layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the command line", ("maxsim_cli.__main__", "maxsim_cli.cli", "maxsim_cli.commands")),
    ("serve: HTTP over the API", ("maxsim_cli.service",)),
    ("integrations: PyTerrier and ir_measures over the API", ("maxsim_cli.pyterrier", "maxsim_cli.evaluate")),
    # the package's __init__ re-exports the API (named exactly: it is not a prefix of every module)
    ("the API", ("maxsim_cli.api", "maxsim_cli.explain", "=maxsim_cli")),
    (
        "the other commands' libraries",
        (
            "maxsim_cli.pack",
            "maxsim_cli.pack_sources",
            "maxsim_cli.quantize",
            "maxsim_cli.inspect_shards",
            "maxsim_cli.verify",
            "maxsim_cli.agreement",
        ),
    ),
    ("how a request runs: the one dispatch", ("maxsim_cli.scoring.dispatch", "maxsim_cli.scoring.entry")),
    ("several devices", ("maxsim_cli.parallel",)),
    ("one device, one process", ("maxsim_cli.scoring",)),
    (
        "building blocks",
        (
            "maxsim_cli.run",
            "maxsim_cli.run_files",
            "maxsim_cli.merge",
            "maxsim_cli.irds",
            "maxsim_cli.codecs",
            "maxsim_cli.queries",
            "maxsim_cli.shards",
            "maxsim_cli.devices",
            "maxsim_cli.memory",
            "maxsim_cli.tuning",
            "maxsim_cli.cuda_early",
            "maxsim_cli.progress",
            "maxsim_cli.lifeline",
            "maxsim_cli.timeline",
        ),
    ),
    ("ground floor", ("maxsim_cli.errors", "maxsim_cli.settings", "maxsim_cli.units", "maxsim_cli.arrays")),
    ("the kernels", ("maxsim_kernels",)),
]


def _layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            hit = module == prefix[1:] if prefix.startswith("=") else _within(module, (prefix,))
            if hit and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    missing = sorted(m for m in graph if _layer_of(m) is None)
    assert not missing, "modules in no layer of LAYERS: " + ", ".join(missing)


def test_a_layer_imports_nothing_above_it(graph: dict[str, set[str]]) -> None:
    bad = []
    for module in sorted(graph):
        own = _layer_of(module)
        for target in sorted(graph[module]):
            above = _layer_of(target)
            if own is not None and above is not None and above < own:
                bad.append(f"{module} ({LAYERS[own][0]}) -> {target} ({LAYERS[above][0]})")
    assert not bad, "imports from a layer above: " + "; ".join(bad)


def test_layers_are_checked() -> None:
    """The rule sees an upward import: the kernels importing the library, scoring importing the API."""
    kernels, engine, api = (
        _layer_of(m) for m in ("maxsim_kernels.cpu", "maxsim_cli.scoring.engine", "maxsim_cli.api")
    )
    assert kernels > engine > api
    assert _layer_of("maxsim_cli.scoring.dispatch") < _layer_of("maxsim_cli.parallel.threads")
    assert _layer_of("maxsim_cli") == _layer_of("maxsim_cli.api")


def _private_names_used(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``from M import _x`` and ``M._x`` (M a module of the project other than this one), in ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> project module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in modules or source == name:
                continue
            if any(part.startswith("_") and not part.startswith("__") for part in source.split(".")):
                found.append(f"{name}:{node.lineno} imports the private module {source}")
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}:{node.lineno} imports {source}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != name
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module() -> None:
    """A name that another module needs is public (no leading underscore) where it is defined."""
    modules = _modules()
    found = []
    for name, path in sorted(modules.items()):
        found += _private_names_used(name, path, modules)
    assert not found, "private names used across modules: " + "; ".join(found)


def test_private_names_are_found(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from a.b import _hidden\nimport a.c as c\nc._inner()\nfrom a import b\nb._x\n")
    modules = {"a": tmp_path, "a.b": tmp_path, "a.c": tmp_path, "m": source}
    assert len(_private_names_used("m", source, modules)) == 3


def test_pyproject_lists_every_package() -> None:
    """A sub-package missing from ``[tool.setuptools] packages`` is left out of a wheel (an editable
    install does not show it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "packages"
    ]
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert sorted(found) == sorted(listed)
