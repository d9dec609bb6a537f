"""Checks that a file is a real PNG image (for the group-balance chart and the inspect page screenshots)."""

from __future__ import annotations

from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, *, min_size: tuple[int, int] = (200, 100), max_size: tuple[int, int] = (4000, 4000)):
    """Assert `path` is a PNG (magic bytes, chunks that PIL verifies and decodes) of sane dimensions and return
    the decoded RGB image."""
    from PIL import Image

    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    with Image.open(path) as image:
        image.verify()  # checks the chunks' CRCs; an image must be reopened after verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert min_size[0] <= width <= max_size[0] and min_size[1] <= height <= max_size[1], image.size
        return image.convert("RGB")
