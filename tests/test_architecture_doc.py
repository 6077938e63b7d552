"""docs/architecture.md stays true of the tree: its module table lists every module of the package
and nothing else, its dotted names resolve, the documents it links exist, and its lines about the
loss registry name and count the losses ``vlcontrast.losses.LOSSES`` holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vlcontrast"
DOC = ROOT / "docs" / "architecture.md"

ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|")


def package_modules() -> set[str]:
    """Every ``.py`` file of the package, relative to ``vlcontrast/``."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
            if "__pycache__" not in path.parts}


def modules_section(text: str) -> str:
    start = text.index("\n## Modules\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def table_modules(text: str) -> list[str]:
    """The module named in the first cell of every table row of the "Modules" section."""
    return [match.group(1) for line in modules_section(text).splitlines()
            if (match := ROW.match(line))]


def test_table_parser_reads_rows_and_ignores_other_sections():
    text = ("# T\n\n## Modules\n\n| module | job |\n|---|---|\n| `a.py` | x |\n| `b/c.py` | y |\n"
            "text with `d.py`\n\n## Other\n\n| `e.py` | z |\n")
    assert table_modules(text) == ["a.py", "b/c.py"]


def test_module_table_lists_every_module_and_only_existing_ones():
    listed = table_modules(DOC.read_text())
    assert listed, "docs/architecture.md: no module rows found under '## Modules'"
    duplicates = sorted({name for name in listed if listed.count(name) > 1})
    assert not duplicates, f"docs/architecture.md lists these modules twice: {duplicates}"
    actual = package_modules()
    missing = sorted(actual - set(listed))
    stale = sorted(set(listed) - actual)
    assert not missing, f"modules of vlcontrast/ missing from docs/architecture.md: {missing}"
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def _module_file(parts: list[str]) -> Path | None:
    path = PACKAGE.parent.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def unresolved(dotted: str) -> str | None:
    """Why ``vlcontrast.a.b.name`` does not name a module or a top-level name of one (None: fine)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if rest[0] in _top_level_names(module) or _module_file(parts[:cut + 1]) is not None:
            return None
        return f"{'.'.join(parts[:cut])} has no {rest[0]!r}"
    return "no such module"


def test_resolver_tells_real_names_from_invented_ones():
    assert unresolved("vlcontrast.checkpoints.resolve_checkpoint") is None
    assert unresolved("vlcontrast.data") is None
    assert unresolved("vlcontrast.train.checkpoint.no_such_function") is not None
    assert unresolved("vlcontrast.no_such_module") is not None


def test_dotted_names_in_the_doc_resolve():
    text = DOC.read_text()
    names = sorted(set(re.findall(r"\bvlcontrast(?:\.[A-Za-z_]\w*)+", text)))
    problems = {name: why for name in names if (why := unresolved(name))}
    assert not problems, f"docs/architecture.md names things that do not exist: {problems}"


TOP_LEVEL = sorted({path.stem if path.suffix == ".py" else path.name
                    for path in PACKAGE.iterdir()
                    if (path.suffix == ".py" and not path.name.startswith("_"))
                    or (path / "__init__.py").is_file()})
FILE_SUFFIXES = ("py", "pt", "md", "json", "yaml", "jsonl", "txt")


def config_keys() -> set[str]:
    """``section.key`` of every run-config option (they look like dotted module names)."""
    import dataclasses

    from vlcontrast.config import RunConfig

    config = RunConfig()
    keys = set()
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            keys.update(f"{section.name}.{field.name}" for field in dataclasses.fields(value))
    return keys


def diagram_names(text: str) -> set[str]:
    """Names such as ``train.loop.train`` in the drawings (relative to ``vlcontrast``), without
    file names and config keys."""
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S))
    pattern = r"(?<![\w.])(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(TOP_LEVEL)
    keys = config_keys()
    return {name for name in re.findall(pattern, blocks)
            if name.rsplit(".", 1)[-1] not in FILE_SUFFIXES and name not in keys}


def test_diagram_names_are_found_and_resolve():
    text = DOC.read_text()
    names = diagram_names(text)
    assert {"train.loop.train", "data.spec.check_spec", "losses.build_loss"} <= names
    assert "data.train" not in names and "config.yaml" not in names
    problems = {name: why for name in sorted(names) if (why := unresolved("vlcontrast." + name))}
    assert not problems, f"the drawings in docs/architecture.md name things that do not exist: {problems}"


def test_linked_documents_exist():
    text = DOC.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = sorted({t for t in targets if not (DOC.parent / t).exists()})
    assert not missing, f"docs/architecture.md links missing files: {missing}"
    cited = set(re.findall(r"docs/[\w./-]+\.md", text))
    assert not sorted(c for c in cited if not (ROOT / c).exists())


@pytest.mark.parametrize("name", ["trainer_state.pt", "rank_", "model.pt", "model_config.json",
                                  "config.yaml"])
def test_checkpoint_files_in_the_doc_are_the_ones_the_checkpointer_writes(name):
    source = (PACKAGE / "train" / "checkpoint.py").read_text()
    assert name in source, f"train/checkpoint.py no longer writes {name!r}; update the doc"
    assert name in DOC.read_text()


NUMBER_WORDS = dict(enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split()))


def test_loss_registry_line_names_every_registered_loss():
    """The contract's ``LOSSES: dict[...]  # names`` line names exactly the losses of
    ``vlcontrast.losses.LOSSES``: a loss registered without it fails here."""
    from vlcontrast.losses import LOSSES

    contract = re.search(r"^LOSSES: dict\[.*?#(.*)$", DOC.read_text(), re.M)
    assert contract, "docs/architecture.md: no 'LOSSES: dict[...]  # names' line"
    listed = contract.group(1).split()
    assert len(listed) == len(set(listed)), f"the LOSSES line names a loss twice: {listed}"
    assert sorted(listed) == sorted(LOSSES), (
        f"the LOSSES line of docs/architecture.md names {sorted(listed)}; the registry holds "
        f"{sorted(LOSSES)}")


def test_loss_registry_drawing_counts_the_registered_losses():
    """The drawing's "LOSSES: the N shipped classes" says how many ``LOSSES`` holds."""
    from vlcontrast.losses import LOSSES

    count = re.search(r"LOSSES: the (\w+) shipped classes", DOC.read_text())
    assert count, "docs/architecture.md: no 'LOSSES: the N shipped classes' line"
    assert count.group(1) == NUMBER_WORDS[len(LOSSES)], (
        f"docs/architecture.md counts {count.group(1)!r} shipped losses; the registry holds "
        f"{len(LOSSES)} ({NUMBER_WORDS[len(LOSSES)]})")
