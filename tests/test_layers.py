"""The package's layering, read from its source: no import circles, and nothing below the
algorithms imports them.

The engine's primitives (seeding, the round contract, the losses) live below the algorithms,
which stand on them; the registry loads the algorithm modules by name. An import that climbs
back up (a lower layer importing ``fedhpc.algorithms``) or closes a circle fails here, with
the chain that does it.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fedhpc")


def _modules():
    """module name -> (path, is_package) for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, fn), os.path.dirname(ROOT))[:-3].split(os.sep)
            is_pkg = rel[-1] == "__init__"
            name = ".".join(rel[:-1] if is_pkg else rel)
            found[name] = (os.path.join(folder, fn), is_pkg)
    return found


MODULES = _modules()


def _type_checking(node):
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name, module_level_only):
    """The fedhpc modules that ``name`` imports: at module level (what runs when it is imported:
    top-level statements, also inside top-level try/if, not under TYPE_CHECKING), or anywhere."""
    path, is_pkg = MODULES[name]
    tree = ast.parse(open(path).read(), path)
    package = name if is_pkg else name.rpartition(".")[0]

    def walk(body):
        for node in body:
            if _type_checking(node):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif module_level_only:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    if isinstance(node, (ast.If, ast.Try, ast.With)) or (field == "handlers" and isinstance(node, ast.Try)):
                        yield from walk(getattr(node, field, []) or [])
            else:
                for child in ast.iter_child_nodes(node):
                    yield from walk([child])

    out = set()
    for node in walk(tree.body if module_level_only else [tree]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
        for t in targets:
            if t in MODULES:
                out.add(t)
    # a module's own packages are imported before it, whatever it says: no edge of its own
    return {m for m in out if m != name and not name.startswith(m + ".")}


def _cycle(graph):
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_the_package():
    assert {"fedhpc.engine", "fedhpc.algorithms", "fedhpc.algorithms.base", "fedhpc.round"} <= MODULES.keys()
    assert "fedhpc.round" in _imports("fedhpc.engine", True)  # the reader finds imports at all


@pytest.mark.parametrize("module_level_only", [True, False], ids=["at_import", "anywhere"])
def test_no_import_circle(module_level_only):
    """At import time (module-level imports: a circle there can fail with a half-made module),
    and anywhere (an import inside a function too: a circle there is a lower layer reaching up,
    which the next module-level import turns into the first kind). A module's own packages are
    imported before it, which adds no edge of its own here."""
    graph = {m: _imports(m, module_level_only) for m in MODULES}
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("fedhpc.algorithms")))
def test_nothing_below_the_algorithms_imports_them(module):
    """Anywhere in the file, functions included. The registry (fedhpc.registry) finds the
    algorithm modules by name; what the engine and its primitives share lives in fedhpc.round,
    fedhpc.seeding and fedhpc.losses."""
    upward = sorted(m for m in _imports(module, module_level_only=False) if m.startswith("fedhpc.algorithms"))
    assert not upward, f"{module} imports {upward}: move what it needs below the algorithms"


def test_the_methods_old_import_paths_give_their_family_modules():
    """Scripts and older checkpoints name ``fedhpc.algorithms.<method>``: each resolves to the
    module in its family folder (the same object, so a patch through either name holds)."""
    import importlib
    import pickle

    import fedhpc.algorithms as algorithms

    for old, new in algorithms.MOVED.items():
        assert importlib.import_module(f"fedhpc.algorithms.{old}") is importlib.import_module(f"fedhpc.algorithms.{new}")
    from fedhpc.algorithms.fedmix import FedMix  # noqa: F401 - the import itself is the check
    from fedhpc.algorithms.personal import PersonalAlgorithm, split_layers  # noqa: F401
    from fedhpc.algorithms.oneshot import EncodingOptions
    # a class pickled under its old module path (as an older checkpoint holds it) loads
    blob = pickle.dumps(EncodingOptions(), protocol=0).replace(b"fedhpc.algorithms.oneshot.base", b"fedhpc.algorithms.oneshot")
    assert pickle.loads(blob) == EncodingOptions()
