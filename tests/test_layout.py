"""The package's shape: docs/ARCHITECTURE.md names every module, and the package's imports form no circle."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_lowprec"


def modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (``__init__`` files as their package)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports at module level (what runs on import, where circles break)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def test_architecture_doc_names_every_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py|[\w/]+/)`", doc))
    for name, path in modules().items():
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            assert rel.rsplit("/", 1)[0] + "/" in named or any(n.startswith(rel.rsplit("/", 1)[0] + "/") for n in named), name
        elif path.name != "__init__.py":
            assert rel in named, f"docs/ARCHITECTURE.md does not name {rel}"


def test_module_level_imports_form_no_circle():
    known = modules()
    graph = {name: imports_of(path, set(known)) - {name} for name, path in known.items()}
    for name in graph:  # a submodule import runs its packages' __init__ first
        graph[name] |= {p for m in list(graph[name]) for p in _parents(m) if p in known and p != name and not name.startswith(p + ".")}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _imported_top_level_modules() -> set[str]:
    """Top-level modules imported anywhere in the package and the CLI (function-local imports included)."""
    found = set()
    for path in [*Path("hf_lowprec").rglob("*.py"), *Path("cli").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"hf_lowprec", "__future__"}


def test_dependencies_are_declared_used_and_ranges():
    import importlib.metadata
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the test extra's tomli, the same parser
        import tomli as tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    required = project["dependencies"]
    extras = [d for group in project["optional-dependencies"].values() for d in group]
    name = lambda spec: re.split(r"[<>=~!\[ ;]", spec, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    declared = {name(d) for d in required + extras}
    dists = importlib.metadata.packages_distributions()
    imported = {dist.lower().replace("_", "-") for module in _imported_top_level_modules() for dist in dists.get(module, [module])}
    assert imported <= declared, f"imported but not declared: {sorted(imported - declared)}"
    imported |= {"jinja2"}  # used through huggingface_hub's ModelCard.from_template (our card template)
    assert {name(d) for d in required} <= imported, f"declared but never imported: {sorted({name(d) for d in required} - imported)}"
    assert not [d for d in required if "==" in d], "library dependencies take ranges; exact pins go to constraints.txt"
    pins = dict(line.split("==") for line in Path("constraints.txt").read_text().splitlines() if "==" in line)
    assert {name(d) for d in required} <= {k.lower().replace("_", "-") for k in pins}  # the tested set is pinned


@pytest.mark.parametrize("first", ["", "import transformers.modeling_utils; "])
def test_each_entry_point_imports_first_in_a_fresh_interpreter(first):
    """transformers' modeling_utils import hook registers the quantizer: a module-level ``from transformers import
    PreTrainedModel`` in it made ``from hf_lowprec import HfLowprecConfig`` fail in a fresh interpreter."""
    for statement in ("from hf_lowprec import HfLowprecConfig", "import hf_lowprec.export.hf_quantizer"):
        done = subprocess.run([sys.executable, "-c", first + statement], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
