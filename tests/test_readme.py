"""The README's lists that must follow the code: a new architecture appears in "Real checkpoints" or
this fails."""

from __future__ import annotations

import re
from pathlib import Path

from attnlab.formats.hf import architectures

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_real_checkpoints_lists_every_supported_architecture_and_loading_by_hub_name():
    text = section("Real checkpoints")
    listed = [
        name
        for name in re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M)
        if name != "model_type"
    ]
    assert sorted(listed) == sorted(architectures()), (
        "README's architecture table and attnlab.formats.hf differ"
    )
    # a Hub name with a revision
    assert re.search(r'attnlab\.load\("[\w.-]+/[\w.-]+", revision="\w+"\)', text)
