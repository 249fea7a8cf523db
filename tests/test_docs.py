"""The README and the documentation site: runnable, built, and true to the committed results."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"

sys.path.insert(0, str(ROOT / "bench"))
import render_tables  # noqa: E402

FENCE = re.compile(r"(?P<before>[^\n]*)\n```(?P<lang>[a-z]*)\n(?P<body>.*?)\n```", re.S)


def readme_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, code, skipped) of every fenced block; skipped when the line before is ``<!-- skip-test ... -->``."""
    return [
        (m["lang"], m["body"], m["before"].strip().startswith("<!-- skip-test")) for m in FENCE.finditer("\n" + text)
    ]


def nav_pages() -> set[str]:
    return set(re.findall(r":\s*([\w./-]+\.md)\s*$", MKDOCS.read_text(), re.M))


# -- the site's structure ----------------------------------------------------------------------


def test_every_guide_is_in_the_nav():
    missing = [p.name for p in sorted((DOCS / "guides").glob("*.md")) if f"guides/{p.name}" not in nav_pages()]
    assert not missing, f"add these pages to the Guides section of mkdocs.yml's nav: {missing}"


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - nav_pages() == set(), "pages missing from mkdocs.yml's nav"
    assert nav_pages() - pages == set(), "mkdocs.yml's nav names pages that do not exist"


def test_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "index-class" / "index.html").read_text().count("search") > 3


# -- generated numbers -------------------------------------------------------------------------


def test_committed_tables_equal_what_render_tables_renders():
    stale = [str(p.relative_to(ROOT)) for p, _ in render_tables.stale_documents()]
    assert not stale, f"tables differ from the results in {stale}: run python bench/render_tables.py"


def test_every_marker_names_a_known_table_and_every_table_is_used():
    used = set()
    for path in render_tables.documents():
        used |= {m[2] for m in render_tables.BLOCK.finditer(path.read_text())}
    assert used <= set(render_tables.TABLES)
    assert set(render_tables.TABLES) - used == set(), "tables rendered but shown nowhere"


def test_a_hand_edited_table_is_detected():
    text = "x\n<!-- table:quantized -->\n| made up | 1.0 |\n<!-- /table -->\ny\n"
    rendered = render_tables.render_text(text, "test", {})
    assert rendered != text
    assert "cranfield" in rendered and rendered.startswith("x\n") and rendered.endswith("y\n")
    assert render_tables.render_text(rendered, "test", {}) == rendered


def test_an_unknown_table_name_is_an_error():
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        render_tables.render_text("<!-- table:nope -->\n<!-- /table -->", "f.md", {})


# -- the README --------------------------------------------------------------------------------


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 260
    assert not re.search(r"issue #?\d", text, re.I)
    assert not re.search(r"\bcommit [0-9a-f]{7,}|`[0-9a-f]{7,40}`", text)
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_readme_blocks_run_on_the_sample(tmp_path):
    """Every bash and python block of the README not marked ``<!-- skip-test -->`` runs as written."""
    blocks = [(lang, code) for lang, code, skipped in readme_blocks(README.read_text()) if not skipped]
    assert [lang for lang, _ in blocks if lang in ("bash", "python")], "no runnable block found"
    (tmp_path / "data" / "sample").mkdir(parents=True)
    shutil.copytree(ROOT / "data" / "sample" / "cranfield", tmp_path / "data" / "sample" / "cranfield")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "gpusparse"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gpusparse.cli "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    for lang, code in blocks:
        if lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        elif lang == "python":
            cmd = [sys.executable, "-c", code]
        else:
            continue
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
    assert (tmp_path / "run.trec").exists() and (tmp_path / "cranfield-index-py" / "manifest.json").exists()


def test_every_documented_public_object_has_a_docstring():
    """The API reference is generated from docstrings (mkdocstrings): every object a reference
    page names, and every public function, class and method of a module it names, has one."""
    import importlib
    import inspect

    missing = []
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for target in re.findall(r"^::: ([\w.]+)", page.read_text(encoding="utf-8"), flags=re.MULTILINE):
            module_name, obj = target, None
            while True:
                try:
                    module = importlib.import_module(module_name)
                    break
                except ModuleNotFoundError:
                    module_name, _, attr = module_name.rpartition(".")
                    obj = attr if obj is None else f"{attr}.{obj}"
            if obj is not None:
                value = module
                for part in obj.split("."):
                    value = getattr(value, part)
                objects = [(target, value)]
            else:
                names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
                objects = [(target, module)]
                for n in names:
                    value = getattr(module, n)
                    if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__:
                        objects.append((f"{target}.{n}", value))
            for name, value in list(objects):
                if inspect.isclass(value):
                    for m, member in vars(value).items():
                        if not m.startswith("_") and inspect.isfunction(member):
                            objects.append((f"{name}.{m}", member))
            missing += [name for name, value in objects if not (inspect.getdoc(value) or "").strip()]
    assert not missing, f"public objects without a docstring: {sorted(set(missing))}"
