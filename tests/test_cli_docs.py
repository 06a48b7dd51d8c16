"""The documentation site as a reader meets it: every page of docs/ is in the site's navigation, every link between
pages reaches a page and, with an anchor, a heading of that page (as mkdocs names headings), and the wire format's
versions are the code's. `mkdocs build --strict` (scripts/test.sh, where the docs extra is installed) checks the
built site as well."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from vmmshare.wire import local, peer

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs makes it (Python-Markdown's toc `slugify`): its text without markup, accents
    or punctuation, lower case, each run of spaces and hyphens one hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _prose(page: Path) -> list[str]:
    """The lines of `page` outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings; a repeated one gets _1, _2, ... as mkdocs numbers them."""
    found: set[str] = set()
    for line in _prose(page):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            name = base = slug(heading.group(1))
            n = 0
            while name in found:
                n += 1
                name = f"{base}_{n}"
            found.add(name)
    return found


def test_every_page_is_in_the_sites_navigation() -> None:
    nav = set(re.findall(r"^\s*-\s+[^:]+:\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - nav == set(), f"pages the site's navigation leaves out: {sorted(pages - nav)}"
    assert nav - pages == set(), f"navigation entries with no page: {sorted(nav - pages)}"


def test_every_link_between_pages_reaches_its_page_and_heading() -> None:
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for line in _prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    broken.append(f"{page.name}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert not broken, "\n".join(broken)


def test_the_anchor_names_are_the_ones_mkdocs_makes() -> None:
    """The slug rule on headings of the kind the pages have (code, a colon, options with two hyphens)."""
    assert slug("All-to-all at scale: `vmmshare bench --fabric --servers N`") == (
        "all-to-all-at-scale-vmmshare-bench-fabric-servers-n")
    assert slug("The link between two brokers") == "the-link-between-two-brokers"
    assert slug("§3 Faults: `stress/faults.py`") == "3-faults-stressfaultspy"


def test_the_wire_formats_versions_are_the_codes() -> None:
    text = (DOCS / "protocol.md").read_text()
    rows = [line for line in text.splitlines() if re.match(r"\|\s*2\s*\|\s*version", line)]
    assert len(rows) == 1, rows
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[2:] == [str(local.VERSION), str(peer.VERSION)], (cells, local.VERSION, peer.VERSION)
    assert f"version {peer.VERSION}" in (DOCS / "fabric.md").read_text()
