"""Every import path the docs name resolves: a module move that breaks a documented path fails
here, not in a user's code.

The paths are read from README.md and docs/**/*.md, in code blocks and inline code: `from
statereg.x import y` (y must be importable from statereg.x), `import statereg.x`, and dotted
names `statereg.a.b.C` (the longest importable module, then attributes). File names
(`statereg.yaml`, `statereg.schema.json`), the codec descriptor `statereg.planes/2` and
attributes that merely end in `.statereg` (`trainer.statereg.latest()`) are not paths.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
FROM_IMPORT = re.compile(
    r"^\s*from\s+(statereg(?:\.\w+)*)\s+import\s+(?:\(([^)]*)\)|([^\n#]*))", re.M)
IMPORT = re.compile(r"^\s*import\s+(statereg(?:\.\w+)*)", re.M)
DOTTED = re.compile(r"(?<![\w.])(statereg(?:\.[A-Za-z_]\w*)+)(?![\w/])")
NOT_PATHS = {"yaml", "yml", "json", "toml", "md", "py"}


def _code(text: str) -> list[str]:
    """The code blocks of a markdown text, and the inline code of its prose."""
    return [*FENCE.findall(text), *INLINE.findall(FENCE.sub("", text))]


def documented_paths() -> dict[str, str]:
    """Each documented dotted path, with the first file that names it."""
    found: dict[str, str] = {}
    for doc in DOCS:
        where = str(doc.relative_to(REPO))
        for code in _code(doc.read_text()):
            for match in FROM_IMPORT.finditer(code):
                names = (match.group(2) or match.group(3) or "").replace("\\", " ")
                for name in names.split(","):
                    name = name.strip().split(" as ")[0].strip()
                    if name.isidentifier():
                        found.setdefault(f"{match.group(1)}.{name}", where)
            for match in IMPORT.finditer(code):
                found.setdefault(match.group(1), where)
            for match in DOTTED.finditer(code):
                path = match.group(1)
                if path.rsplit(".", 1)[1] not in NOT_PATHS:
                    found.setdefault(path, where)
    return found


PATHS = documented_paths()


def resolve(path: str) -> object:
    """Import the longest module prefix of `path`, then take the rest as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but something it imports does not
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(path)


def test_the_docs_name_paths() -> None:
    # The extraction itself works: these are documented in more than one place.
    assert {"statereg.load_spec", "statereg.CheckpointManager",
            "statereg.dcp.codec.extension_registry"} <= set(PATHS)
    assert not {p for p in PATHS if p.endswith((".yaml", ".json"))}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_documented_path_imports(path: str) -> None:
    try:
        resolve(path)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{PATHS[path]} names {path}, which does not resolve: "
                    f"{type(exc).__name__}: {exc}")
