"""The VM image cache: checkouts sharing ~/.cache/apir/vm keep each other's images."""

from __future__ import annotations

from pathlib import Path

from apir.vm import image


def fake_build(dest: Path, log=lambda s: None) -> None:
    dest.write_bytes(b"initramfs")


def test_checkouts_keep_each_others_images(tmp_path, monkeypatch):
    monkeypatch.setattr(image, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(image, "find_kernel", lambda: tmp_path / "vmlinuz")
    monkeypatch.setattr(image, "build", fake_build)

    def ensure(checkout: str, key: str) -> Path:
        monkeypatch.setattr(image, "_apir_dir", lambda: tmp_path / checkout / "apir")
        monkeypatch.setattr(image, "cache_key", lambda: key)
        return image.ensure_image().initramfs

    a1, b1 = ensure("a", "k1"), ensure("b", "k1")
    assert a1 != b1 and a1.exists() and b1.exists()
    a2 = ensure("a", "k2")  # checkout a changed: its stale image goes, b's stays
    assert a2.exists() and not a1.exists() and b1.exists()
    assert ensure("b", "k1") == b1  # still cached: not rebuilt
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([a2.name, b1.name])
