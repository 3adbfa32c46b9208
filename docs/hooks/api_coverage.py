"""A build hook: every public name has a docstring and an entry in the API reference.

The names are ``attnlab.__all__``, ``attnlab.ops.__all__`` and ``attnlab.inspect.__all__``,
with the public methods and properties of their classes. A name missing from the ``::: path``
entries under ``docs/api/``, or an object or method without a docstring, is a warning, which
``mkdocs build --strict`` turns into a failed build.
"""

import importlib
import inspect
import logging
import pathlib
import re

log = logging.getLogger("mkdocs.hooks.api_coverage")
ENTRY = re.compile(r"^::: ([\w.]+)", re.M)


def _resolve(path):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _public_names():
    import attnlab
    import attnlab.inspect
    from attnlab import ops

    modules = ((attnlab, "attnlab"), (ops, "attnlab.ops"), (attnlab.inspect, "attnlab.inspect"))
    for module, prefix in modules:
        for name in module.__all__:
            yield f"{prefix}.{name}", getattr(module, name)


def _undocumented_members(cls):
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = value.__func__ if isinstance(value, classmethod | staticmethod) else value
        fn = fn.fget if isinstance(fn, property) else fn
        if inspect.isfunction(fn) and not (fn.__doc__ or "").strip():
            yield name


def problems(api_dir):
    """The missing entries and docstrings, one line each."""
    documented = set()
    for page in sorted(pathlib.Path(api_dir).glob("*.md")):
        for path in ENTRY.findall(page.read_text()):
            try:
                documented.add(id(_resolve(path)))
            except (ImportError, AttributeError):
                yield f"{page.name}: '::: {path}' names nothing importable"
    for path, obj in _public_names():
        if id(obj) not in documented:
            yield f"{path} has no '::: ' entry under docs/api/"
        has_own_doc = callable(obj) or inspect.ismodule(obj)  # constants: the page says
        generated = inspect.isclass(obj) and (obj.__doc__ or "").startswith(obj.__name__ + "(")
        if has_own_doc and (generated or not (obj.__doc__ or "").strip()):
            yield f"{path} has no docstring"
        if inspect.isclass(obj):
            for name in _undocumented_members(obj):
                yield f"{path}.{name} has no docstring"


def on_pre_build(config):
    for line in problems(pathlib.Path(config["docs_dir"]) / "api"):
        log.warning(line)
