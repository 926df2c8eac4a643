"""file:// media: off by default, only under the root, symlinks resolved, escapes refused."""

from __future__ import annotations

import os

import pytest

from shared.media.files import file_url_path, load_file
from shared.media.sources import MediaError
from tests.media import samples


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "secret.png"
    outside.write_bytes(samples.png(seed=2))
    (root / "a.png").write_bytes(samples.png(seed=1))
    (root / "sub" / "b.png").write_bytes(samples.png(seed=3))
    (root / "big.bin").write_bytes(b"\x00" * 5000)
    (root / "empty.png").write_bytes(b"")
    (root / "inside-link.png").symlink_to(root / "sub" / "b.png")
    (root / "escape-link.png").symlink_to(outside)
    (root / "escape-dir").symlink_to(tmp_path)
    (root / "dangling.png").symlink_to(tmp_path / "nope.png")
    os.mkfifo(root / "fifo.png")
    return root, outside


def load(root, url: str, cap: int = 10_000) -> bytes:
    return load_file(url, root=str(root), max_bytes=cap)


def error(root, url: str, cap: int = 10_000) -> MediaError:
    with pytest.raises(MediaError) as info:
        load(root, url, cap)
    assert 400 <= info.value.status < 500
    return info.value


def test_files_under_the_root(tree):
    root, _ = tree
    assert load(root, f"file://{root}/a.png") == samples.png(seed=1)
    assert load(root, f"file://localhost{root}/sub/b.png") == samples.png(seed=3)
    assert load(root, f"file://{root}/inside-link.png") == samples.png(seed=3)  # a symlink that stays inside
    assert load(root, f"file://{root}/%61.png") == samples.png(seed=1)  # percent-decoded


@pytest.mark.parametrize("rel, fragment", [
    ("escape-link.png", "outside the directory"),
    ("escape-dir/secret.png", "outside the directory"),
    ("sub/../a.png", "'..' segments"),
    ("../secret.png", "'..' segments"),
    ("%2e%2e/secret.png", "'..' segments"),
    ("dangling.png", "outside the directory"),
    ("missing.png", "does not exist"),
    ("sub", "does not name a regular file"),
    ("fifo.png", "does not name a regular file"),
    ("empty.png", "empty file"),
    ("a.png%00.jpg", "NUL"),
])
def test_refusals(tree, rel, fragment):
    root, _ = tree
    err = error(root, f"file://{root}/{rel}")
    assert fragment in str(err), str(err)
    assert str(root) not in str(err)  # never reveal the root


def test_absolute_paths_outside_the_root(tree):
    root, outside = tree
    for url in (f"file://{outside}", "file:///etc/passwd", "file:///proc/self/environ", "file:///"):
        assert "outside the directory" in str(error(root, url))


def test_hosts_and_relative_paths(tree):
    root, _ = tree
    assert "host 'example.com' is not allowed" in str(error(root, f"file://example.com{root}/a.png"))
    assert "absolute path" in str(error(root, "file:a.png"))


def test_size_cap(tree):
    root, _ = tree
    err = error(root, f"file://{root}/big.bin", cap=4999)
    assert err.status == 413 and "5000 bytes" in str(err)
    assert len(load(root, f"file://{root}/big.bin", cap=5000)) == 5000


def test_disabled_without_a_root(tree):
    root, _ = tree
    for r in ("",):
        with pytest.raises(MediaError, match="not enabled"):
            load_file(f"file://{root}/a.png", root=r, max_bytes=10_000)
    with pytest.raises(MediaError, match="not enabled"):
        file_url_path("file:///x.png", enabled=False)


def test_root_itself_may_be_a_symlink(tree, tmp_path):
    root, _ = tree
    link = tmp_path / "root-link"
    link.symlink_to(root)
    assert load(link, f"file://{link}/a.png") == samples.png(seed=1)
    assert load(link, f"file://{root}/a.png") == samples.png(seed=1)


def test_unreadable_file(tree):
    root, _ = tree
    path = root / "locked.png"
    path.write_bytes(b"x")
    path.chmod(0)
    try:
        if os.geteuid() == 0:
            pytest.skip("root reads files whatever their mode")
        assert "cannot be read" in str(error(root, f"file://{root}/locked.png"))
    finally:
        path.chmod(0o600)
