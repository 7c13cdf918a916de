"""The docs: the configuration reference is current, and every relative link resolves.

Links are Markdown ``[text](target)`` and ``![alt](target)`` in README.md and docs/*.md, outside
code blocks. A relative target must name an existing file or directory; a ``#fragment`` must name
a heading of the target page (GitHub's anchor rule: lower case, punctuation dropped, spaces to
hyphens).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return out


def _anchor(heading: str) -> str:
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m[1]) for line in _prose_lines(path) if (m := HEADING.match(line))}


def _relative_links(path: Path) -> list[str]:
    targets = [t for line in _prose_lines(path) for t in LINK.findall(line)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchor_rule() -> None:
    assert _anchor("4. Submitting") == "4-submitting"
    assert _anchor("NCCL timeouts (`Watchdog caught`)") == "nccl-timeouts-watchdog-caught"
    assert _anchor("Out of memory in log-probs") == "out-of-memory-in-log-probs"
    assert _anchor("Deploying megatron_gndpo") == "deploying-megatron_gndpo"
    assert _anchor("See [the guide](x.md)") == "see-the-guide"


def test_config_reference_is_current() -> None:
    """docs/CONFIG.md is what docs/generate_config.py writes from the config dataclasses."""
    spec = importlib.util.spec_from_file_location(
        "generate_config", ROOT / "docs" / "generate_config.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "CONFIG.md").read_text() == module.render(), (
        "docs/CONFIG.md is out of date: run `python docs/generate_config.py` and commit it"
    )
    from megatron_gndpo.config.docs import iter_fields

    text = (ROOT / "docs" / "CONFIG.md").read_text()
    missing = [fd.key for fd in iter_fields() if f"**`{fd.key}`**" not in text]
    assert not missing, f"fields without an entry: {missing}"
