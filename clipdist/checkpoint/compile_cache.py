"""torch.compile's caches beside the run (<run_dir>/compile_cache), read only where this user's clipdist signed them.

A resume or a requeued job finds its graphs compiled already. But inductor's caches are code: Python modules it
imports, shared libraries it loads, pickles it unpickles. A run folder handed over (copied, downloaded) and resumed
with `resume=auto` would run whatever its cache holds, while its checkpoints are read without running anything
(weights.py). So the cache is trusted as the checkpoints are, by what is in the files, not by where they are:

- `sign()`, on the main rank after each checkpoint is published, writes `signed.json`: every file's SHA-256, and an
  HMAC-SHA256 of that list under a key only this user holds (`${XDG_CONFIG_HOME:-~/.config}/clipdist/cache.key`,
  32 random bytes, mode 0600, made on first use).
- `admit()`, on rank 0 before anything is compiled (the other ranks wait), keeps a file only where the list's HMAC
  verifies and the file's digest is the one listed. Everything else is removed before torch looks: a cache from
  another user or machine, a file changed or added since the last save, a link, anything not a regular file. What
  torch wrote after the last save compiles anew; nothing unsigned runs.

A cache the user set (TORCHINDUCTOR_CACHE_DIR) is theirs: used as it is, neither checked nor signed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from clipdist.files import UnboundedFileError, digest_own, json_of, read_own, write_atomic, write_once

FOLDER = "compile_cache"
SIGNED = "signed.json"  # the folder's list of digests and its HMAC
KEY_BYTES = 32
SIGNED_LIMIT = 64 << 20  # a list larger than this is not read (a cache of ~500,000 files)


def key_path() -> Path:
    """Where this user's key lives: ${XDG_CONFIG_HOME:-~/.config}/clipdist/cache.key (a relative XDG_CONFIG_HOME is
    ignored, as the XDG spec says: it would move with the working directory)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "clipdist" / "cache.key"


def user_key(create: bool) -> tuple[bytes | None, str]:
    """(this user's key, "") or (None, why there is none): its file must be this user's, a regular file readable by
    no one else, of KEY_BYTES bytes. Made where missing if `create`."""
    path = key_path()
    try:
        if create and not os.path.lexists(path):
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_once(path, secrets.token_bytes(KEY_BYTES))  # False: another process made it first
        info = os.lstat(path)
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None, f"{path} is not this user's alone (chmod 600 it, or remove it to have a new one made)"
        key = read_own(path, KEY_BYTES + 1)
    except FileNotFoundError:
        return None, f"no key at {path} yet"
    except (OSError, UnboundedFileError) as error:
        return None, f"{path}: {error.strerror or error}"
    if len(key) != KEY_BYTES:
        return None, f"{path} is not a key clipdist made (remove it to have a new one made)"
    return key, ""


def _mac(key: bytes, listing: dict[str, str]) -> str:
    return hmac.new(key, json.dumps(listing, sort_keys=True).encode(), hashlib.sha256).hexdigest()


@dataclass
class CompileCache:
    """The folder torch.compile's caches go to, and what this process knows of its files' digests."""

    folder: Path
    ours: bool  # beside the run: checked and signed (False: the user's TORCHINDUCTOR_CACHE_DIR)
    # each file's (size, mtime, inode) and digest, as this process last hashed or verified it
    known: dict[str, tuple[tuple[int, int, int], str]] = field(default_factory=dict)
    unsigned_said: bool = False

    def admit(self) -> str | None:
        """Remove every file the signed list does not vouch for; a line saying what went, or None."""
        if not self.ours or not os.path.lexists(self.folder):
            return None
        if self.folder.is_symlink() or not self.folder.is_dir():
            self.folder.unlink()  # a link: itself, never its target
            return f"{self.folder} was not a folder of the run's own (a link or a file): removed, its target untouched"
        listing, why = self._signed()
        removed = 0
        for path, info in _entries(self.folder):
            relative = path.relative_to(self.folder).as_posix()
            try:
                vouched = stat.S_ISREG(info.st_mode) and relative in listing and digest_own(path) == listing[relative]
            except OSError:  # unreadable, or replaced by a link since the walk
                vouched = False
            if vouched:
                self.known[relative] = (_stamp(info), listing[relative])
                continue
            path.unlink(missing_ok=True)
            removed += 1
        if not removed:
            return None
        kept = f", {len(self.known)} kept" if self.known else ""
        return (
            f"compile cache: {removed} file(s) not signed by this user's clipdist removed before compiling "
            f"({why}){kept}: nothing in them ran, and what they held compiles anew"
        )

    def _signed(self) -> tuple[dict[str, str], str]:
        """(the files the list vouches for, with their digests; why the others are not vouched for)."""
        key, why = user_key(create=False)
        if key is None:
            return {}, why
        try:
            signed = json_of(read_own(self.folder / SIGNED, SIGNED_LIMIT))
            listing, mac = signed["files"], signed["hmac"]
        except FileNotFoundError:
            return {}, "no signed list: the cache came without one, or no checkpoint was saved since it was written"
        except (OSError, UnboundedFileError, ValueError, KeyError, TypeError):
            return {}, f"{SIGNED} is not a list clipdist wrote"
        plain = isinstance(listing, dict) and all(isinstance(v, str) for v in listing.values())
        if not plain or not isinstance(mac, str) or not hmac.compare_digest(_mac(key, listing), mac):
            return {}, f"{SIGNED} is not signed with this user's key: the cache came from elsewhere"
        return listing, "written or changed since the last checkpoint"

    def sign(self) -> str | None:
        """List every regular file's digest (hashing only those new or changed since this process last looked) under
        this user's key; a warning the first time it cannot, else None."""
        if not self.ours or self.folder.is_symlink() or not self.folder.is_dir():
            return None
        key, why = user_key(create=True)
        if key is None:
            said, self.unsigned_said = self.unsigned_said, True
            return None if said else f"compile cache not signed ({why}): a resume compiles anew"
        listing = {}
        for path, info in _entries(self.folder):
            if not stat.S_ISREG(info.st_mode):
                continue
            relative, stamp = path.relative_to(self.folder).as_posix(), _stamp(info)
            known = self.known.get(relative)
            try:
                digest = known[1] if known and known[0] == stamp else digest_own(path)
            except OSError:  # gone, unreadable or replaced since the walk: left out
                continue
            self.known[relative] = (stamp, digest)
            listing[relative] = digest
        write_atomic(self.folder / SIGNED, json.dumps({"files": listing, "hmac": _mac(key, listing)}))
        return None


def _entries(folder: Path):
    """(path, lstat) of everything under `folder` but the signed list, links included and never followed."""
    for directory, folders, names in os.walk(folder):
        for name in list(folders):
            if os.path.islink(os.path.join(directory, name)):
                folders.remove(name)  # a linked folder is an entry itself (removed by admit, skipped by sign)
                names.append(name)
        for name in names:
            path = Path(directory, name)
            if path != folder / SIGNED:
                yield path, os.lstat(path)


def _stamp(info: os.stat_result) -> tuple[int, int, int]:
    return info.st_size, info.st_mtime_ns, info.st_ino


_SET: set[str] = set()  # the cache folders this process (or the one it was forked from) pointed torch at


def use(run_dir: str) -> CompileCache:
    """Point torch.compile's caches (inductor's FX graphs and kernels, AOTAutograd's, Triton's) at the folder beside
    the run; a cache the user set is kept (torch writes its own default, /tmp/torchinductor_<user>, back into the
    environment once it has looked, and an earlier run in this process set its own: neither is the user's)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    theirs = bool(given) and given != os.path.abspath(default_cache_dir()) and given not in _SET
    folder = given if theirs else os.path.join(os.path.abspath(run_dir), FOLDER)
    triton = os.environ.get("TRITON_CACHE_DIR")
    if not triton or triton in _SET:  # Triton's own default is under ~/.triton: not the user's either
        triton = os.path.join(folder, "triton")
        _SET.add(triton)
    if not theirs:
        _SET.add(folder)
    os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = folder, triton
    return CompileCache(Path(folder), ours=not theirs)
