"""Every relative link and #anchor in README.md and docs/**/*.md resolves: the file it names exists
in the checkout, and an anchor matches a heading of the page it names, slugged as GitHub (and the
site, mkdocs.yml's toc slugify) slug them. Links inside code are not links. The site itself builds
with `mkdocs build --strict`: every page in the nav, every link and anchor found (`make docs`)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from shim import docgen

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); text may hold one level of brackets
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)=["']([^"']+)["']""", re.I)
HTML_ID = re.compile(r"""<[a-z]+\b[^>]*?\b(?:id|name)=["']([^"']+)["']""", re.I)
ATX = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
ATTR_ID = re.compile(r"\s*\{[^}]*#([\w-]+)[^}]*\}\s*$")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text, lowercased, without what is not a
    letter, digit, underscore, hyphen or space, spaces made hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of what is not a fenced code block, code spans blanked."""
    out = []
    fence = ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((n, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page: its headings' slugs (a repeated one numbered -1, -2, as
    GitHub numbers them), {#id} attributes and HTML ids."""
    text = path.read_text()
    raw = {n: line for n, line in enumerate(text.splitlines(), 1)}
    found: set[str] = set()
    seen: dict[str, int] = {}
    previous = ""
    for n, line in _prose(text):
        heading = None
        m = ATX.match(raw[n])
        if m:
            heading = m.group(2)
        elif SETEXT.match(line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*")):
            heading = previous
        previous = raw[n] if not m else ""
        found |= set(HTML_ID.findall(line))
        if heading is None:
            continue
        attr = ATTR_ID.search(heading)
        if attr:
            found.add(attr.group(1))
            continue
        s = slug(heading)
        count = seen.get(s, 0)
        seen[s] = count + 1
        found.add(s if count == 0 else f"{s}-{count}")
    return found


def problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is broken in one page's relative links: `file:line: target: why`."""
    out = []
    rel = path.relative_to(root)
    for n, line in _prose(path.read_text()):
        targets = INLINE.findall(line) + HTML_LINK.findall(line)
        m = REF_DEF.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            where = f"{rel}:{n}: {target}"
            if not target or SCHEME.match(target):
                continue  # an external URL (not checked here: no network)
            name, _, anchor = target.partition("#")
            name = unquote(name)
            if name.startswith("/"):
                out.append(f"{where}: an absolute path (links are relative to the page)")
                continue
            dest = (path.parent / name).resolve() if name else path
            if not dest.is_relative_to(root) or not dest.exists():
                out.append(f"{where}: no such file {os.path.relpath(dest, root)}")
                continue
            if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
                out.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return out


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    found = problems(page)
    assert not found, "broken links:\n" + "\n".join(found)


def test_slugs_are_githubs() -> None:
    assert (
        slug("Compatibility: containerd 1.6 to 2.4, runc 1.1 and 1.3, CRIU 4.1 and 4.2")
        == "compatibility-containerd-16-to-24-runc-11-and-13-criu-41-and-42"
    )
    assert slug("`podshim node setup`") == "podshim-node-setup"
    assert slug("## [runtimes.&lt;handler&gt;]".lstrip("# ")) == "runtimeshandler"
    assert slug("3.1 The proxy — front and daemon") == "31-the-proxy--front-and-daemon"
    assert slug("[server] `state_dir`") == "server-state_dir"
    assert slug("See [the guide](install.md) now") == "see-the-guide-now"


def test_the_check_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Same\n\n## Same\n\n"
        "[ok](docs/a.md#a-heading) [ok](#same-1) [ok](docs/sub/) [web](https://example.com/x.md)\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#nope) ![img](docs/p.png)\n"
        "`[in code](docs/missing.md)`\n\n```text\n[in a fence](docs/missing.md)\n```\n"
        "[ref]: docs/sub/b.md#b\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "A heading\n=========\n\n[up](../README.md#top) [out](../../outside.md) [abs](/etc/passwd)\n"
    )
    (tmp_path / "docs" / "sub" / "b.md").write_text('<a id="b"></a>\n')
    assert problems(tmp_path / "README.md", tmp_path) == [
        "README.md:8: docs/missing.md: no such file docs/missing.md",
        "README.md:8: docs/a.md#nope: no heading #nope in docs/a.md",
        "README.md:8: docs/p.png: no such file docs/p.png",
    ]
    outside = os.path.relpath(tmp_path.parent / "outside.md", tmp_path)
    assert problems(tmp_path / "docs" / "a.md", tmp_path) == [
        f"docs/a.md:4: ../../outside.md: no such file {outside}",
        "docs/a.md:4: /etc/passwd: an absolute path (links are relative to the page)",
    ]
    assert problems(tmp_path / "docs" / "sub" / "b.md", tmp_path) == []


def test_a_nav_entry_naming_a_directory_stands_for_its_pages(tmp_path: Path) -> None:
    (tmp_path / "design" / "deep").mkdir(parents=True)
    for name in ("design/b.md", "design/a.md", "design/deep/c.md", "design/listed.md"):
        (tmp_path / name).write_text("# x\n")
    nav = [
        {"Home": "index.md"},
        {"Design": ["design/listed.md", "design/", "empty/"]},
        "design/",
        {"None yet": "empty/"},
    ]
    listed = docgen._nav_files(nav)
    assert docgen._nav_dir_entries(nav, tmp_path, listed) == [
        {"Home": "index.md"},
        {"Design": ["design/listed.md", "design/a.md", "design/b.md", "design/deep/c.md"]},
        "design/a.md",
        "design/b.md",
        "design/deep/c.md",
    ]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """mkdocs.yml's nav holds every page of docs/ (a page left out is a warning, and --strict fails
    on one), and every link and anchor resolves on the site too."""
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "index.html").read_text().count('href="install/') >= 1
    assert (tmp_path / "site" / "reference" / "cli" / "podshim-checkpointpod" / "index.html").is_file()
