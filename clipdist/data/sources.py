"""Which shards a run reads — a built-in dataset's cache, or the user's shard specs — resolved once,
before any rank starts, with every evaluation set's class names and prompt templates.

A shard spec is one or more parts joined by '::', each one of
    a file                          /data/shard-000.tar
    a brace pattern                 /data/shard-{000..099}.tar
    a glob                          '/data/*.tar'          (quote it for Hydra's parser)
    a directory                     /data/cc3m/            (every *.tar inside, natural order)
    a clip_benchmark dataset root   /data/wds_cifar10/     (test/*.tar, classnames.txt,
                                                            zeroshot_classification_templates.txt)
    a URL or pipe: command          pipe:aws s3 cp s3://bucket/shard-000.tar -
"""

from __future__ import annotations

import glob
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import braceexpand

from clipdist.data.builtin import builtin_shards, classnames_of, templates_of
from clipdist.data.folders import folder_classnames
from clipdist.data.kinds import kind_named, kind_of_item, kind_of_url, kind_options
from clipdist.errors import printable
from clipdist.files import UnboundedFileError, is_remote, read_bounded

CLASSNAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
DEFAULT_TEMPLATES = ["a photo of {}."]  # where neither data.templates, a built-in source nor a templates file gives any
GLOB_CHARS = ("*", "?", "[")
SPLIT_FOLDERS = ("test", "train", "val", "validation")


def check_templates(templates: list[str], where: str) -> None:
    """A zero-shot prompt names its class as `{}` (or `{0}`) or clip_benchmark's `{c}`, at least once, and nothing
    else: no format spec (`{:>500000000}` is a 500 MB string), conversion or attribute (`{0.__class__}`); a
    ValueError in one line otherwise."""
    for template in templates:
        try:
            fields = [
                (name, spec, conversion)
                for _, name, spec, conversion in string.Formatter().parse(template)
                if name is not None
            ]
        except ValueError as error:
            raise ValueError(
                f"{where}: {printable(template)[:200]!r} is not a template ({error}); write the class "
                "as {} or {c}, a brace as {{ or }}"
            ) from None
        if not fields:  # every class would get the same prompt: zero-shot at chance, whatever the model
            raise ValueError(
                f"{where}: {printable(template)[:200]!r} does not name its class; write it as {{}} or {{c}} "
                "(a photo of {}.)"
            )
        for name, spec, conversion in fields:
            if name not in ("", "0", "c") or spec or conversion:
                raise ValueError(
                    f"{where}: {printable(template)[:200]!r} has the field "
                    f"{{{printable(name)[:50]}{'!' + conversion if conversion else ''}"
                    f"{':' + printable(spec)[:20] if spec else ''}}}; a template names its class as {{}} "
                    "or {c} and nothing else"
                )


def eval_set_key(name: str) -> str:
    """The config key that names an evaluation set, for messages."""
    return "data.val_shards" if name == "val" else f"data.eval_sets.{name}"


@dataclass(frozen=True)
class EvalSet:
    """A validation set: its shards and, for zero-shot classification, class names and prompts."""

    name: str
    urls: list[str]
    classnames: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_templates(self.templates, f"{self.key} templates")
        blank = next((index for index, name in enumerate(self.classnames) if not name.strip()), None)
        if blank is not None:  # its prompts would name no class: "a photo of ." for every blank one
            raise ValueError(f"{self.key} class names: name {blank} of {len(self.classnames)} is blank")

    @property
    def key(self) -> str:
        return eval_set_key(self.name)

    def metric(self, key: str) -> str:
        """The logged name of a metric: <name>/<key> (zeroshot_top1, samples, ...), but for the main set
        (data.val_shards, "val") zeroshot_top1, i2t_r1, ..., val_samples, val_skipped as ever."""
        if self.name != "val":
            return f"{self.name}/{key}"
        return key if key.startswith(("zeroshot", "i2t", "t2i")) else f"val_{key}"


@dataclass(frozen=True)
class Shards:
    """The training shards, one list per source (the '::' parts of data.train_shards), and the
    evaluation sets."""

    sources: list[list[str]]
    evals: list[EvalSet] = field(default_factory=list)
    # the training shards' sizes and how they were found (data.epochs.epoch_sizes), found once before the ranks start
    sizes: tuple[list[int] | None, str] | None = None

    @property
    def train(self) -> list[str]:
        return [url for urls in self.sources for url in urls]


def _is_remote(item: str) -> bool:
    """Not a local file: a URL, a `pipe:` command, or a part of a table (its table was checked when it was cut)."""
    return is_remote(item) or kind_of_url(item) is not None


def _natural(path: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _benchmark_root(path: Path) -> bool:
    """clip_benchmark's webdataset layout: test/*.tar with classnames.txt (or dataset_type.txt) beside."""
    return (path / "test").is_dir() and any((path / name).exists() for name in (CLASSNAMES_FILE, "dataset_type.txt"))


def as_local(path: str | Path) -> str:
    """A file the file system listed (a directory's or a glob's), as a path no reader takes for a URL or a `pipe:`
    command: a relative name that would read as one (`pipe:touch x;cat a.tar`, listed from `.` or `*.tar`) gets `./`
    before it. What a name in a folder says is never run."""
    text = str(path)
    return f"./{text}" if is_remote(text) else text


def _expand_item(item: str, what: str, options: dict[str, object]) -> list[str]:
    if kind_of_url(item) is not None:  # a part's URL is made by its kind's expand (its bounds checked there), only
        raise ValueError(
            f"{what}: {item[:120]!r} is an internal part of a data kind, not a shard spec; name the table, folder or "
            "shards themselves"
        )
    if is_remote(item):
        return [item]
    path = Path(item).expanduser()
    if path.is_dir() and _benchmark_root(path):  # its shards are in test/
        path = path / "test"
    kind = kind_of_item(str(path))  # a table, an ImageFolder (one subfolder per class: evaluation reads it)
    if kind is not None:
        return kind.expand(str(path), options.get(kind.name), what)
    if path.is_dir():
        found = sorted((as_local(p) for p in path.glob("*.tar")), key=_natural)
        if not found:
            raise FileNotFoundError(
                f"{what}: the directory {item} holds no .tar files (a shard spec may be a "
                "directory of .tar shards, an ImageFolder, a file, a brace pattern or a glob)"
            )
        return found
    if any(char in item for char in GLOB_CHARS):
        found = sorted((as_local(p) for p in glob.glob(str(path)) if Path(p).is_file()), key=_natural)
        if not found:
            raise FileNotFoundError(f"{what}: the glob {item!r} matches no file")
        return found
    return [str(path)]


def expand_shards(spec: str, what: str = "data.train_shards", options: dict[str, object] | None = None) -> list[str]:
    """Every shard of a spec (see the module docstring), checked: local shards exist and are not empty; a CSV/TSV
    table is cut into parts read as shards (data/tables.py). `options`: each data kind's (data.kinds.kind_options;
    None: their defaults)."""
    options = kind_options() if options is None else options
    if not spec:
        raise ValueError(f"{what} is empty: give a shard path, directory, glob, brace pattern or pipe: command")
    urls = [
        url
        for part in spec.split("::")
        for item in braceexpand.braceexpand(part)
        for url in _expand_item(item, what, options)
    ]
    local = [url for url in urls if not _is_remote(url)]
    missing = [url for url in local if not Path(url).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"{what}={spec!r}: {len(missing)} of {len(urls)} shards not found ({shown}). "
            "Check the path, or write shards with `clipdist make-shards`"
        )
    empty = [url for url in local if Path(url).stat().st_size == 0]
    if empty and len(empty) == len(urls):  # nothing readable left; one failed download among many is skipped
        raise ValueError(
            f"{what}: every shard is an empty file ({', '.join(empty[:3])}"
            f"{f' and {len(empty) - 3} more' if len(empty) > 3 else ''}): nothing to read"
        )
    return urls


TEXT_FILE_BYTES = 4 << 20  # classnames.txt, zeroshot_classification_templates.txt: a few KB


def _lines(path: Path) -> list[str]:
    """The non-empty lines of a small regular text file (a FIFO or /dev/zero beside the shards is refused)."""
    try:
        text = read_bounded(path, TEXT_FILE_BYTES).decode()
    except UnboundedFileError:
        raise ValueError(f"{path}: not a regular text file of at most {TEXT_FILE_BYTES >> 20} MiB") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _beside(spec: str, urls: list[str], name: str) -> Path | None:
    """`name` in the spec's directory, the first local shard's, or above a split folder (root/test/0.tar)."""
    candidates = []
    first = spec.split("::")[0]
    if not _is_remote(first) and Path(first).expanduser().is_dir():
        candidates.append(Path(first).expanduser())
    local = [url for url in urls if not _is_remote(url)]
    if local:
        folder = Path(local[0]).parent
        candidates += [folder, folder.parent] if folder.name in SPLIT_FOLDERS else [folder]
    return next(
        (folder / name for folder in candidates if (folder / name).exists() and not (folder / name).is_dir()), None
    )  # whatever kind of file: _lines refuses what is not a regular one


def eval_set(
    name: str,
    spec: str,
    classnames: list[str],
    templates: list[str],
    key: str | None = None,
    options: dict[str, object] | None = None,
) -> EvalSet:
    """An evaluation set from a spec. Class names: `classnames` if given, else classnames.txt beside the
    shards; prompts: zeroshot_classification_templates.txt beside the shards, else `templates`. `key`: how
    errors name the set (default: its config key)."""
    urls = expand_shards(spec, key or eval_set_key(name), options)
    if not classnames and (found := _beside(spec, urls, CLASSNAMES_FILE)):
        classnames = _lines(found)
    elif (
        not classnames and urls and kind_of_url(urls[0]) is kind_named("folder")
    ):  # an ImageFolder's own (ImageNet's from open_clip)
        classnames, folder_templates = folder_classnames(Path(spec).expanduser())
        if folder_templates and list(templates) == DEFAULT_TEMPLATES:
            templates = folder_templates
    if found := _beside(spec, urls, TEMPLATES_FILE):
        templates = _lines(found)
    return EvalSet(name, urls, list(classnames), list(templates))


def resolve_shards(data) -> Shards:
    """Shards for a DataConfig: a built-in source is written to its cache on first use (race-free);
    user specs are expanded and checked to exist. Raises ValueError / FileNotFoundError."""
    if data.source:
        train_spec, val_spec = builtin_shards(data.source, data.cache_dir, data.source_dir)
        classnames = list(data.classnames) or classnames_of(data.source)
    else:
        train_spec, val_spec, classnames = data.train_shards, data.val_shards, list(data.classnames)
    templates = list(data.templates) or (templates_of(data.source) if data.source else DEFAULT_TEMPLATES)
    if data.source and data.val_shards:  # your own main evaluation set beside a built-in training set
        val_spec, classnames = data.val_shards, list(data.classnames)
        templates = list(data.templates) or DEFAULT_TEMPLATES
    options = kind_options(data)
    evals = [eval_set("val", val_spec, classnames, templates, options=options)] if val_spec else []
    for name, spec in data.eval_sets.items():
        if name == "val":
            raise ValueError("data.eval_sets: the name 'val' is data.val_shards' own; choose another")
        evals.append(eval_set(name, spec, [], list(data.templates) or DEFAULT_TEMPLATES, options=options))
    sources = [expand_shards(part, "data.train_shards", options) for part in train_spec.split("::")]
    if data.weights is not None and len(data.weights) != len(sources):
        raise ValueError(
            f"data.weights has {len(data.weights)} weight(s) for {len(sources)} source(s) in "
            "data.train_shards ('::' separates them): give one weight per source"
        )
    return Shards(sources, evals)
