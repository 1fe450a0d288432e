"""Joining a GGUF shipped in chunks over several packages (gemma-3-270m): order, sha256 check,
reuse of the joined file, and nothing left behind on a mismatch."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvflow.models.model_resolver import (
    PackagedModel,
    _expected_sha256,
    find_packaged_model,
    join_parts,
)


def _parts(tmp_path, chunks: list[bytes]) -> list[str]:
    paths = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / f"model.gguf.part{i:02d}"
        path.write_bytes(chunk)
        paths.append(str(path))
    return paths


def test_join_in_order_checks_sha256_and_reuses(tmp_path):
    chunks = [b"GGUF" + os.urandom(3000), os.urandom(5), os.urandom(2 << 20)]
    whole = b"".join(chunks)
    digest = hashlib.sha256(whole).hexdigest()
    target = str(tmp_path / "cache" / "model.gguf")
    assert join_parts(_parts(tmp_path, chunks), target, digest) == target
    with open(target, "rb") as f:
        assert f.read() == whole
    mtime = os.stat(target).st_mtime_ns
    assert join_parts(_parts(tmp_path, chunks), target, digest) == target  # reused, not rewritten
    assert os.stat(target).st_mtime_ns == mtime


def test_join_sha256_mismatch_leaves_nothing(tmp_path):
    target = tmp_path / "cache" / "model.gguf"
    with pytest.raises(ValueError, match="sha256"):
        join_parts(_parts(tmp_path, [b"GGUF", b"xyz"]), str(target), "0" * 64)
    assert not target.exists() and os.listdir(target.parent) == []


def test_gemma_entry_and_sha256sums(tmp_path, monkeypatch):
    entry = find_packaged_model("GEMMA-3-270M")
    assert entry is not None and len(entry.parts) == 4
    assert [p[1][-6:] for p in entry.parts] == ["part00", "part01", "part02", "part03"]
    pkg = tmp_path / "fake_sums_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "SHA256SUMS").write_text(f"{'ab' * 32}  model.gguf\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = PackagedModel("m", (), (("x", "y"),), "pip install m", joined_name="model.gguf",
                         sha256sums=("fake_sums_pkg", "data/SHA256SUMS"))
    assert _expected_sha256(fake) == "ab" * 32
