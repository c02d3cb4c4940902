"""The docs site: it builds with --strict, its code blocks are examples that run or marked fragments,
and its generated tables (serve flags, errors) match the code.

``python tests/test_docs.py`` rewrites the generated tables and examples/plain_loop.diff.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import actcache
import actcache.errors
from actcache.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
FRAGMENT = "<!-- fragment -->"
INCLUDE = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


# -- generated parts ------------------------------------------------------------------------------------

def serve_flags() -> list[tuple[str, str, str]]:
    """(flag, environment variable, help) of every ``actcache serve`` option, in the parser's order."""
    import argparse

    parser = argparse.ArgumentParser()
    COMMANDS["serve"][1][0](parser)
    rows = []
    for action in parser._actions:  # argparse has no public accessor for its options
        if not action.option_strings or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = f"{action.option_strings[0]} / {action.option_strings[1]}"
        rows.append((flag, f"ACTCACHE_{action.dest.upper()}", " ".join(action.help.replace("%%", "%").split())))
    return rows


def flags_table() -> str:
    lines = ["| flag | environment variable | what it sets |", "| --- | --- | --- |"]
    lines += [f"| `{flag}` | `{var}` | {text.replace('|', '/')} |" for flag, var, text in serve_flags()]
    return "\n".join(lines)


def _status(cls: type) -> str:
    if cls is actcache.ActCacheError:
        return "(base)"
    status = cls.status.name
    return "(client only)" if status == "UNKNOWN" else status


def error_classes() -> list[type]:
    return [getattr(actcache, name) for name in actcache.__all__
            if isinstance(getattr(actcache, name), type) and issubclass(getattr(actcache, name), BaseException)]


def errors_table() -> str:
    lines = ["| exception | is a | gRPC status | when |", "| --- | --- | --- | --- |"]
    for cls in error_classes():
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__ if b is not Exception) or "`Exception`"
        first = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        lines.append(f"| `{cls.__name__}` | {bases} | {_status(cls)} | {first.replace('|', '/')} |")
    return "\n".join(lines)


def quickstart_diff() -> str:
    def body(path: Path) -> list[str]:
        text = path.read_text()
        return text[text.index('"""', 3) + 3:].lstrip("\n").splitlines(keepends=True)

    diff = difflib.unified_diff(body(EXAMPLES / "plain_loop.py"), body(EXAMPLES / "plain_loop_actcache.py"),
                                "examples/plain_loop.py", "examples/plain_loop_actcache.py", n=2)
    return "".join(re.sub(r"^@@ .* @@$", "@@", line) for line in diff)


GENERATED = {  # page -> marker -> content
    DOCS / "operating" / "flags.md": {"flags": flags_table},
    DOCS / "reference" / "errors.md": {"errors": errors_table},
}


def _block(text: str, marker: str) -> str:
    match = re.search(rf"<!-- {marker}:start -->\n(.*?)<!-- {marker}:end -->", text, re.S)
    assert match, f"no <!-- {marker}:start/end --> block"
    return match.group(1).rstrip("\n")


def write_generated() -> None:
    for page, blocks in GENERATED.items():
        text = page.read_text()
        for marker, make in blocks.items():
            text = re.sub(rf"(<!-- {marker}:start -->\n).*?(<!-- {marker}:end -->)",
                          lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text, flags=re.S)
        page.write_text(text)
    (EXAMPLES / "plain_loop.diff").write_text(quickstart_diff())


# -- tests ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("actcache_client.ActCache", "actcache_client.connect", "actcache.ConfigTypeError"):
        assert f'id="{name}"' in api, f"{name} missing from the API reference"


def _code_blocks(page: Path) -> list[tuple[int, str, list[str], bool]]:
    """(line, language, body lines, marked as a fragment) of every fenced block of ``page``."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):])
            i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        blocks.append((start + 1, lang, body, before == FRAGMENT))
        i += 1
    return blocks


PAGES = sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_code_block_is_an_example_or_a_marked_fragment(page):
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for line, lang, body, fragment in _code_blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if lang == "mermaid":
            continue
        included = [INCLUDE.match(b) for b in body if b.strip()]
        if included and all(included):
            for m in included:
                path = ROOT / m.group(1)
                assert path.parent == EXAMPLES and path.is_file(), f"{where}: includes {m.group(1)}, not a file in examples/"
                assert path.stem in tests, f"{where}: no test runs {m.group(1)}"
            continue
        assert fragment, f"{where}: a code block that is neither included from examples/ nor marked {FRAGMENT}"
        if lang == "python":
            ast.parse("\n".join(body), filename=where)


def test_the_quickstart_diff_is_the_examples_diff():
    assert (EXAMPLES / "plain_loop.diff").read_text() == quickstart_diff(), "run: python tests/test_docs.py"


def test_the_readme_quickstart_is_the_examples_diff_and_the_readme_is_short():
    readme = (ROOT / "README.md").read_text()
    assert "```diff\n" + (EXAMPLES / "plain_loop.diff").read_text() + "```" in readme
    assert len(readme.splitlines()) <= 250
    changed = [line for line in quickstart_diff().splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len([line for line in changed if line.startswith("+")]) <= 5


@pytest.mark.parametrize("page, marker", [(p, m) for p, blocks in GENERATED.items() for m in blocks])
def test_generated_tables_match_the_code(page, marker):
    assert _block(page.read_text(), marker) == GENERATED[page][marker](), "run: python tests/test_docs.py"


def test_every_serve_flag_and_variable_is_documented():
    text = (DOCS / "operating" / "flags.md").read_text()
    for flag, var, _ in serve_flags():
        assert f"`{flag}`" in text and f"`{var}`" in text, flag
    read = set()
    for path in [*(ROOT / "actcache").rglob("*.py"), *(ROOT / "client").rglob("*.py")]:
        read |= set(re.findall(r"ACTCACHE_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    missing = {v for v in read - {"ACTCACHE_FLAG"} if f"`{v}`" not in text}
    assert not missing, f"environment variables read by the code but not in flags.md: {sorted(missing)}"


def test_the_errors_page_covers_every_exported_error():
    text = (DOCS / "reference" / "errors.md").read_text()
    assert len(error_classes()) == 18
    for cls in error_classes():
        assert f"`{cls.__name__}`" in text
        assert cls.__name__ in actcache.errors.__doc__, f"{cls.__name__} missing from the tree in actcache/errors.py"


if __name__ == "__main__":
    write_generated()
