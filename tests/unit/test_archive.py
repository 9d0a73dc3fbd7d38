"""Package archives: sealed with digests; unpacking refuses anything unsafe or altered."""

import hashlib
import io
import json
import tarfile

import pytest

from modelops import PackageError
from modelops.archive import ARCHIVE, META, seal, unpack


def _package(tmp_path, members):
    """A package folder whose archive holds ``members`` (TarInfo, bytes) and whose
    package.json records the archive's real digest (only the filter can stop it)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    (pkg / ARCHIVE).write_bytes(raw.getvalue())
    files = {i.name: hashlib.sha256(d).hexdigest() for i, d in members if d is not None}
    (pkg / META).write_text(json.dumps({"archive_sha256": hashlib.sha256(raw.getvalue()).hexdigest(), "files": files}))
    return pkg


def _file(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_seal_then_unpack_round_trip(tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(b"\x00\x01" * 1000)
    meta = seal({"a/b.txt": b"hello", "c.bin": src}, tmp_path / "p", {"model_id": "m"})
    assert meta["model_id"] == "m" and set(meta["files"]) == {"a/b.txt", "c.bin"}
    out = tmp_path / "out"
    assert unpack(tmp_path / "p", out) == meta
    assert (out / "a/b.txt").read_bytes() == b"hello" and (out / "c.bin").read_bytes() == src.read_bytes()
    with pytest.raises(PackageError, match="must be relative and stay inside"):
        seal({"../x": b""}, tmp_path / "q", {})
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("members, expected", [
    ([_file("../escape.txt")], "refused archive member"),                         # tar-slip
    ([_file("/etc/evil.txt")], "refused archive member"),                        # absolute path
    ([_file("ok.txt"), _link("link", "../../outside")], "refused archive member"),  # link leaving the tree
    ([_link("abs", "/etc/passwd")], "refused archive member"),                   # absolute link
    ([_link("hard", "/etc/passwd", tarfile.LNKTYPE)], "refused archive member"),  # hard link out
])
def test_unsafe_members_are_refused(tmp_path, members, expected):
    pkg = _package(tmp_path, members)
    with pytest.raises(PackageError, match=expected):
        unpack(pkg, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_and_special_files_are_refused(tmp_path, kind):
    info = tarfile.TarInfo("dev")
    info.type, info.devmajor, info.devminor = kind, 1, 3
    pkg = _package(tmp_path, [_file("ok.txt"), (info, None)])
    with pytest.raises(PackageError, match="refused archive member"):
        unpack(pkg, tmp_path / "out")


def test_links_inside_the_tree_are_still_unrecorded(tmp_path):
    # The data filter allows a relative link within the tree; the digest manifest does not.
    pkg = _package(tmp_path, [_file("ok.txt"), _link("alias", "ok.txt")])
    with pytest.raises(PackageError, match="alias: not recorded in package.json"):
        unpack(pkg, tmp_path / "out")


def test_altered_archive_and_altered_file_are_refused(tmp_path):
    seal({"a.txt": b"hello"}, tmp_path / "p", {})
    meta = json.loads((tmp_path / "p" / META).read_text())
    meta["files"]["a.txt"] = "0" * 64
    (tmp_path / "p" / META).write_text(json.dumps(meta))
    with pytest.raises(PackageError, match="a.txt: sha256 .*, recorded 0000"):
        unpack(tmp_path / "p", tmp_path / "out")
    with (tmp_path / "p" / ARCHIVE).open("ab") as f:
        f.write(b"junk")
    with pytest.raises(PackageError, match="package.tar.gz has sha256 .* the package was altered"):
        unpack(tmp_path / "p", tmp_path / "out")
    with pytest.raises(PackageError, match="is not a package"):
        unpack(tmp_path / "nothing", tmp_path / "out")


def test_edited_metadata_is_refused(tmp_path):
    seal({"a.txt": b"hello"}, tmp_path / "p", {"model_id": "m", "task": "embed", "runtime_lock_hash": "abc"})
    meta = json.loads((tmp_path / "p" / META).read_text())
    meta.update(model_id="other", task="generate")
    (tmp_path / "p" / META).write_text(json.dumps(meta))
    with pytest.raises(PackageError, match=r"fields \['model_id', 'task'\] differ from the metadata sealed"):
        unpack(tmp_path / "p", tmp_path / "out")


def test_a_refused_package_leaves_the_earlier_extraction_whole(tmp_path):
    seal({"a.txt": b"good"}, tmp_path / "good", {"model_id": "m"})
    out = tmp_path / "work" / "package"
    unpack(tmp_path / "good", out)
    pkg = _package(tmp_path, [_file("ok.txt"), _link("alias", "ok.txt")])
    with pytest.raises(PackageError, match="alias: not recorded"):
        unpack(pkg, out)
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["package"]  # no staging left beside it
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"] and (out / "a.txt").read_bytes() == b"good"
    # and a package that passes replaces it whole, not merged
    seal({"b.txt": b"new"}, tmp_path / "next", {"model_id": "m"})
    unpack(tmp_path / "next", out)
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
