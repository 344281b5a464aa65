"""The package's layers: every import, at module level or inside a function, goes to the same or a lower
layer, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import moerl
from tests import REPO

ROOT = Path(moerl.__file__).parent
# Lowest first. A module imports from its own layer or lower ones.
LAYERS = [
    {
        "moerl",
        "moerl.errors",
        "moerl.env",
        "moerl.choices",
        "moerl.dtypes",
        "moerl.fp8",
        "moerl.files",
        "moerl.layout",
        "moerl.plugins",
        "moerl.sample",
        "moerl.simulation",
    },
    {"moerl.models"},
    {"moerl.megatron"},
    {"moerl.checkpoint"},
    {"moerl.engines", "moerl.episodes", "moerl.rewards", "moerl.tasks"},
    {"moerl.trainer"},
    {"moerl.weight_sync"},
    {"moerl.orchestrator"},
    {"moerl.cli"},  # the commands: they may import anything, and nothing imports them
]


def module_name(path: Path) -> str:
    parts = ["moerl", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each moerl module -> the moerl modules it imports anywhere in its body."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    out = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        out[name] = {m for m in found if m.split(".")[0] == "moerl" and m != name}
    return out


def layer(module: str) -> int:
    for i, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members if m != "moerl") or module == "moerl":
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_no_module_imports_from_a_higher_layer():
    upward = sorted(f"{a} -> {b}" for a, bs in imports().items() for b in bs if layer(b) > layer(a))
    assert not upward, upward


def test_no_import_cycle():
    graph = imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt in graph and not state.get(nxt):
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])
    assert not cycles, cycles


def test_the_command_line_checks_a_run_without_megatron_core():
    """``moerl train --check`` (the recipe's ``--launch`` checks so, before torchrun) and ``--help`` import no
    megatron-core: 2 s of every job's start on a CPU, paid again by each rank."""
    import subprocess
    import sys

    probe = "import sys, moerl.cli.train; print(sorted(m for m in sys.modules if m.startswith('megatron')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_recipes_check_loads_no_model_code(tmp_path):
    """The check of the demo run (the recipe's ``--launch``), what every job start pays for before torchrun, loads no
    transformers model code (3 s on a CPU): the reward check of a run without a reward model asked the classifier's
    module once."""
    import subprocess
    import sys

    probe = (
        "import sys, contextlib, io\n"
        "from moerl import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    cli.main(['train', '--check', '--config', 'recipes/qwen_moe_grpo.yaml', 'run.dir={tmp_path / 'run'}'])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('transformers.modeling_utils', 'megatron'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]
