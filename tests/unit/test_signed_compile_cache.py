"""The compile cache beside the run holds code torch runs (modules it imports, libraries it loads, pickles): only
what this user's clipdist signed is kept when a run starts; whatever else a handed-over run folder brings is removed
before torch looks (clipdist.checkpoint.compile_cache). The run itself: tests/integration/test_compile_cache.py."""

from __future__ import annotations

import json
import os

import pytest

from clipdist.checkpoint.compile_cache import SIGNED, CompileCache, key_path, use, user_key

FILES = {"ab/cab.py": b"print('kernel')", "ab/cab.so": b"\x7fELF", "fxgraph/x/y/entry": b"pickle", "locks/l": b""}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder as torch leaves it, and a key folder of this test's own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "run" / "compile_cache"
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def present(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink()} - {SIGNED}


def test_a_signed_cache_is_kept_whole(cache, tmp_path):
    assert CompileCache(cache, ours=True).sign() is None
    assert key_path() == tmp_path / "config" / "clipdist" / "cache.key"
    assert oct(key_path().stat().st_mode & 0o777) == "0o600" and key_path().stat().st_size == 32
    assert CompileCache(cache, ours=True).admit() is None
    assert present(cache) == set(FILES)


def test_a_relative_xdg_config_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", "config")  # would follow the working directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert key_path() == tmp_path / "home" / ".config" / "clipdist" / "cache.key"


def test_a_cache_without_a_signed_list_is_removed(cache):
    said = CompileCache(cache, ours=True).admit()
    assert present(cache) == set() and "4 file(s) not signed" in said and "nothing in them ran" in said


def test_a_list_signed_with_another_users_key_is_not_believed(cache, tmp_path, monkeypatch):
    CompileCache(cache, ours=True).sign()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another user"))
    user_key(create=True)
    said = CompileCache(cache, ours=True).admit()
    assert present(cache) == set() and "not signed with this user's key" in said


def test_a_list_whose_digests_were_edited_is_not_believed(cache):
    CompileCache(cache, ours=True).sign()
    (cache / "ab/cab.py").write_bytes(b"import os; os.system('touch pwned')")
    signed = json.loads((cache / SIGNED).read_text())
    signed["files"]["ab/cab.py"] = "0" * 64  # the file's new digest would need the key to sign
    (cache / SIGNED).write_text(json.dumps(signed))
    CompileCache(cache, ours=True).admit()
    assert present(cache) == set()


def test_a_file_changed_or_added_after_the_last_signature_is_removed_alone(cache):
    CompileCache(cache, ours=True).sign()
    (cache / "ab/cab.py").write_bytes(b"import os; os.system('touch pwned')")
    (cache / "zz").mkdir()
    (cache / "zz/new.py").write_bytes(b"print('new')")
    said = CompileCache(cache, ours=True).admit()
    assert present(cache) == set(FILES) - {"ab/cab.py"}
    assert "2 file(s)" in said and "3 kept" in said


def test_links_in_the_cache_are_removed_and_their_targets_left_alone(cache, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_bytes(b"mine")
    CompileCache(cache, ours=True).sign()
    (cache / "ab/cab.so").unlink()
    (cache / "ab/cab.so").symlink_to(target / "precious")  # the same name, now a link
    (cache / "linked").symlink_to(target, target_is_directory=True)
    CompileCache(cache, ours=True).admit()
    assert present(cache) == set(FILES) - {"ab/cab.so"}
    assert (target / "precious").read_bytes() == b"mine"


def test_a_cache_folder_that_is_a_link_is_unlinked_not_emptied(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_bytes(b"mine")
    (tmp_path / "compile_cache").symlink_to(target, target_is_directory=True)
    said = CompileCache(tmp_path / "compile_cache", ours=True).admit()
    assert "was not a folder of the run's own" in said and not os.path.lexists(tmp_path / "compile_cache")
    assert (target / "precious").read_bytes() == b"mine"


def test_a_key_others_can_read_is_not_used_and_says_how_to_mend_it(cache):
    CompileCache(cache, ours=True).sign()
    key_path().chmod(0o644)
    key, why = user_key(create=False)
    assert key is None and "chmod 600" in why
    said = CompileCache(cache, ours=True).admit()
    assert present(cache) == set() and "chmod 600" in said
    unsigned = CompileCache(cache, ours=True)
    assert "not signed" in unsigned.sign() and unsigned.sign() is None  # said once


def test_signing_again_hashes_only_what_changed(cache, monkeypatch):
    from clipdist.checkpoint import compile_cache

    hashed = []
    digest = compile_cache.digest_own
    monkeypatch.setattr(compile_cache, "digest_own", lambda path: hashed.append(path.name) or digest(path))
    signer = CompileCache(cache, ours=True)
    signer.sign()
    assert len(hashed) == len(FILES)
    hashed.clear()
    (cache / "ab/new.py").write_bytes(b"print('new')")
    signer.sign()
    assert hashed == ["new.py"]
    assert CompileCache(cache, ours=True).admit() is None and "ab/new.py" in present(cache)


def test_a_cache_the_user_set_is_theirs(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    theirs = use(str(tmp_path / "run2"))
    assert theirs.folder == cache and not theirs.ours
    assert not use(str(tmp_path / "run3")).ours  # still theirs for the next run in this process
    assert theirs.admit() is None and theirs.sign() is None
    assert present(cache) == set(FILES) and not (cache / SIGNED).exists()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    ours = use(str(tmp_path / "run2"))
    assert ours.ours and ours.folder == tmp_path / "run2" / "compile_cache"
    assert os.environ["TRITON_CACHE_DIR"] == str(ours.folder / "triton")
