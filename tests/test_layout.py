"""The house: the package root holds its face alone, imports run down the layers and never up,
and every module path of the previous release still imports, with one DeprecationWarning that
names its new path (docs/getting_started.md, "The layout")."""

import ast
import importlib
import pathlib
import re
import sys

import pytest

from attnlab import _moved

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "attnlab"

# What the root holds: the public names, the command, plots and the compilation cache that
# notebooks call, the errors and the dimension key (and, for one release, the old paths).
FACE = {"__init__.py", "_moved.py", "cli.py", "compilation.py", "dims.py", "errors.py", "viz.py"}

# Bottom to top: a module imports from its own layer or below, never from above.
LAYERS = [
    {"errors", "dims", "viz", "_moved"},
    {"ops", "devices"},
    {"contracts"},
    {"config"},
    {"kv_cache"},
    {"nn"},
    {"decode", "metrics"},
    {"data", "pretrained"},
    {"compilation", "experiment"},
    {"train"},
    {"runs"},
    {"evaluation", "sweep", "inspect", "transfer"},
    {"cli", "__init__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
MODULES = {
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
}


def _unit(module: str) -> str:
    """The top-level part of the package that ``module`` belongs to (``attnlab`` itself:
    ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: pathlib.Path):
    """(line, imported module) of every attnlab import in the file, those inside functions
    included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "attnlab":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if full in MODULES else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "attnlab":
                    yield node.lineno, alias.name


def test_the_root_holds_the_face_alone():
    root = {p.name for p in PACKAGE.glob("*.py")}
    assert root == FACE, (
        f"give {sorted(root - FACE)} a home in a subpackage (or name it in FACE and in "
        "docs/getting_started.md's layout)"
    )
    assert {p.parent.name for p in PACKAGE.glob("*/__init__.py")} <= set(LAYER)


def test_no_import_runs_back_up():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        source = rel.parts[0].removesuffix(".py") if rel.parts != ("__init__.py",) else "__init__"
        assert source in LAYER, f"attnlab/{rel} is on no layer of LAYERS"
        for line, module in _imports(path):
            target = _unit(module)
            if LAYER[target] > LAYER[source]:
                upward.append(f"attnlab/{rel}:{line} imports {module} ({source} < {target})")
    assert not upward, "\n".join(upward)


def test_the_layering_sees_an_upward_import(tmp_path):
    # The check above can fail: an import of runs (layer 10) from ops (layer 1) is found.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from attnlab.runs.loading import load_run\n")
    ((line, module),) = list(_imports(bad))
    assert (line, _unit(module)) == (2, "runs") and LAYER["runs"] > LAYER["ops"]


def _import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module under ``root`` -> the attnlab modules it imports (those inside functions
    included: a lazy import that points back up closes a circle just the same)."""
    graph = {}
    for path in sorted((root / "attnlab").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {m for _, m in _imports(path) if m != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # By the module each import names (``from attnlab.nn import parametrization`` is
    # attnlab.nn.parametrization; a package's ``__init__`` is a node only where it is named).
    circles = _circles(_import_graph(REPO))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_circle(tmp_path):
    # The check above can fail: two modules that import each other, one of them lazily.
    (tmp_path / "attnlab").mkdir()
    (tmp_path / "attnlab" / "a.py").write_text("from attnlab.b import f\n")
    (tmp_path / "attnlab" / "b.py").write_text("def f():\n    from attnlab.a import g\n")
    assert _circles(_import_graph(tmp_path)) == [["attnlab.a", "attnlab.b"]]


def test_no_file_names_an_old_module_path():
    old = re.compile(
        r"(?<![\w.])("
        + "|".join(re.escape(m) for m in sorted(_moved.MOVED, key=len)[::-1])
        + r")\b(?!\w)"
    )
    found = []
    for top in ("attnlab", "tests", "docs", "notebooks", "experiments", "benchmarks"):
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in (".py", ".md", ".ipynb") or path.name in (
                "_moved.py",
                "test_layout.py",
            ):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if old.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found[:20])


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(_moved.MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new.__name__}")):
        module = importlib.import_module(old)
    assert module is new
    sys.modules.pop(old, None)  # the next import warns again


def test_old_names_warn():
    import attnlab
    import attnlab.nn
    import attnlab.nn.models
    import attnlab.pretrained
    import attnlab.runs.export
    import attnlab.runs.surgery_run

    sys.modules.pop("attnlab.mixers", None)
    attnlab.__dict__.pop("mixers", None)
    with pytest.warns(DeprecationWarning, match="attnlab.contracts.mixer"):
        assert attnlab.mixers is importlib.import_module("attnlab.contracts.mixer")
    with pytest.warns(DeprecationWarning, match="MODEL_CLASSES"):
        assert attnlab.nn.ARCHITECTURES is attnlab.nn.MODEL_CLASSES
    with pytest.warns(DeprecationWarning, match="MODEL_CLASSES"):
        assert attnlab.nn.models.ARCHITECTURES is attnlab.nn.models.MODEL_CLASSES
    with pytest.warns(DeprecationWarning, match="attnlab.runs.export.export_run"):
        assert attnlab.pretrained.export_run is attnlab.runs.export.export_run
    for package, old, new in [
        (attnlab.runs, "surgery", "attnlab.runs.surgery_run"),
        (attnlab.nn, "attention", "attnlab.nn.mixers.mha"),
    ]:
        sys.modules.pop(f"{package.__name__}.{old}", None)
        package.__dict__.pop(old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(new)):
            assert getattr(package, old) is importlib.import_module(new)
    with pytest.raises(AttributeError):
        attnlab.no_such_module  # noqa: B018
