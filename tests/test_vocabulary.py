"""The vocabulary is the one place that names dtypes, attention implementations and config choices; the package's
imports form no cycle. Both are read from the source with `ast` (comments and docstrings do not count)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
import torch

from rlanywhere import algorithms, config, data, vocabulary
from rlanywhere.rollout import ENGINE_CHOICES

PACKAGE = Path(vocabulary.__file__).resolve().parent
DTYPE_ATTRIBUTES = {"float16", "bfloat16", "float32", "float64", "half", "float", "double"}  # torch.<name>
DTYPE_METHODS = {"half", "bfloat16", "double"}  # tensor.<name>() casts (.float() is the usual upcast: allowed)
ATTENTION_NAMES = set(vocabulary.ATTN_IMPLEMENTATIONS)

# Files other helpers of issue 11 are rewriting at the same time: their literals are counted, not yet fixed. This
# list only shrinks; a file that gains a literal, or a new file with one, fails.
PENDING_LITERALS: dict[str, int] = {}


def dtype_and_attention_literals(tree: ast.AST) -> list[str]:
    """`torch.bfloat16`-style attributes, `.half()`-style casts and exact attention-implementation strings."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in DTYPE_ATTRIBUTES and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            found.append((node.lineno, node.col_offset, f"torch.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DTYPE_METHODS
              and not node.args and not node.keywords):
            found.append((node.lineno, node.col_offset, f".{node.func.attr}()"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ATTENTION_NAMES:
            found.append((node.lineno, node.col_offset, repr(node.value)))
    return [f"line {line}: {text}" for line, _, text in sorted(found)]


def literals_by_file() -> dict[str, list[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "vocabulary.py":
            continue
        found = dtype_and_attention_literals(ast.parse(path.read_text(), filename=str(path)))
        if found:
            out[name] = found
    return out


def test_the_scan_finds_what_it_looks_for():
    source = ('"""torch.bfloat16 in a docstring and "sdpa" in prose do not count."""\n'
              "import torch\n"
              "x = torch.zeros(2, dtype=torch.bfloat16)  # torch.float16 in a comment does not count\n"
              "y = x.half()\n"
              "cfg = dict(attn_implementation='sdpa', note='sdpa or eager')\n"
              "z = x.to(torch.float32)\n")
    assert [hit.split(": ")[1] for hit in dtype_and_attention_literals(ast.parse(source))] == [
        "torch.bfloat16", ".half()", "'sdpa'", "torch.float32"]


def test_dtype_and_attention_literals_only_in_vocabulary():
    found = literals_by_file()
    new = {name: hits for name, hits in found.items() if len(hits) > PENDING_LITERALS.get(name, 0)}
    assert not new, ("dtype / attention-implementation literals outside vocabulary.py (use vocabulary.FP32, BF16, "
                     f"ACCUMULATE_DTYPE, ATTN_SDPA, ... or read them from the Plan): {new}")
    fixed = {name: count for name, count in PENDING_LITERALS.items() if len(found.get(name, [])) < count}
    assert not fixed, f"fewer literals than PENDING_LITERALS allows, lower the counts: {fixed} -> " \
                      f"{ {name: len(found.get(name, [])) for name in fixed} }"


def _imports(path: Path, module: str) -> set[str]:
    """rlanywhere modules `module` imports anywhere in its file (also inside functions: a lazy import still ties
    two modules together)."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.startswith("rlanywhere")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("rlanywhere"):
                continue
            out.add(target)
            out |= {f"{target}.{alias.name}" for alias in node.names}  # `from . import data` names a module
    return out


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("rlanywhere",) + path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        # importing a submodule runs its package's __init__ first: that edge is not a dependency of the module
        graph[name] = {target for target in _imports(path, name) if target in modules and target != name
                       and not name.startswith(target + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_cycle_finder_finds_a_lazy_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert {"rlanywhere.vocabulary", "rlanywhere.planner", "rlanywhere.doctor"} <= set(graph)
    assert graph["rlanywhere.vocabulary"] <= {"rlanywhere.errors"}, "vocabulary.py is the leaf"
    assert "rlanywhere.planner" not in graph["rlanywhere.machine"] | graph["rlanywhere.plans"]
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_no_hardware_module_left():
    assert not (PACKAGE / "hardware.py").exists()
    assert not any("rlanywhere.hardware" in targets for targets in import_graph().values())


def test_the_api_function_plan_is_not_shadowed_by_a_module():
    import importlib

    import rlanywhere

    for path in PACKAGE.glob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            importlib.import_module(f"rlanywhere.{path.stem}")
    assert callable(rlanywhere.plan) and rlanywhere.plan.__module__ == "rlanywhere.api"


def test_choice_enums_are_the_valid_config_values():
    # the registries are the valid values; the enums name the ones the code refers to
    assert set(vocabulary.AdvantageEstimator.values()) <= set(algorithms.ADVANTAGE_ESTIMATORS)
    assert set(vocabulary.PolicyLossMode.values()) <= set(algorithms.POLICY_LOSSES)
    assert algorithms.LOSS_AGG_MODES == vocabulary.LossAggMode.values()
    assert data.TRUNCATION_MODES == vocabulary.Truncation.values()
    assert ENGINE_CHOICES == vocabulary.RolloutEngineName.values()
    assert set(vocabulary.PRECISION_DTYPES) == set(vocabulary.Precision.values()) - {"auto"}
    assert set(vocabulary.ATTN_IMPLEMENTATIONS) == set(vocabulary.AttnImplementation.values()) - {"auto"}
    with pytest.raises(config.ConfigError, match="rloo"):
        config.load_config(None, ["algorithm.adv_estimator=ppo"])


def test_choices_compare_and_print_as_their_strings():
    gae = vocabulary.AdvantageEstimator.GAE
    assert gae == "gae" and "gae" == gae and {"gae": 1}[gae] == 1
    assert f"{gae}" == str(gae) == "gae" and f"{gae:>5}" == "  gae"
    assert vocabulary.AdvantageEstimator("grpo") is vocabulary.AdvantageEstimator.GRPO


@pytest.mark.parametrize("version, on_cuda, expected", [
    ("2.8.0", True, True), ("2.13.0+cu128", True, True), ("2.7.1", True, False), ("3.0.0", True, True),
    ("2.9.0", False, False), ("garbage", True, False)])
def test_half_gemm_with_fp32_output_needs_cuda_and_torch_2_8(version, on_cuda, expected):
    assert vocabulary.has_half_gemm_fp32_output(version, on_cuda) is expected


def test_to_jsonable_names_dtypes():
    assert vocabulary.to_jsonable({"a": (torch.bfloat16, [vocabulary.FP32]), 1: None}) == {
        "a": ["bfloat16", ["float32"]], "1": None}
    assert vocabulary.cc_str((8, 6)) == "8.6" and vocabulary.cc_str(None) == "n/a"
    assert Counter(vocabulary.dtype_name(d) for d in vocabulary.PRECISION_DTYPES.values()) == Counter(
        ["float32", "bfloat16", "float16"])
