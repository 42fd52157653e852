"""The README and every docs/ page: the site builds with `mkdocs build --strict`, the reference pages equal what
docs/gen_reference.py makes now, and every runnable block of every page runs as written, against the servers the
page itself starts (tests/helpers/docs.py: the notes that say what runs, the runner)."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.docs import NOT_RUN, RUNS, SERVE_LINE, STARTS, Servers, blocks, env_for, pages, run_page

pytestmark = pytest.mark.live_server

ROOT = Path(__file__).parent.parent
ENV = env_for(sys.executable)


def test_reference_pages_are_what_the_cli_and_the_proto_say_now():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for flag in ("--http-port", "--served-model-name", "--pp", "--pp-balance", "--debug", "--auth-token-file"):
        assert f"`{flag} " in cli or f"`{flag}`" in cli, flag


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**ENV, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"


def test_every_example_is_run_or_says_why_not():
    """Every Python block, and every shell block that serves, calls a server or runs Python, carries a note: runs,
    starts, or `not run:` with its reason; a Python block that runs is complete (its imports in it)."""
    calls = re.compile(r"^\s*(curl|python|torchrun|logitserve|\.venv/bin/)|" + SERVE_LINE.pattern, re.M)
    for page in pages():
        for b in blocks(page):
            if b.lang == "python" or (b.lang in ("bash", "") and calls.search(b.body)):
                assert b.note.startswith((RUNS, STARTS, NOT_RUN)), f"{b.where}: say whether it runs: {b.body[:80]}"
            if b.note.startswith(NOT_RUN):
                assert len(b.note) > len(NOT_RUN) + 10, f"{b.where}: say why it is not run"
            if b.note.startswith(RUNS) and b.lang == "python":
                assert re.match(r"(import|from) ", b.body), f"{b.where}: a fragment; make it a complete example"


def test_make_serve_runs_the_command_the_readme_starts():
    """The README starts `logitserve serve --http-port 8000` as what `make serve` runs; make says so too."""
    run = subprocess.run(["make", "-n", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and re.search(r"logitserve serve --http-port 8000\s*$", run.stdout, re.M), run.stdout
    first = next(b for b in blocks(ROOT / "README.md") if b.note.startswith(STARTS))
    assert first.body.split("#")[0].strip() == "logitserve serve --http-port 8000", first.body


def _triton_missing(b) -> bool:
    """The tritonclient block where tritonclient is not installed (tests/test_coexistence.py runs it where it is)."""
    return "tritonclient" in b.note and importlib.util.find_spec("tritonclient") is None


def test_every_page_runs_as_written(tmp_path):
    """Each page in order, in a fresh directory of its own: its servers from its own text, then its blocks. Prints
    pages x blocks (run, servers started, servers used again, not run)."""
    servers, report = Servers(), []
    try:
        for page in pages():
            report.append(run_page(page, servers, tmp_path / page.stem, skip=_triton_missing))
    finally:
        servers.stop()
    print("\npage                        run  started  reused  not run")
    for r in report:
        print(f"{str(r.page.relative_to(ROOT)):<28}{r.ran:>4}{r.started:>9}{r.reused:>8}{r.not_run:>9}")
    print(f"{'all':<28}{sum(r.ran for r in report):>4}{sum(r.started for r in report):>9}"
          f"{sum(r.reused for r in report):>8}{sum(r.not_run for r in report):>9}")
    assert sum(r.ran for r in report) >= 24
