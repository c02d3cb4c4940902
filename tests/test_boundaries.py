"""Import boundaries: the daemon never imports torch; the client never imports the daemon; no import cycles."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

import actcache
import actcache_client


def _modules_after_import(*modules: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_daemon_and_cli_never_import_torch():
    loaded = _modules_after_import("actcache.cli", "actcache.daemon.service._server", "actcache.testing", "actcache.rpc_client")
    assert "torch" not in loaded
    assert not any(m.startswith("actcache_client") for m in loaded)


@pytest.mark.slow
def test_client_never_imports_daemon_internals():
    loaded = _modules_after_import("actcache_client", "actcache_client.data._loader",
                                   "actcache_client.engine._cached_forward")
    assert not any(m.startswith("actcache.daemon") for m in loaded), sorted(m for m in loaded if m.startswith("actcache"))


def _public_modules() -> list[str]:
    names = []
    for package in (actcache, actcache_client):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return sorted(names + ["actcache_client"])


@pytest.mark.parametrize("module", _public_modules())
def test_public_surface_is_explicit_and_sorted(module):
    mod = importlib.import_module(module)
    assert list(mod.__all__) == sorted(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name}"


_LAYERS = ["store", "prefetch", "service"]  # each may import only the ones before it


@pytest.mark.parametrize("layer", _LAYERS)
def test_daemon_layers_import_only_downwards(layer):
    above = [f"actcache.daemon.{name}" for name in _LAYERS[_LAYERS.index(layer) + 1 :]]
    folder = Path(actcache.__file__).parent / "daemon" / layer
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not any(name == a or name.startswith(a + ".") for a in above), \
                    f"{path.name} (layer {layer}) imports {name}, a layer above it"


def _module_files() -> dict[str, Path]:
    """Every module of actcache and actcache_client by dotted name (a package by its __init__.py)."""
    modules = {}
    for package in (actcache, actcache_client):
        folder = Path(package.__file__).parent
        for path in folder.rglob("*.py"):
            parts = [package.__name__, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file (module or function level,
    absolute or relative); ``from package import name`` counts the submodule ``name`` if there is one,
    else the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


# The client's rooms, each importing only the ones before it: "api" is the top level (the user API and the
# public modules outside the rooms), cost_model the arithmetic below them all.
_ROOMS = ["cost_model", "transport", "layouts", "engine", "data", "freeze", "api", "integrations"]


def _room(module: str) -> str:
    """The room of a module of actcache_client."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in _ROOMS else "api"


def test_client_rooms_are_the_client_packages():
    folder = Path(actcache_client.__file__).parent
    packages = {p.parent.name for p in folder.glob("*/__init__.py")}
    assert packages | {"cost_model", "api"} == set(_ROOMS)
    assert (folder / "cost_model.py").exists()


@pytest.mark.parametrize("room", _ROOMS)
def test_client_rooms_import_only_downwards(room):
    above = set(_ROOMS[_ROOMS.index(room) + 1 :])
    modules = _module_files()
    upward = []
    for module, path in sorted(modules.items()):
        if module.startswith("actcache_client") and _room(module) == room:
            upward += [f"{module} imports {name}" for name in sorted(_imported(module, path, modules))
                       if name.startswith("actcache_client") and _room(name) in above]
    assert not upward, f"room {room} imports a room above it:\n" + "\n".join(upward)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through the first module of each strongly connected component of ``graph``
    with more than one module (Tarjan's algorithm), as ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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
            visit(node)
    cycles = []
    for component in sorted(components):
        start, members = component[0], set(component)
        previous: dict[str, str] = {}
        queue = deque([start])
        while queue:  # breadth first inside the component, back to start
            node = queue.popleft()
            if start in graph[node]:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                cycles.append([*reversed(path), start])
                break
            for nxt in sorted(graph[node] & members):
                if nxt not in previous and nxt != start:
                    previous[nxt] = node
                    queue.append(nxt)
    return cycles


def test_import_cycle_finder_finds_each_cycle():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}, "f": {"a"}}
    assert import_cycles(graph) == [["a", "b", "a"], ["d", "e", "d"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = _module_files()
    graph = {module: _imported(module, path, modules) for module, path in modules.items()}
    assert graph["actcache_client.data._loader"] >= {"actcache_client.data._identity",
                                                     "actcache_client.engine._cached_forward"}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_two_packages_public_names_are_pinned():
    # A change here is a change of the public API: update the README and say so in the commit.
    assert actcache.__all__ == [
        "ActCacheError", "BudgetExceeded", "CacheMismatchError", "ConfigError", "ConfigTypeError", "DaemonUnavailable",
        "EntryCorrupt", "FetchAborted", "InvalidRequest", "LifecycleError", "NamespaceNotFound", "PermissionDenied",
        "PolicyError", "ReferenceModelFailed", "ScheduleNotFound", "StoreError", "Unauthenticated", "VersionMismatch",
        "__version__",
    ]
    assert actcache_client.__all__ == [
        "ActCache", "AuditConfig", "AutoEncoding", "AutoFreezeConfig", "AutoFreezePolicy", "Batch", "CacheFallbackWarning",
        "CacheMismatchWarning", "CacheOptions", "CachePlanner", "CachedForward", "CachedLoader", "CachedTeacher",
        "ChangedInputWarning", "ClientStats", "Connection", "ConnectionConfig", "Decision", "DecisionKind", "EgeriaConfig",
        "EgeriaPolicy", "EpochCounters", "FreezeController", "FreezeMilestone", "FreezePolicy", "IndexedDataset", "Layout",
        "ManualPolicy", "MovingTeacherWarning", "NodeStableSampler", "PlannerConfig", "ReferenceConfig", "Signals", "Stage",
        "StageInfo", "StagedModel",
        "StaticPolicy", "StepTimes", "TeacherOutput", "UncacheableDataWarning", "VarLen", "WrappedLoader", "auto_partition",
        "connect", "distillation_loss", "from_bert", "from_resnet", "from_sequential", "register_layout", "topk_soft_targets",
    ]
    # every error class actcache raises is reachable from the top package
    errors = [getattr(actcache, n) for n in actcache.__all__ if n != "__version__"]
    assert all(issubclass(e, actcache.ActCacheError) for e in errors)


# Raises of builtin exceptions that never leave actcache: caught and turned into ConfigError by
# the config builder (its value parsers), or generated code.
_INTERNAL_RAISES = {"actcache/daemon/config.py": 2, "actcache/codec.py": 1, "actcache/_proto/actcache_pb2_grpc.py": 1}


def test_every_error_actcache_raises_is_an_actcache_error():
    import re

    root = Path(actcache.__file__).parent.parent
    counts = {}
    for path in [*root.joinpath("actcache").rglob("*.py"), *root.joinpath("client", "actcache_client").rglob("*.py")]:
        found = re.findall(r"raise (ValueError|RuntimeError|TypeError|KeyError)\(", path.read_text())
        if found:
            counts[str(path.relative_to(root))] = len(found)
    assert counts == _INTERNAL_RAISES
