"""The import graph keeps the architecture's one-way dependencies (read with ast, nothing run):
commands -> engine / parallel / estimate / io / observe; models/ see only the hooks."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE_PACKAGES = (
    "spmd.engine",
    "spmd.parallel",
    "spmd.estimate",
    "spmd.io",
    "spmd.observe",
    "spmd.training",
)
# The middle floor: what the commands share between the command line and the core packages
# (spmd/run/: the parser and resolver of flags and files, the sections made for flags, the run's
# setup, the one builder, the run-level checks, `weights`, which loads a model from a checkpoint or
# a Hugging Face folder and so may import models.family, and generate's `decoding` loop). The
# commands import it; it imports no command, and no core package imports it.
MIDDLE = "spmd.run"
# Top-level modules of spmd/ that run as `python -m spmd.X` or `spmd X` (cli), and the library
# front `api` (a user's program, beside the commands: it ends in the one builder). They sit
# above the middle floor: no core package and nothing in spmd.run imports any of them.
COMMANDS = {
    f"spmd.{m}"
    for m in (
        "__main__ cli train plan convert generate checkpoint bench bench_collectives launch report "
        "data completion api"
    ).split()
}
# The commands themselves: what `spmd COMMAND` runs (spmd.commands's table, read from its source)
# and the dispatcher. What two commands share lives below them (in spmd.run), so that no command
# imports another.
COMMAND_MODULES = {
    node.value
    for node in ast.walk(ast.parse((ROOT / "spmd" / "commands.py").read_text()))
    if isinstance(node, ast.Constant) and str(node.value).startswith("spmd.")
} | {"spmd.cli"}
# What spmd/ may import from models/: the registry and the contract, never a family's own
# module, so that a family registered in models/family.py needs no edit in spmd/; and
# models.finetune, LoRA and peft asked of a family record (its lora_targets, its tensor
# table), which would otherwise sit in the registry as pass-throughs.
SPMD_MAY_IMPORT_FROM_MODELS = {"models", "models.family", "models.contract", "models.finetune"}
# What models/ may import from spmd: the hooks, the exception that means "exit 2", the file
# format the Hugging Face mapping reads, and the shape they describe themselves with.
MODEL_ALLOWED = {
    "spmd.parallel.hooks",
    "spmd.errors",
    "spmd.io.safetensors_io",
    "spmd.model_shape",
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in ("spmd", "models", "meshes"):
        for path in (ROOT / top).rglob("*.py"):
            found[module_name(path)] = path
    return found


def type_checking_imports(tree: ast.Module) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def imports_of(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Project modules that `path` imports anywhere in its body (function-level included),
    except under `if TYPE_CHECKING:`: those are read by the type checker only, never run, so
    they load nothing and cannot make a cycle or an upward arrow at run time. A lower layer may
    name a higher layer's type in an annotation (a `Program`, a `Run`) rather than `Any`."""
    tree = ast.parse(path.read_text())
    for_types_only = type_checking_imports(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in for_types_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports the module when there is one, else the package
            targets = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules)
    return out


GRAPH = {name: imports_of(path, project_modules()) for name, path in project_modules().items()}


def test_graph_covers_the_packages():
    for package in CORE_PACKAGES:
        assert package in GRAPH, package
    assert "spmd.parallel.hooks" in GRAPH and "models.llama" in GRAPH
    assert "spmd.engine.step" in GRAPH["spmd.api"]


def test_models_import_only_the_hooks():
    for name, deps in GRAPH.items():
        if name.startswith("models"):
            core = {d for d in deps if d.startswith("spmd")}
            assert core <= MODEL_ALLOWED, f"{name} imports {sorted(core - MODEL_ALLOWED)}"


def test_no_command_imports_another_command():
    assert {"spmd.train", "spmd.plan", "spmd.bench", "spmd.convert"} <= COMMAND_MODULES
    for name in COMMAND_MODULES:
        bad = GRAPH[name] & (COMMAND_MODULES - {name})
        assert not bad, f"{name} imports the commands {sorted(bad)}"


def test_spmd_imports_no_model_family_module():
    for name, deps in GRAPH.items():
        if name.startswith("spmd"):
            bad = {d for d in deps if d.startswith("models")} - SPMD_MAY_IMPORT_FROM_MODELS
            assert not bad, f"{name} imports {sorted(bad)}: ask models.family instead"


def test_core_packages_import_no_model_and_no_command():
    for name, deps in GRAPH.items():
        if name.startswith(CORE_PACKAGES):
            bad = {
                d
                for d in deps
                if d.startswith(("models", "meshes", MIDDLE + ".")) or d in COMMANDS or d == MIDDLE
            }
            assert not bad, f"{name} imports {sorted(bad)}"


def test_middle_floor_imports_no_command():
    assert {"spmd.run.builder", "spmd.run.config", "spmd.run.run_setup"} <= set(GRAPH)
    assert MIDDLE in PACKAGE_GRAPH["spmd.train"]  # the arrows below mean something
    for name, deps in GRAPH.items():
        if name == MIDDLE or name.startswith(MIDDLE + "."):
            bad = deps & (COMMANDS | COMMAND_MODULES)
            assert not bad, f"{name} imports the commands {sorted(bad)}"


def package_of(module: str) -> str:
    """spmd.engine.step -> spmd.engine; a top-level module (spmd.train, models.llama) is its
    own node."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "spmd" else parts[0]


PACKAGE_GRAPH: dict[str, set[str]] = {}
for _module, _deps in GRAPH.items():
    PACKAGE_GRAPH.setdefault(package_of(_module), set()).update(
        package_of(d) for d in _deps if package_of(d) != package_of(_module)
    )

# Arrows the package order forbids (the lower package may not import the higher one).
FORBIDDEN = {
    "spmd.parallel": {"spmd.engine", "spmd.estimate", "spmd.io", "spmd.observe", "spmd.training"},
    "spmd.engine": {"spmd.estimate", "spmd.io", "spmd.observe", "spmd.training"},
    "spmd.io": {"spmd.engine", "spmd.estimate", "spmd.observe", "spmd.training"},
    "spmd.estimate": {"spmd.io", "spmd.observe", "spmd.training"},
    "spmd.observe": {"spmd.io", "spmd.training"},
    MIDDLE: COMMANDS | COMMAND_MODULES,  # the middle floor: below the commands
    "spmd.log": set(GRAPH) - {"spmd.log"},
    "spmd.sections": set(GRAPH) - {"spmd.sections"},  # the bottom: every package reads it
}
for _package in CORE_PACKAGES:  # ... and above every core package
    FORBIDDEN.setdefault(_package, set()).add(MIDDLE)


def test_packages_import_one_way():
    for package, forbidden in FORBIDDEN.items():
        bad = PACKAGE_GRAPH.get(package, set()) & forbidden
        assert not bad, f"{package} imports {sorted(bad)}"


def test_no_package_cycle():
    assert_acyclic(PACKAGE_GRAPH)


def test_no_import_cycle():
    assert_acyclic(GRAPH)


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_model_shape_sits_at_the_bottom():
    # models/ build it, so it may import nothing from spmd but the errors
    assert GRAPH["spmd.model_shape"] <= {"spmd.errors"}


def test_spmd_asks_the_model_family_instead_of_probing_configs():
    # getattr(cfg, "n_experts", 0) let model knowledge leak into the engine; a model's figures
    # come from models.family (its ModelShape) instead
    import dataclasses

    from models import family

    fields = {f.name for fam in family.FAMILIES.values() for f in dataclasses.fields(fam.config)}
    probes = []
    for path in (ROOT / "spmd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
                continue
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in fields:
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {name.value}")
    assert not probes, f"model config fields probed: {probes}"


def test_architecture_page_names_every_module():
    """docs/architecture.md is where an engineer looks up what a module is for: a module it does
    not name (by its file name's stem, as a word) has no place in the map."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", page))
    modules = sorted(
        path.relative_to(ROOT)
        for package in ("spmd", "models", "meshes")
        for path in (ROOT / package).rglob("*.py")
        if path.stem not in ("__init__", "__main__")
    )
    unnamed = [str(path) for path in modules if path.stem not in named]
    assert not unnamed, f"docs/architecture.md names no {', '.join(unnamed)}"


def test_type_checking_imports_are_not_arrows(tmp_path):
    # an annotation may name a higher layer's type (spmd.training may say `program: Program`)
    # without an arrow: what `if TYPE_CHECKING:` imports never runs
    module = tmp_path / "lower.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import spmd.sections\n"
        "if TYPE_CHECKING:\n"
        "    from spmd.engine.step import Program\n"
        "    import spmd.train\n"
    )
    assert imports_of(module, project_modules()) == {"spmd.sections"}
