"""The docs stay true to the tests: every test function and test file README.md and docs/ name exists."""

from __future__ import annotations

import re

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEST_FILES = sorted((REPO / "tests").rglob("test_*.py"))


def cited(pattern: str) -> dict[str, list[str]]:
    """Each match of `pattern` in the docs, with the pages that cite it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in re.findall(pattern, page.read_text()):
            found.setdefault(name, []).append(page.name)
    return found


def test_every_test_named_in_the_docs_exists():
    defined = {name for path in TEST_FILES for name in re.findall(r"(?m)^\s*def (test_\w+)\(", path.read_text())}
    names = cited(r"\b(test_\w+)\b(?!\.py)")
    assert names, "the docs name no test: the pattern is wrong"
    missing = {name: pages for name, pages in names.items() if name not in defined}
    assert not missing, f"the docs name tests that do not exist: {missing}"


def expand(path: str) -> list[str]:
    """'tests/{unit,integration}/test_x.py' -> both paths."""
    match = re.search(r"\{([\w,]+)\}", path)
    if not match:
        return [path]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in expand(path[: match.start()] + part + path[match.end() :])
    ]


def test_every_test_file_named_in_the_docs_exists():
    paths = cited(r"\b(tests/(?:\{[\w,]+\}|[\w/])+\.py)\b")
    assert any("{" in path for path in paths) and paths, (
        "the docs name no test file (or none in both): the pattern is wrong"
    )
    missing = {path: pages for path, pages in paths.items() if not all((REPO / one).is_file() for one in expand(path))}
    assert not missing, f"the docs name test files that do not exist: {missing}"


def test_every_doc_page_the_repository_cites_exists():
    """A `docs/<page>.md` named in the code, the configs, the scripts or another page is a page of docs/."""
    sources = [
        path
        for folder in ("clipdist", "scripts", "slurm", "tests", "docs")
        for path in (REPO / folder).rglob("*")
        if path.suffix in (".py", ".yaml", ".sh", ".md") and path.is_file()
    ]
    cites: dict[str, list[str]] = {}
    for path in [REPO / "README.md", *sources]:
        for page in re.findall(r"\bdocs/([\w-]+\.md)\b", path.read_text(errors="replace")):
            cites.setdefault(page, []).append(str(path.relative_to(REPO)))
    assert "siglip2.md" in cites, "no page cited: the pattern is wrong"
    missing = {page: where for page, where in cites.items() if not (REPO / "docs" / page).is_file()}
    assert not missing, f"pages cited that docs/ does not have: {missing}"


PACKAGE = REPO / "clipdist"
MODULES = {
    ".".join(
        path.relative_to(PACKAGE).with_suffix("").parts[:-1]
        if path.name == "__init__.py"
        else path.relative_to(PACKAGE).with_suffix("").parts
    )
    for path in PACKAGE.rglob("*.py")
} - {""}
FILE_SUFFIXES = {
    "py",
    "json",
    "yaml",
    "md",
    "txt",
    "pt",
    "jsonl",
    "log",
    "dcp",
    "safetensors",
    "bin",
    "tar",
    "csv",
    "tsv",
    "png",
    "jpg",
    "sh",
    "toml",
    "metadata",
    "wandb",
}
CONFIG_SECTIONS = ("model", "data", "loss", "world", "optim", "logging", "checkpoint", "grad_cache")


def _modules_named(first: str) -> set[str]:
    """The clipdist modules a citation's first part may mean: `models`, or by its last name (`images` is
    data.images, `base` losses.base or objective.base)."""
    return {module for module in MODULES if module.split(".")[0] == first or module.split(".")[-1] == first}


def _resolves_in_code(dotted: str) -> bool:
    """`dotted` names something in clipdist: a module (its longest prefix, or a module by its last name) and
    attributes below it."""
    import importlib

    parts = dotted.removeprefix("clipdist.").split(".")
    candidates = [parts] + [[*module.split("."), *parts[1:]] for module in _modules_named(parts[0])]
    for names in candidates:
        for cut in range(len(names), 0, -1):
            if ".".join(names[:cut]) not in MODULES:
                continue
            if _has_path(importlib.import_module("clipdist." + ".".join(names[:cut])), names[cut:]):
                return True
            break
    return False


def _has_path(target, names: list[str]) -> bool:
    for name in names:
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return True


def _is_config_key(dotted: str) -> bool:
    """`dotted` is a key of the training schema (a loss backend's own keys included), or under a free-form field."""
    from dataclasses import fields, is_dataclass

    from clipdist.config import LOSS_SCHEMAS, TrainConfig

    owners = [TrainConfig]
    for part in dotted.split("."):
        found = [f for owner in owners for f in fields(owner) if f.name == part]
        if not found:
            return False
        if not any(is_dataclass(f.default_factory) for f in found):
            return True  # a leaf, or a dict such as data.eval_sets whose keys are the user's
        owners = [f.default_factory for f in found if is_dataclass(f.default_factory)]
        owners += list(LOSS_SCHEMAS.values()) if part == "loss" else []
    return True


def test_every_code_symbol_and_config_key_the_docs_cite_exists():
    """A backticked `module.symbol` (clipdist.model.factory.check_config_is_data, weights.read_small_json,
    objective.base.Term)
    resolves in the code, and a backticked config key (data.readers, loss.distill.weight) is in the schema: the docs
    cannot name what was renamed or removed."""
    tokens = {
        token: pages
        for token, pages in cited(r"`((?:clipdist\.)?[a-z_]+(?:\.[A-Za-z_]\w*)+)`").items()
        if token.rsplit(".", 1)[1] not in FILE_SUFFIXES
    }
    code = {
        token: pages
        for token, pages in tokens.items()
        if token.startswith("clipdist.") or _modules_named(token.split(".")[0])
    }
    assert len(code) > 30, "the pattern finds too few citations"
    missing = {
        token: pages
        for token, pages in code.items()
        if not _resolves_in_code(token) and not (token.split(".")[0] in CONFIG_SECTIONS and _is_config_key(token))
    }
    assert not missing, f"the docs cite code or config keys that do not exist: {missing}"
    keys = {token: pages for token, pages in tokens.items() if token.split(".")[0] in CONFIG_SECTIONS}
    unknown = {
        token: pages for token, pages in keys.items() if not _is_config_key(token) and not _resolves_in_code(token)
    }
    assert not unknown, f"the docs cite config keys the schema does not have: {unknown}"


def test_the_profiler_ranges_the_docs_list_are_the_codes():
    ranges = {
        match for path in PACKAGE.rglob("*.py") for match in re.findall(r'record_function\("(\w+)"\)', path.read_text())
    }
    text = (REPO / "docs" / "performance.md").read_text()
    sentence = re.search(r"labelled ranges:(.*?)Look at", text, re.S)
    assert sentence and ranges, "performance.md no longer lists the ranges, or the code has none"
    assert set(re.findall(r"`(\w+)`", sentence.group(1))) == ranges


def _schema_default(group: str, option: str, key: str):
    """The schema's default for `<group>.<key>` in conf/<group>/<option>.yaml (a loss backend's own schema where it
    has one)."""
    import dataclasses

    from clipdist import config

    schema = {"loss": config.LOSS_SCHEMAS.get(option, config.LossConfig)}.get(group)
    if schema is None:
        schema = {field.name: field for field in dataclasses.fields(config.TrainConfig)}[group].type
        schema = getattr(config, schema) if isinstance(schema, str) else schema
    for part in key.split("."):
        field = {field.name: field for field in dataclasses.fields(schema)}[part]
        if dataclasses.is_dataclass(field.default_factory if field.default_factory is not dataclasses.MISSING else 0):
            schema = field.default_factory
            continue
        return field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return schema


def test_a_yaml_comment_that_names_a_default_gives_the_schemas():
    """`# loss.tile=1024: ... (default in the schema)` in a config group's YAML: the value is the schema's default
    (the tile was once documented as 256 while the code said 1024)."""
    checked = 0
    for path in sorted((REPO / "clipdist" / "conf").rglob("*.yaml")):
        group, option = path.parent.name, path.stem
        for key, value in re.findall(rf"#\s*{group}\.([a-z_.]+)=([^\s:]+):[^\n]*default", path.read_text()):
            assert str(_schema_default(group, option, key)) == value, f"{path.relative_to(REPO)}: {group}.{key}"
            checked += 1
    assert checked >= 2


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_section_finds_it():
    """`[...](page.md#anchor)` and `(#anchor)` in README.md and docs/ name a heading the page has."""
    anchors = {
        page.resolve(): {_slug(heading) for heading in re.findall(r"(?m)^#+ (.+)$", page.read_text())} for page in PAGES
    }
    links = [
        (page, target, anchor)
        for page in PAGES
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)#([\w-]+)\)", page.read_text())
    ]
    assert len(links) > 20, "the pattern finds too few links"
    broken = [
        f"{page.name}: {target}#{anchor}"
        for page, target, anchor in links
        if anchor not in anchors.get((page.parent / target).resolve() if target else page.resolve(), set())
    ]
    assert not broken, f"links to sections that do not exist: {broken}"


def test_the_docs_fit_an_evening():
    """README.md and docs/ (not docs/bench/, the measurement records) stay within 32,000 words, in plain sentences: the
    median under 25 words (`python scripts/doc_budget.py` prints each page's)."""
    import importlib.util
    import statistics

    spec = importlib.util.spec_from_file_location("doc_budget", REPO / "scripts" / "doc_budget.py")
    assert spec and spec.loader
    budget = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(budget)
    measured = budget.measure(budget.pages())
    words = sum(count for count, _ in measured.values())
    lengths = [length for _, page in measured.values() for length in page]
    assert len(measured) == len(PAGES) and len(lengths) > 500, "the pages or their sentences were not found"
    assert words <= budget.WORDS, f"{words} words: over the budget of {budget.WORDS}"
    assert statistics.median(lengths) < budget.MEDIAN_SENTENCE, f"median sentence {statistics.median(lengths)} words"
    example = "One idea. Another `idea` here!\n\n- a list item\n```\nnot. Counted\n```\n| a | table |"
    assert budget.sentence_lengths(example) == [2, 3, 3]
