"""The layout holds (docs/design/index.md (Shape)): no import circle in shim/, bench/ or testbed/,
between modules nor between the packages of shim/, gRPC only at its seams, the upstream client only
in the daemon's top (server, engine, operations, live migration), the podshim-runc hook process
free of the daemon, and the protocols the mechanisms declare satisfied by the upstream client.

Every import counts, one in a function or under TYPE_CHECKING too: a circle hidden in a function
is still a circle of the design."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "shim"
PACKAGES = ("shim", "bench", "testbed")

# Circles known and left for later, each with the reason; the test fails on any other circle and
# when one of these is gone (then remove it here).
LEFT_FOR_LATER: dict[frozenset[str], str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The dotted names `path` imports, relative imports resolved: `from a import b` gives a.b when
    that is a module of ours, else a (the package a submodule lies in is not counted: Python runs its
    __init__ first, but that is the package's frame, not a dependency of the design)."""
    names: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package[: len(package) - node.level + 1]
                base = ".".join([*above, base] if base else above)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    names.add(sub)
                elif _owner(base):  # a name defined in a module of ours
                    names.add(base)
                else:  # another package's: both, as the seams' checks read them
                    names.update((base, sub))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _owner(name: str) -> str | None:
    """The module of ours `name` is or lies in (a.b.c -> a.b when a.b is a module and c a name in it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {_owner(n) for n in _imported(module, path)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


GRAPH = _graph()


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for t in targets:
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    on_stack.add(t)
                    work.append((t, iter(sorted(graph[t]))))
                    break
                if t in on_stack:
                    low[node] = min(low[node], index[t])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.add(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert _circles(graph) == [frozenset("abc")]
    assert _owner("shim.archive.dirfd.DirHandle") == "shim.archive.dirfd"
    assert "shim.errors" in GRAPH["shim.archive.fsutil"]
    # an import in a function counts: the doctor imports the RPC client only where it calls
    assert "shim.rpc_client" in GRAPH["shim.node.doctor"]
    assert _package("shim.cli.commands.doctor") == "shim.cli" and _package("shim.config") == "shim.config"
    assert _package("testbed.bed") == "testbed"


def _describe(circle: frozenset[str]) -> str:
    return "; ".join(f"{m} -> {sorted(GRAPH[m] & circle)}" for m in sorted(circle))


def test_no_import_circle() -> None:
    circles = _circles(GRAPH)
    new = [_describe(c) for c in circles if c not in LEFT_FOR_LATER]
    assert not new, "import circles (break each: move what both need below both):\n" + "\n".join(new)
    gone = [sorted(c) for c in LEFT_FOR_LATER if c not in circles]
    assert not gone, f"no longer circles, remove them from LEFT_FOR_LATER: {gone}"


def _package(module: str) -> str:
    """The package of shim/ a module lies in (shim.cli for shim.cli.commands.doctor; a module at
    shim/'s top is its own), or the top package of bench/ and testbed/."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "shim" else parts[0]


def test_no_package_circle() -> None:
    """No two packages import each other, through any of their modules: two modules free of a
    circle can still tie their packages' layers together (shim/cli/ runs the doctor of shim/node/,
    so the RPC client both call through lies below both, in shim/rpc_client.py)."""
    graph: dict[str, set[str]] = {_package(m): set() for m in GRAPH}
    for module, targets in GRAPH.items():
        graph[_package(module)] |= {_package(t) for t in targets} - {_package(module)}
    circles = _circles(graph)
    where = [
        f"{m} -> {t}"
        for c in circles
        for m in sorted(GRAPH)
        if _package(m) in c
        for t in sorted(GRAPH[m])
        if _package(t) in c and _package(t) != _package(m)
    ]
    assert not circles, "package circles (move what both need below both):\n" + "\n".join(where)


def _paths_importing(*roots: str) -> dict[Path, list[str]]:
    """The modules of shim/ that import `roots` (dotted; `grpc` means grpc and grpc.*)."""
    out = {}
    for module, path in MODULES.items():
        if not module.startswith("shim."):
            continue
        names = _imported(module, path)
        hits = sorted(n for n in names if any(n == r or n.startswith(r + ".") for r in roots))
        if hits:
            out[path.relative_to(ROOT)] = hits
    return out


def test_grpc_only_at_its_seams() -> None:
    """gRPC is imported by the daemon's seams (shim/server, shim/upstream), by the client's of the
    commands that call a runtime (shim/rpc_client.py: the CLI, the doctor) and the CLI's own
    (shim/cli/transport.py) only: the operations, mechanisms and commands know none of it."""
    seams = ("shim/server/", "shim/upstream/", "shim/rpc_client.py", "shim/cli/transport.py")
    found = _paths_importing("grpc", "api.runtime.v1.api_pb2_grpc")
    bad = {str(p): names for p, names in found.items() if not str(p).startswith(seams)}
    assert not bad, bad


def test_the_upstream_client_only_in_the_daemons_top() -> None:
    """The server, the engine and the operations (shim/ops, the live migration's source and
    destination, and the cluster API's controller, shim/kube) hold the upstream client; the
    mechanisms below them (the pod view, the checks, ...) declare the calls they make as a protocol."""
    holders = (
        "shim/server/",
        "shim/upstream/",
        "shim/ops/",
        "shim/migration/",
        "shim/kube/",
        "shim/engine.py",
    )
    found = _paths_importing("shim.upstream")
    bad = {str(p): names for p, names in found.items() if not str(p).startswith(holders)}
    assert not bad, bad


def _reached(start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for t in GRAPH[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_hook_process_never_loads_the_daemon() -> None:
    """podshim-runc-hook (shim/wrapper/) runs apart from podshim: nothing it imports, however
    deep, is the daemon's (docs/design/runtime-wrapper.md (The runtime wrapper))."""
    daemon = (
        "shim.ops",
        "shim.migration",
        "shim.engine",
        "shim.server",
        "shim.upstream",
        "shim.cli",
        "shim.checks",
    )
    bad = sorted(m for m in _reached("shim.wrapper.main") if m.startswith(daemon))
    assert not bad, f"podshim-runc-hook loads the daemon's {bad}"


def _protocols() -> list[tuple[type, type]]:
    from shim.checks.wiring import RuntimeCalls
    from shim.engine import Engine
    from shim.sandbox.images import ImageSource
    from shim.sandbox.view import PodSource
    from shim.server.runtime import Engine as EngineProtocol
    from shim.upstream import Upstream

    return [
        (PodSource, Upstream),
        (ImageSource, Upstream),
        (RuntimeCalls, Upstream),
        (EngineProtocol, Engine),
    ]


def _members(cls: type) -> dict[str, object]:
    names = {n for klass in cls.__mro__ if klass is not object for n in vars(klass)}
    hints = {n for klass in cls.__mro__ for n in getattr(klass, "__annotations__", {})}
    return {n: getattr(cls, n, None) for n in names | hints if not n.startswith("_")}


@pytest.mark.parametrize(
    ("protocol", "impl"), _protocols(), ids=lambda c: c.__name__ if isinstance(c, type) else str(c)
)
def test_protocols_are_satisfied(protocol: type, impl: type) -> None:
    """Each protocol a layer declares for the one below (no type checker runs here): every method
    exists with the protocol's parameters (names and kinds; defaults where the protocol names
    one) and every attribute is declared."""
    have = _members(impl)
    for name, member in _members(protocol).items():
        assert name in have, f"{impl.__name__} lacks {protocol.__name__}.{name}"
        if not callable(member) and not isinstance(member, property):
            continue
        if isinstance(member, property):
            assert isinstance(have[name], property), name
            continue
        want = inspect.signature(member).parameters
        got = inspect.signature(have[name]).parameters  # type: ignore[arg-type]
        for pname, p in want.items():
            assert pname in got, f"{impl.__name__}.{name} lacks parameter {pname}"
            where = f"{impl.__name__}.{name}({pname})"
            assert got[pname].kind == p.kind, f"{where}: {got[pname].kind} != {p.kind}"
            if p.default is not inspect.Parameter.empty and p.default is not Ellipsis:
                assert got[pname].default == p.default, f"{where}: default"
            if p.default is not inspect.Parameter.empty:
                assert got[pname].default is not inspect.Parameter.empty, f"{where}: no default"
