"""The architecture rule, checked: imports flow gateway -> common <- worker, never gateway <-> worker."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "gateway": {"worker", "torch"},
    "worker": {"gateway", "litestar", "jinja2"},
    "common": {"gateway", "worker", "launcher", "torch", "zmq", "transformers", "litestar"},
}
# Importing common must stay cheap for both sides: a heavy library may only be imported inside the
# one function that needs it (common.model_source.load_tokenizer imports transformers when called).
LAZY_ALLOWED = {"common": {"transformers"}}


def imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    lazy = LAZY_ALLOWED.get(package, set())
    offenders = {
        f"{path.relative_to(REPO)} imports {bad}"
        for path in (REPO / package).rglob("*.py")
        for bad in (imported_modules(path) & (FORBIDDEN[package] - lazy)) | (imported_modules(path, True) & lazy)
    }
    assert not offenders, sorted(offenders)


def test_zmq_is_confined_to_the_socket_modules():
    users = {
        str(p.relative_to(REPO))
        for pkg in ("gateway", "worker")
        for p in (REPO / pkg).rglob("*.py")
        if "zmq" in imported_modules(p)
    }
    # worker/kv_events.py: the KV-event PUB socket (--kv-events-endpoint), used on the engine thread only, and its
    # replay ROUTER (--kv-events-replay-endpoint), used on its own thread only.
    assert users == {
        "gateway/fleet/worker_client.py",
        "worker/proc.py",
        "worker/gateways.py",
        "worker/handshake.py",
        "worker/kv_events.py",
    }


MAX_LINES = 350
# Modules allowed over the bound until they are split, each with the most lines it may have: none
# now (the last six were split in issue 26). Add one only with a plan to split it.
OVER_THE_BOUND: dict[str, int] = {}


def test_modules_stay_small():
    """A newcomer reads a module in one sitting: about 350 lines at most (C++ kernels aside)."""
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for package in ("gateway", "worker", "common", "launcher")
        for path in (REPO / package).rglob("*.py")
    }
    over = {name: lines for name, lines in sizes.items() if lines > OVER_THE_BOUND.get(name, MAX_LINES)}
    assert not over, f"split these modules (at most {MAX_LINES} lines): {over}"


def gateway_imports() -> dict[str, set[str]]:
    """Each gateway module's gateway imports, by dotted name: every import statement, those under
    ``if TYPE_CHECKING:`` and inside functions included (a type-only circle is a circle too)."""
    modules = {}
    for path in (REPO / "gateway").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                found.add(source)
                found.update(f"{source}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def room(module: str) -> str:
    """The folder a gateway module lives in ('' for the few flat ones)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (REPO / "gateway" / parts[1]).is_dir()) else ""


# Who may import whom among the gateway's rooms: http -> generate -> fleet, with policy, state,
# schemas and ops beside them; the flat modules (config, errors) are for everyone. Schemas are a
# room, not http/schemas: the core reads the bodies' sampling fields, and generate never imports http.
ROOM_IMPORTS = {
    "http": {"generate", "fleet", "policy", "state", "schemas", "ops", "batch"},
    "batch": {"policy", "state"},
    "generate": {"fleet", "policy", "state", "schemas", "ops"},
    "ops": {"fleet", "policy"},
    "fleet": {"state"},
    "policy": {"state"},
    "schemas": set(),
    "state": set(),
    "": {"http"},  # __main__ starts the app
}


def test_gateway_modules_import_no_circle():
    try:
        TopologicalSorter(gateway_imports()).prepare()
    except CycleError as exc:
        pytest.fail(f"gateway modules import each other in a circle: {exc.args[1]}")


def test_gateway_rooms_import_one_way():
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imports in gateway_imports().items()
        for imported in imports
        if room(imported) not in ROOM_IMPORTS[room(module)] | {room(module), ""}
    )
    assert not offenders, offenders


def test_gateway_is_rooms():
    """At most ten modules flat in gateway/, and each folder's __init__ docstring maps its modules."""
    flat = sorted(p.name for p in (REPO / "gateway").glob("*.py"))
    assert len(flat) <= 10, flat
    unmapped = sorted(
        str(path.relative_to(REPO))
        for init in (REPO / "gateway").rglob("__init__.py")
        for path in init.parent.glob("*.py")
        if path.name != "__init__.py" and path.name not in (ast.get_docstring(ast.parse(init.read_text())) or "")
    )
    assert not unmapped, f"name these in their folder's __init__ docstring: {unmapped}"


@pytest.mark.parametrize("room", ["generate", "fleet", "policy"])
def test_the_core_does_not_know_the_web_framework(room):
    """The routes hand the core a ``Caller`` (gateway/policy/caller.py), not Litestar's request."""
    users = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "gateway" / room).rglob("*.py")
        if "litestar" in imported_modules(path)
    )
    assert not users, users
