"""Process-wide state is listed in one registry (statereg/process_state.py), each entry with
its reason, and `statereg.clear_process_state()` clears every cache a real save and load
filled. A module-level cache, pool or remembered answer that is not registered fails here,
and so does one the "Process-wide state" section of docs/design.md does not name."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import textwrap
from pathlib import Path

import fsspec
import torch

import statereg
from statereg import process_state

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "statereg"

# Module-level names the scan flags that are not process-wide state to register.
NOT_STATE = {
    # the registry itself
    "statereg.process_state._ENTRIES": "the registry of process-wide state",
}
# Calls whose result is a container or cache object that lives as long as the module.
_CONTAINERS = {"dict", "set", "list", "defaultdict", "OrderedDict", "deque", "Counter",
               "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local"}
_MUTATORS = {"add", "append", "extend", "insert", "update", "setdefault", "pop", "popitem",
             "remove", "discard", "clear"}


def _called(node: ast.expr) -> str | None:
    """The last name of a call's function (`threading.local()` -> 'local')."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def module_state(source: str) -> set[str]:
    """Names of a module's process-wide state, by its source: module-level containers that
    start empty or are changed by the module's functions, instances of its own classes,
    functools caches, and names its functions rebind with `global`."""
    tree = ast.parse(source)
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found: set[str] = set()
    literals: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any("cache" in ast.unparse(d) for d in node.decorator_list):
                found.add(node.name)
            continue
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = node.value
        if isinstance(value, (ast.Dict, ast.Set, ast.List)):
            empty = not (value.keys if isinstance(value, ast.Dict) else value.elts)
            (found if empty else literals).update(names)
        elif _called(value) in _CONTAINERS | classes:
            found.update(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in literals):
            found.add(node.value.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name)
              and node.func.value.id in literals):
            found.add(node.func.value.id)
    return found


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _import_everything() -> None:
    for info in pkgutil.walk_packages(statereg.__path__, "statereg."):
        if not info.name.endswith(".__main__"):  # those run the CLI
            importlib.import_module(info.name)


def test_the_scan_finds_every_kind_of_module_level_cache():
    source = textwrap.dedent("""
        import functools, threading, weakref
        from collections import defaultdict
        TABLE = {"a": 1}             # a constant table: not state
        NAMES = ["a", "b"]           # not state
        GROWN = {"a": 1}             # changed below: state
        _seen = set()
        _plans: dict[str, int] = {}
        _by_key = defaultdict(list)
        _weak = weakref.WeakKeyDictionary()
        _local = threading.local()
        _lock = threading.Lock()     # a lock holds nothing
        _flag = None

        class _Pool:
            pass

        _POOL = _Pool()

        @functools.cache
        def _probe(): ...

        def use(key):
            global _flag
            _flag = True
            GROWN[key] = 2
            NAMES.index("a")
    """)

    assert module_state(source) == {"GROWN", "_seen", "_plans", "_by_key", "_weak", "_local",
                                    "_flag", "_POOL", "_probe"}


def test_no_module_level_cache_is_left_unregistered():
    _import_everything()
    registered = {entry.name for entry in process_state.registered()}

    missing = [f"{module}.{name}" for module, path in _modules()
               for name in sorted(module_state(path.read_text()))
               if f"{module}.{name}" not in registered | NOT_STATE.keys()]

    assert not missing, (
        "module-level state not registered: register each where it is defined with "
        "process_wide(__name__, name, reason) (statereg/process_state.py) and list it in "
        f"docs/design.md, 'Process-wide state': {missing}")


def test_every_entry_is_live_state_with_a_reason_and_named_in_the_design():
    _import_everything()
    design = (REPO / "docs" / "design.md").read_text().split("## Process-wide state", 1)[1]
    entries = process_state.registered()

    assert len(entries) >= 20
    for entry in entries:
        assert len(entry.reason.split()) >= 4, entry
        if entry.clear is None:  # cleared by its kind: the module holds it
            entry.current()
        assert f"`{entry.name.removeprefix('statereg.')}`" in design, entry.name


def test_clearing_empties_the_caches_a_save_and_load_filled(make_spec, make_model, tmp_path):
    from statereg.backends import kernel, registry
    from statereg.dcp import codec, metadata, reader
    from statereg.dcp.torchsave import crc_stream, read, templates

    spec = make_spec("model", "optimizer", storage={"compression": "zstd"})
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    mgr = statereg.CheckpointManager(spec, model=model, optimizer=optimizer)
    mgr.save(step=1)
    mgr.load()
    memory = registry.open_backend(f"memory://{tmp_path.name}")
    memory.write_bytes("probe", b"x")
    filled = {"load plans": reader._load_plans, "checked .metadata": metadata._checked_digests,
              "walks": read._walks, "templates": templates._templates,
              "fsspec": type(memory.fs)._cache}
    assert all(filled.values()), filled
    assert kernel.in_memory.cache_info().currsize and crc_stream._checked is True
    assert codec._local.compressors  # this thread's zstd compressors
    backends = dict(registry._BACKENDS)

    cleared = statereg.clear_process_state()

    assert not any(filled.values()), filled
    assert not kernel.in_memory.cache_info().currsize
    assert crc_stream._checked is None and not hasattr(codec._local, "compressors")  # asked anew
    assert reader._load_plans is filled["load plans"]  # cleared in place, not replaced
    assert "statereg.dcp.reader._load_plans" in cleared
    kept = {entry.name for entry in process_state.registered() if entry.kept}
    assert "statereg.engine.claims._ACTIVE" in kept and not kept & set(cleared)
    assert backends == registry._BACKENDS  # kept: what was registered stays
    # Everything is rebuilt on first use: the same checkpoint loads into fresh objects.
    fresh = make_model(seed=1)
    statereg.CheckpointManager(spec, model=fresh,
                               optimizer=torch.optim.AdamW(fresh.parameters())).load()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values(), strict=True))
    assert memory.read_bytes("probe") == b"x"  # memory:// data is no cache
    assert fsspec.filesystem("memory").store is type(memory.fs).store


def test_a_bytes_bounded_cache_forgets_everything_past_its_bound_and_clear_resets_the_count():
    from statereg.process_state import BytesBounded

    cache = BytesBounded()
    for key in range(3):
        cache.keep(key, str(key), 40, bound=100)
    assert dict(cache) == {2: "2"} and cache.held == 40  # the third would pass 100
    cache.clear()  # as clear_process_state clears it
    assert cache == {} and cache.held == 0
    cache.keep("a", 1, 100, bound=100)
    assert dict(cache) == {"a": 1}
