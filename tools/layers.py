"""rayzip's layers: each module's line count and the rayzip layers it imports, and every import
that points up a layer (python tools/layers.py; exit 1 when there is one).

Layers, lowest first; a module imports from its own layer or those below:

    base       xp, cuda               array modules and CUDA kernels
    codecs     codecs, checkpoint     gradient codecs; the lossless checkpoint format
    comm       comm                   collectives over torch.distributed
    engine     engine                 the gradient-exchange engine (no DDP)
    torch      torch                  config and the adapters: DDP hook, local steps (no pydantic, no Ray)
    ray        spec, train, ps, adaptive, metrics, progress, keeper, runner, submit, package, k8s
    cli        cli, bench, __main__
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rayzip"
LAYERS = {"base": ("xp", "cuda"), "codecs": ("codecs", "checkpoint"), "comm": ("comm",), "engine": ("engine",), "torch": ("torch",),
          "ray": ("spec", "train", "ps", "adaptive", "metrics", "progress", "keeper", "runner", "submit", "package",
                  "k8s"),
          "cli": ("cli", "bench", "__main__", "__init__")}
ORDER = list(LAYERS)
LAYER_OF = {top: layer for layer, tops in LAYERS.items() for top in tops}
# Imports outside rayzip that a layer may not make: the library layers run without them.
FORBIDDEN = {"base": ("ray", "pydantic"), "codecs": ("ray", "pydantic"), "comm": ("ray", "pydantic"),
             "engine": ("ray", "pydantic"), "torch": ("ray", "pydantic")}


def top_of(module: Path) -> str:
    rel = module.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imports(module: Path) -> list[tuple[str, int, bool]]:
    """(imported rayzip top-level name or external package, line, is it rayzip's) for each
    import at module level or inside functions; ``try``-guarded optional imports included."""
    tree = ast.parse(module.read_text())
    package = ".".join(module.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] if node.module or not node.level else [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "rayzip":
                if len(parts) > 1:
                    found.append((parts[1], node.lineno, True))
            else:
                found.append((parts[0], node.lineno, False))
    return found


def report() -> tuple[list[str], list[str]]:
    rows, problems = [], []
    for module in sorted(PACKAGE.rglob("*.py")):
        top = top_of(module)
        layer = LAYER_OF.get(top, "cli")
        uses = sorted({LAYER_OF.get(t, "cli") for t, _, ours in imports(module) if ours and t != top},
                      key=ORDER.index)
        rows.append(f"{len(module.read_text().splitlines()):5d}  {layer:7s} {module.relative_to(ROOT)}"
                    f"  -> {', '.join(uses) or '-'}")
        for name, line, ours in imports(module):
            if ours and ORDER.index(LAYER_OF.get(name, "cli")) > ORDER.index(layer):
                problems.append(f"{module.relative_to(ROOT)}:{line}: layer {layer} imports rayzip.{name} "
                                f"(layer {LAYER_OF.get(name, 'cli')})")
            if not ours and name in FORBIDDEN.get(layer, ()):
                problems.append(f"{module.relative_to(ROOT)}:{line}: layer {layer} imports {name}")
    return rows, problems


def main() -> int:
    rows, problems = report()
    print("lines  layer   module  -> layers it imports")
    print("\n".join(rows))
    print("\n".join(problems) or "every import points down")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
