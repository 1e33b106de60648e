"""An ImageFolder (one subfolder per class, torchvision's layout) read as an evaluation set — open_clip's
`--imagenet-val`.

A directory that holds no `.tar` but subfolders of images is read class by class: each class subfolder is a
shard URL `folder:<root>#class=<index>&name=<subfolder>` whose members are `<n>.<ext>` (an image's bytes) and
`<n>.cls` (the class index: the subfolder's place in sorted order, as torchvision numbers them), so evaluation
splits, skips and counts it as it does shards. Class names: `classnames.txt` in the folder or the ones given;
for ImageNet's layout (1000 WordNet-id folders, n01440764 ...) open_clip's own ImageNet class names and OpenAI's 80
prompt templates; else the subfolder names (`_` read as a space).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode

from clipdist.data.samples import IMAGE_EXTENSIONS, IMAGE_FILE_BYTES
from clipdist.files import read_bounded

SCHEME = "folder:"
SYNSET = re.compile(r"n\d{8}")


def class_folders(root: Path) -> list[Path]:
    """The class subfolders of an ImageFolder at `root` (sorted), or [] where it is not one."""
    if not root.is_dir() or any(root.glob("*.tar")):
        return []
    return sorted(
        (path for path in root.iterdir() if path.is_dir() and not path.name.startswith(".")), key=lambda path: path.name
    )


def is_part(url: str) -> bool:
    return url.startswith(SCHEME)


def folder_parts(root: Path) -> list[str]:
    """One URL per class subfolder."""
    return [
        f"{SCHEME}{quote(str(root.resolve()))}#{urlencode({'class': index, 'name': folder.name})}"
        for index, folder in enumerate(class_folders(root))
    ]


def _class_images(url: str) -> tuple[dict[str, str], list[Path]]:
    path, _, fragment = url[len(SCHEME) :].partition("#")
    options = {key: values[0] for key, values in parse_qs(fragment).items()}
    folder = Path(unquote(path)) / options["name"]
    return options, sorted(file for file in folder.iterdir() if file.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)


def class_size(url: str) -> int:
    """The images of a class subfolder."""
    return len(_class_images(url)[1])


def class_members(url: str):
    """(fname, data) of a class subfolder's images in name order, each with its class index (.cls)."""
    options, images = _class_images(url)
    for number, file in enumerate(images):
        key = f"{options['name']}/{number:06d}"
        try:
            yield f"{key}.{file.suffix.lower().lstrip('.')}", read_bounded(file, IMAGE_FILE_BYTES)
        except OSError as error:  # skipped and counted as a sample without an image, as a table row's
            yield f"{key}.missing", f"image {file.name}: {error.strerror}".encode()
        yield f"{key}.cls", options["class"].encode()


def folder_classnames(root: Path) -> tuple[list[str], list[str] | None]:
    """(class names, templates or None) of an ImageFolder: ImageNet's from open_clip for its layout, else the
    subfolder names."""
    names = [folder.name for folder in class_folders(root)]
    if len(names) == 1000 and all(SYNSET.fullmatch(name) for name in names):
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

        return list(IMAGENET_CLASSNAMES), [template("{}") for template in OPENAI_IMAGENET_TEMPLATES]
    return [name.replace("_", " ") for name in names], None


# The data-kind interface (clipdist.registry.kinds)
size, members = class_size, class_members


def names_it(item: str) -> bool:
    """Whether `item` is an ImageFolder (class subfolders of images)."""
    return bool(class_folders(Path(item).expanduser()))


def expand(item: str, options: None, what: str) -> list[str]:
    """An ImageFolder's parts: one per class subfolder."""
    return folder_parts(Path(item).expanduser())
