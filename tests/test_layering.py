"""The package's layering rules (docs/DESIGN.md, "Package layout"), read from the source.

Every ``import`` of ``megatron_gndpo`` counts, at module level or inside a function (a deferred
import is still a dependency) or under ``if TYPE_CHECKING:`` (a type a module names is a
dependency of its design, even when it is not imported at run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gndpo"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports (``from a import b``: ``a.b`` when a module)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "megatron_gndpo"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "megatron_gndpo":
                continue
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.add(child if child in modules else node.module)
    return out - {_module_name(path)}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


GRAPH = _graph()


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _under(m, source)
        for t in targets
        if any(_under(t, f) for f in forbidden)
    )


def test_the_graph_is_read() -> None:
    assert "megatron_gndpo.methods.base" in GRAPH["megatron_gndpo.methods"]
    assert "megatron_gndpo.engine.update" in GRAPH["megatron_gndpo.trainer"]
    # an import under TYPE_CHECKING counts
    assert "megatron_gndpo.config.schema" in GRAPH["megatron_gndpo.logging.throughput"]


def test_algorithms_import_no_engine_config_loop_or_compat() -> None:
    forbidden = tuple(
        f"megatron_gndpo.{name}"
        for name in ("engine", "config", "checks", "trainer", "compat", "methods", "cli")
    )
    assert _violations("megatron_gndpo.algorithms", forbidden) == []


def test_config_is_a_leaf() -> None:
    """``config/`` imports nothing of the package but the error types."""
    others = sorted(
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if _under(m, "megatron_gndpo.config")
        for t in targets
        if not _under(t, "megatron_gndpo.config") and t != "megatron_gndpo.errors"
    )
    assert others == []


def test_nothing_imports_the_cli_and_only_entry_points_import_the_trainer() -> None:
    assert [m for m, targets in GRAPH.items() if "megatron_gndpo.cli" in targets] == []
    users = {m for m, targets in GRAPH.items() if "megatron_gndpo.trainer" in targets}
    entry_points = ("megatron_gndpo.demo", "megatron_gndpo.compress")
    assert {m for m in users if not any(_under(m, e) for e in entry_points)} <= {
        "megatron_gndpo.cli"
    }


def test_only_the_trainer_imports_the_composition_root() -> None:
    """``components.py`` builds everything; nothing it builds reaches back for it."""
    users = {m for m, targets in GRAPH.items() if "megatron_gndpo.components" in targets}
    assert users <= {"megatron_gndpo.trainer"}, sorted(users)


# What each floor may not reach up to: the runtime top (trainer, evaluation, both models'
# passes, the composition root) and the floors above it.
_TOP = (
    "megatron_gndpo.trainer", "megatron_gndpo.components", "megatron_gndpo.evaluation",
    "megatron_gndpo.scorer", "megatron_gndpo.cli", "megatron_gndpo.demo", "megatron_gndpo.prune",
    "megatron_gndpo.compress",
)  # fmt: skip


def test_engine_keeps_to_scoring_and_the_update() -> None:
    """``engine/`` (scoring, the update, the optimizer) knows no method, check, teacher or
    rollout engine: they call it, never the reverse."""
    forbidden = (
        "megatron_gndpo.methods", "megatron_gndpo.checks", "megatron_gndpo.teacher",
        "megatron_gndpo.rollout", *_TOP,
    )  # fmt: skip
    assert _violations("megatron_gndpo.engine", forbidden) == []


def test_the_teacher_package_never_imports_the_trainer_or_the_methods() -> None:
    forbidden = ("megatron_gndpo.methods", *_TOP)
    assert _violations("megatron_gndpo.teacher", forbidden) == []


def test_models_rollout_and_weight_sync_import_nothing_above_them() -> None:
    """The floors the engine stands on: no scoring or update (``engine/``), no teacher, method
    or config check; what they need from above is handed in (e.g. the weight-sync probe)."""
    forbidden = (
        "megatron_gndpo.engine", "megatron_gndpo.teacher", "megatron_gndpo.methods",
        "megatron_gndpo.checks", *_TOP,
    )  # fmt: skip
    for floor in (
        "models",
        "rollout",
        "weight_sync",
        "checkpoint",
        "parallel",
        "data",
        "algorithms",
    ):
        assert _violations(f"megatron_gndpo.{floor}", forbidden) == [], floor


def test_methods_import_no_trainer_checks_or_cli() -> None:
    forbidden = ("megatron_gndpo.trainer", "megatron_gndpo.checks", "megatron_gndpo.cli")
    assert _violations("megatron_gndpo.methods", forbidden) == []


def _a_circle() -> list[str]:
    """One import circle of the package (depth-first search), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH.get(node, set())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(GRAPH):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_no_import_circles() -> None:
    assert _a_circle() == []


def test_no_benchmark_imports_another() -> None:
    """Benchmarks share code through the package (or ``benchmarks/common.py``), never by
    importing each other."""
    folder = PACKAGE.parent / "benchmarks"
    scripts = {p.stem for p in folder.glob("*.py")} - {"common"}
    found = []
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            found += [f"{path.name} imports {n}" for n in names if n in scripts]
    assert found == []


def test_training_code_never_imports_the_real_model_fetch() -> None:
    """The real-model tier's fetch and GGUF reader are for the fetch script, tests and
    benchmarks (real/fetch.py): no package module but each other imports them."""
    fetch = {"megatron_gndpo.real", "megatron_gndpo.real.fetch", "megatron_gndpo.real.gguf_to_hf"}
    users = {m for m, targets in GRAPH.items() if targets & fetch}
    assert users <= fetch, sorted(users - fetch)
    assert "megatron_gndpo.real.gguf_to_hf" in GRAPH["megatron_gndpo.real.fetch"]


def test_parallel_never_imports_the_job_lifecycle() -> None:
    """``job/`` (watchdog, forced exit, run lock) builds on ``parallel/``, not the reverse."""
    assert _violations("megatron_gndpo.parallel", ("megatron_gndpo.job",)) == []
