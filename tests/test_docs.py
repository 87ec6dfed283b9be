"""Docs that cannot rot: the site builds strictly, every shell and Python snippet of README.md
and docs/ runs, every `calibrl` command they show uses real flags, and the built site renders
in a real headless Chromium.

Snippets: every ```bash and ```python fence is executed unless the line right before it is
`<!-- skip: reason -->` (the reason is shown on the page). The blocks of one page run in
order, as one bash script in a fresh folder that sees the repository's files (configs/,
examples/, ...) and ../shared beside it, as a reader following the page from the
repository root would; Python blocks run with this interpreter. Background processes a
page starts (`calibrl serve ... &`) are stopped with SIGTERM at the end. The fixed service
ports the pages use (50051, 50052, 9464) are swapped for free ones, so pages never collide with
anything else on the machine.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->\s*$")
EXECUTED = ("bash", "python")
SERVICE_PORTS = ("50051", "50052", "9464")

# Pages written by other parts of the docs at the same time; until they land these are
# one-line placeholders. The lead empties this list when merging.
PAGES_PROVIDED_ELSEWHERE: tuple[str, ...] = ()

# Pages whose snippets train, build indexes or start services: minutes, not seconds.
SLOW_PAGES = {
    "README.md", "getting-started/demo.md", "getting-started/hotpotqa.md", "guides/own-model-and-corpus.md",
    "guides/rubric-from-feedback.md", "guides/clients.md", "guides/security.md", "guides/telemetry.md",
}


def doc_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def page_name(path: pathlib.Path) -> str:
    return "README.md" if path == ROOT / "README.md" else path.relative_to(DOCS).as_posix()


def snippets(path: pathlib.Path) -> list[tuple[str, str, str | None]]:
    """(language, code, skip reason or None) of every fenced block of a page, in order."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        found.append((match.group(1), match.group(2), skip.group(1) if skip else None))
    return found


def executed_pages() -> list[pathlib.Path]:
    return [p for p in doc_pages() if any(lang in EXECUTED and skip is None for lang, _, skip in snippets(p))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def page_script(path: pathlib.Path, ports: dict[str, str]) -> str:
    """One bash script running a page's executed blocks in order."""
    parts = ["set -euo pipefail",
             # stop what the page started in the background: SIGTERM, as a reader's Ctrl-C would
             "trap 'for p in $(jobs -p); do kill -TERM $p 2>/dev/null || true; done; wait' EXIT"]
    for lang, code, skip in snippets(path):
        if lang not in EXECUTED or skip is not None:
            continue
        for documented, free in ports.items():
            code = code.replace(documented, free)
        if lang == "bash":
            parts.append(code)
        else:
            parts.append(f"python - <<'CALIBRL_DOCS_SNIPPET'\n{code}CALIBRL_DOCS_SNIPPET")
    return "\n".join(parts) + "\n"


def reader_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    """A folder that looks like the repository root to a reader: its files, read through
    symlinks, ../shared beside it, and room for everything the page writes."""
    work = tmp_path / "calibrl"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "site", "__pycache__", ".pytest_cache"):
            (work / entry.name).symlink_to(entry)
    shared = ROOT.parent / "shared"
    if shared.exists():
        (tmp_path / "shared").symlink_to(shared)
    return work


def run_page(path: pathlib.Path, tmp_path: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
    ports = {documented: str(free_port()) for documented in SERVICE_PORTS}
    script = page_script(path, ports)
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           # one thread per process: tiny models and the embedder run fastest so on a shared machine
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(["bash", "-c", script], cwd=reader_folder(tmp_path), env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


# --------------------------------------------------------------------------- the snippets


def test_every_snippet_is_executed_or_says_why_not():
    """A fenced block is bash/python (executed), or another language, or skipped with a reason."""
    problems = []
    for path in doc_pages():
        for lang, code, skip in snippets(path):
            if not lang:
                problems.append(f"{page_name(path)}: a fence without a language: {code[:60]!r}")
            if skip is not None and lang not in EXECUTED:
                problems.append(f"{page_name(path)}: a skip marker before a ```{lang} block, which never runs")
            if lang == "sh" and "calibrl " not in code:
                problems.append(f"{page_name(path)}: a ```sh block; write ```bash (executed) or ```text")
    assert not problems, "\n".join(problems)


def test_skipped_snippets_show_their_reason():
    """The skip reason is on the page (an HTML comment renders to nothing): the block is
    preceded by the comment, and the reason is short enough to be read where it stands."""
    for path in doc_pages():
        for lang, _, skip in snippets(path):
            if skip is not None:
                assert len(skip) >= 10, f"{page_name(path)}: skip reason too short: {skip!r}"


def calibrl_commands(text: str) -> list[str]:
    """Every `calibrl ...` command line of the bash/sh/console blocks of a page."""
    commands = []
    for match in FENCE.finditer(text):
        lang, code = match.group(1), match.group(2)
        if lang not in ("bash", "sh", "console"):
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip().removeprefix("$ ")
            for part in re.split(r"\s*(?:&&|\|\||;|\||&)\s*", line):
                part = part.strip()
                if part.startswith("until "):
                    part = part[len("until "):]
                if part.startswith("calibrl "):
                    commands.append(part)
    return commands


def test_documented_commands_use_real_flags(capsys):
    """Every --flag of every `calibrl` command in README.md and docs/ is one its parser accepts."""
    from calibrl.cli import COMMANDS
    from calibrl.cli import main as calibrl_main

    help_texts: dict[tuple[str, ...], str] = {}
    problems = []
    seen = set()
    for path in doc_pages():
        for command in calibrl_commands(path.read_text(encoding="utf-8")):
            words = command.split()[1:]
            name = next((tuple(words[:n]) for n in (2, 1) if tuple(words[:n]) in COMMANDS), None)
            if name is None:
                if words and words[0] not in ("--help", "--version", "-h", "-V"):
                    problems.append(f"{page_name(path)}: unknown command `{command}`")
                continue
            seen.add(name)
            if name not in help_texts:
                with pytest.raises(SystemExit):
                    calibrl_main([*name, "--help"])
                help_texts[name] = capsys.readouterr().out
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command):
                if flag not in help_texts[name]:
                    problems.append(f"{page_name(path)}: `calibrl {' '.join(name)}` has no {flag}")
    assert not problems, "\n".join(problems)
    # the docs walk the whole pipeline
    for name in (("demo",), ("index", "build"), ("serve", "retrieval"), ("serve", "judge"), ("rubric", "distill"),
                 ("rubric", "validate"), ("rubric", "train-judge"), ("train",), ("eval",), ("sme", "sample"),
                 ("sme", "review"), ("health",)):
        assert name in seen, f"no page shows `calibrl {' '.join(name)}`"


def test_documented_examples_parse():
    """The feedback record and the rubric the judge pages show are valid."""
    import json

    from calibrl.judge_server.authoring.feedback import parse_record
    from calibrl.judge_server.rubric import parse_rubric

    guide = (DOCS / "guides" / "rubric-from-feedback.md").read_text(encoding="utf-8")
    [feedback] = [code for lang, code in FENCE.findall(guide) if lang == "json"]
    record = parse_record(json.loads(feedback))
    assert record.grade == 5 and record.expert_pass()
    concept = (DOCS / "concepts" / "judge.md").read_text(encoding="utf-8")
    [rubric_yaml] = [code for lang, code in FENCE.findall(concept) if lang == "yaml"]
    rubric = parse_rubric(rubric_yaml, "docs/concepts/judge.md")
    assert [c.kind for c in rubric.criteria] == ["programmatic", "llm", "programmatic"]
    assert rubric.criteria[2].penalty and rubric.glossary == ("expense ratio", "VTSAX")


FAST_PAGES = [p for p in executed_pages() if page_name(p) not in SLOW_PAGES]
SLOW = [p for p in executed_pages() if page_name(p) in SLOW_PAGES]


@pytest.mark.parametrize("path", FAST_PAGES, ids=page_name)
def test_page_snippets_run(path, tmp_path):
    result = run_page(path, tmp_path, timeout=300)
    assert result.returncode == 0, f"{page_name(path)} failed:\n{result.stdout[-6000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW, ids=page_name)
def test_slow_page_snippets_run(path, tmp_path):
    """Pages that build indexes, start services and train (each sized to a few minutes)."""
    if "../shared/data/" in path.read_text(encoding="utf-8") and not (ROOT.parent / "shared" / "data").is_dir():
        pytest.skip("needs ../shared/data (HotpotQA) beside the repository")
    result = run_page(path, tmp_path, timeout=900)
    assert result.returncode == 0, f"{page_name(path)} failed:\n{result.stdout[-6000:]}"
    # every metric a training run of the page logged is on the metrics reference page
    logged = set()
    for metrics_file in (tmp_path / "calibrl").glob("runs/**/metrics.jsonl"):
        for line in metrics_file.read_text(encoding="utf-8").splitlines():
            logged.update(json.loads(line))
    undocumented = sorted(name for name in logged if not documented_metric(name))
    assert not undocumented, f"metrics missing from calibrl/trainer/metrics_catalog.py: {undocumented}"


def documented_metric(name: str) -> bool:
    """Whether the trainer-metrics page (generated from calibrl.trainer.metrics_catalog) names this
    metric (`<component>`, `<name>` match any part)."""
    from calibrl.trainer.metrics_catalog import documented

    return documented(name)


def test_metrics_page_matches_the_names_it_documents():
    import importlib.util

    for name in ("reward", "rewards/retrieval/mean", "rewards/rubric/std", "calibadv/rebalance_factor", "kl"):
        assert documented_metric(name), name
    assert not documented_metric("rewards/retrieval/median")
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.trainer_metrics_reference()
    from calibrl.trainer.metrics_catalog import all_metrics

    for metric in all_metrics():  # every catalogued name is on the generated page, in a table row
        for name in metric.names:
            assert any(row.startswith("| ") and f"`{name}`" in row.split(" | ")[0] for row in page.splitlines()), name


# --------------------------------------------------------------------------- the site


def mkdocs_build(site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("mkdocs", reason="building the site needs the docs extra: pip install -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    result = mkdocs_build(site)
    assert result.returncode == 0, result.stdout[-8000:]
    return site


def test_mkdocs_build_strict(built_site):
    """`mkdocs build --strict`: no broken link, anchor or nav entry; every reference page built."""
    for page in ("index.html", "reference/cli/index.html", "reference/config/index.html",
                 "reference/grpc/index.html", "reference/python/index.html", "reference/errors/index.html",
                 "reference/metrics/index.html", "results/benchmarks/index.html"):
        assert (built_site / page).is_file(), page
    # a skipped snippet's reason is shown on the built page
    html = (built_site / "guides" / "vllm-judge" / "index.html").read_text(encoding="utf-8")
    assert "Not run by the documentation tests" in html and "needs a GPU, vLLM and a judge model folder" in html
    # the demo page's figures are drawn at build time, and every image it shows is there
    demo = built_site / "results" / "demo" / "index.html"
    images = re.findall(r'<img[^>]* src="([^"]+)"', demo.read_text(encoding="utf-8"))
    assert len(images) >= 2, images
    for image in images:
        assert (demo.parent / image).resolve().is_file(), image
    # the alarms table is filled from calibrl.trainer.alarms
    signals = (built_site / "concepts" / "training-signals" / "index.html").read_text(encoding="utf-8")
    assert "<code>update_skipped</code>" in signals and "generated: trainer-alarms" not in signals


def test_every_page_is_in_the_nav():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)

    def entries(nav):
        for item in nav:
            for value in (item.values() if isinstance(item, dict) else [item]):
                yield from (entries(value) if isinstance(value, list) else [value])

    in_nav = set(entries(config["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    generated = set(hook.PAGES)
    assert not on_disk - in_nav, f"pages missing from the nav: {sorted(on_disk - in_nav)}"
    assert not in_nav - on_disk - generated - set(PAGES_PROVIDED_ELSEWHERE), sorted(in_nav - on_disk - generated)
    assert not generated & on_disk, "a generated reference page also exists on disk"


def test_generated_reference_covers_the_code():
    """The generated pages hold every command, flag, config field, rpc and error."""
    import dataclasses
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    from calibrl.cli import COMMANDS

    cli = hook.cli_reference()
    for words in COMMANDS:
        parser = hook.command_parser(words)
        assert f"## calibrl {' '.join(words)}" in cli
        for action in parser._actions:
            for option in set(action.option_strings) - {"-h", "--help"}:
                assert f"`{option}`" in cli, (words, option)
    config = hook.config_reference()
    from calibrl.retrieval_server.config import RetrievalServerConfig
    from calibrl.trainer.config import TrainConfig

    for cls in (RetrievalServerConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in config or f"`{f.name}." in config, f.name
    assert "`optimizer.lr`" in config and "`serving.tls_cert_file`" in config and "`judge.max_request_chars`" in config
    assert "`advantage.lambda_`" in config  # a tagged-union variant's field
    grpc_page = hook.grpc_reference()
    for rpc in ("Search", "ScoreRetrieval", "GetIndexInfo", "Score", "ListRubrics", "GetRubric"):
        assert f"| `{rpc}` |" in grpc_page
    errors_page = hook.errors_reference()
    for code in ("INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAUTHENTICATED"):
        assert code in errors_page
    limits = hook.limits_reference()
    assert "`max_top_k`" in limits and "`judge.max_batch_size`" in limits and "`serving.max_request_mb`" in limits


def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_benchmarks_page_is_generated_from_the_benchmarks_readme():
    """The site's benchmark tables are those of benchmarks/README.md, cell for cell, each under
    its section with its commands; none tells measurement history; the replaced domain's
    sections stay off the site."""
    hook = _hook()
    source = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    page = hook.benchmarks_page()
    tables = hook.benchmark_tables(source)
    assert len(tables) >= 15
    for table in tables:
        assert hook._site_text(table) in page
        assert "\n".join(table) in source
    page_tables = [b for b in hook._blocks(page.splitlines()) if b[0].startswith("|")]
    assert len(page_tables) == len(tables)  # every table on the page comes from the source
    assert not hook.HISTORY.search(page), hook.HISTORY.search(page)
    assert "/tmp/" not in page
    for heading in ("## Retrieval service", "## Trainer (`benchmarks/bench_trainer.py`)",
                    "## The services under abuse (`benchmarks/bench_abuse.py`)"):
        assert f"\n{heading}\n" in page
    assert "| hybrid | 0.625 |" in page  # the retrieval quality table, as measured
    assert "## Search-agent study" not in page and "probe_warm_start" not in page
    assert "```bash" not in page  # the measuring commands are shown, not run by these tests


def test_benchmark_history_stays_off_the_site():
    hook = _hook()
    source = """<!-- section:x -->
## X (`benchmarks/bench_x.py`)

Machine: 2 cores.

```bash
python benchmarks/bench_x.py --out /tmp/x/y.json
```

Now, one run:

| a | b |
| --- | --- |
| 1 | 2 |

The same in session 3:

| a | b |
| --- | --- |
| 3 | 4 |
<!-- /section:x -->
"""
    [(name, blocks)] = hook.benchmark_units(source)
    assert name == "x"
    shown = "\n\n".join(hook._site_text(b) for b in blocks)
    assert "| 1 | 2 |" in shown and "| 3 | 4 |" not in shown and "session" not in shown
    assert "Machine: 2 cores." in shown and "--out <dir>" in shown and "Now, one run:" in shown


# --------------------------------------------------------------------------- in a browser

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="headless Chromium not found: on Debian/Ubuntu run 'apt-get install chromium "
                    "chromium-driver' (as root), then 'pip install selenium'")
def test_site_renders_in_a_browser(built_site):
    """The built site in headless Chromium, served over HTTP: navigation, the search box (typing
    finds a reference page) and a generated reference page render."""
    pytest.importorskip("selenium")
    import functools
    import http.server
    import threading

    from selenium import webdriver
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        driver.get(base + "/")
        wait = WebDriverWait(driver, 30, poll_frequency=0.2, ignored_exceptions=(
            NoSuchElementException, StaleElementReferenceException, StopIteration))
        nav_links = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "nav.md-nav .md-nav__link"))
        titles = {" ".join(link.get_attribute("textContent").split()) for link in nav_links}
        assert any(link.tag_name == "a" and link.is_displayed() for link in nav_links)
        for section in ("Getting started", "Concepts", "How-to guides", "Reference", "Results"):
            assert section in titles, sorted(titles)
        # search: the box opens, and typing a command name lists the CLI reference
        box = wait.until(lambda d: next(b for b in d.find_elements(By.CSS_SELECTOR, "input.md-search__input")
                                        if b.is_displayed()))
        box.click()
        box.send_keys("train-judge")
        # read the result links in the page itself: the list is re-rendered as results arrive
        hrefs = "return [...document.querySelectorAll('.md-search-result__link')].map(a => a.href)"
        results = wait.until(lambda d: [h for h in d.execute_script(hrefs) if "reference/cli" in h])
        assert results
        # a generated reference page: the CLI tables
        driver.get(base + "/reference/cli/")
        heading = wait.until(lambda d: d.find_element(By.ID, "calibrl-rubric-train-judge"))
        assert "calibrl rubric train-judge" in heading.text
        cells = driver.find_elements(By.CSS_SELECTOR, "article table td code")
        assert any(cell.text == "--golden-out" for cell in cells)
        # the configuration page renders its tables too
        driver.get(base + "/reference/config/")
        wait.until(lambda d: any(c.text == "optimizer.lr" for c in d.find_elements(By.CSS_SELECTOR, "td code")))
        # the generated trainer-metrics and benchmarks pages render their tables
        driver.get(base + "/reference/metrics/")
        wait.until(lambda d: any(c.text == "calibadv/rebalance_factor" for c in d.find_elements(By.CSS_SELECTOR, "td code")))
        driver.get(base + "/results/benchmarks/")
        wait.until(lambda d: any(c.text == "hybrid" for c in d.find_elements(By.CSS_SELECTOR, "article table td")))
    finally:
        driver.quit()
        server.shutdown()


def test_config_page_holds_every_key_print_config_prints():
    """Every `key = default  # doc` line of `calibrl train --print-config` is a row of the
    configuration page, with the same doc (the page and the command read one source)."""
    import ast

    hook = _hook()
    page = hook.config_reference()
    result = subprocess.run([sys.executable, "-m", "calibrl.cli", "train", "--print-config"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    rows: dict[str, list[str]] = {}  # a tagged union's variants share keys (advantage.type)
    for row in page.splitlines():
        if row.startswith("| `"):
            rows.setdefault(row.split("`")[1], []).append(row)
    keys = 0
    for line in result.stdout.splitlines():
        line = line.strip()
        if line.startswith("#") or " = " not in line:
            continue
        key, rest = line.split(" = ", 1)
        keys += 1
        assert key in rows, f"`calibrl train --print-config` prints {key}, the configuration page lacks it"
        value, _, doc = rest.partition("  # ")
        assert any(hook._cell(doc) in row for row in rows[key]), (key, doc)
        try:
            default = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            continue
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            assert any(f"`{default}`" in row for row in rows[key]), (key, default, rows[key])
    assert keys >= 50


# `a.b` names in the prose that are not config keys although they start like one
NOT_CONFIG_KEYS = {"serving.encoder": "an entry of GetIndexInfo's library_versions"}
FILE_NAME = re.compile(r".*\.(?:py|pt|proto|jsonl|json|yaml|yml|md|txt|safetensors)$")


def test_prose_names_config_keys_and_metrics_that_exist():
    """A config key (`rollout.off_policy_steps`) or a trainer metric (`calibadv/rebalance_factor`)
    named in the prose of README.md or docs/ is one the code defines: a renamed key or metric
    fails here until the pages follow (the same names in --help, errors and docs)."""
    hook = _hook()
    from calibrl.trainer import metrics_catalog

    rows = {row.split("`")[1] for row in hook.config_reference().splitlines() if row.startswith("| `")}
    sections = {key.split(".")[0] for key in rows if "." in key}
    metric_prefixes = {n.split("/")[0] for m in metrics_catalog.all_metrics() for n in m.names if "/" in n}
    problems = []
    for path in doc_pages():
        prose = FENCE.sub("", path.read_text(encoding="utf-8"))
        for token in re.findall(r"`([^`\s]+)`", prose):
            key = token.split("=")[0]
            if (re.fullmatch(r"[a-z_]+(?:\.[a-z_0-9]+)+", key) and key.split(".")[0] in sections
                    and not FILE_NAME.fullmatch(key) and key not in NOT_CONFIG_KEYS
                    and key not in rows and not any(r.startswith(key + ".") for r in rows)):
                problems.append(f"{page_name(path)}: `{token}` is no config key")
            if (re.fullmatch(r"[a-z_]+(?:/[a-z_@0-9<>]+)+", token) and token.split("/")[0] in metric_prefixes
                    and not FILE_NAME.fullmatch(token) and not metrics_catalog.documented(token)):
                problems.append(f"{page_name(path)}: `{token}` is no trainer metric")
    assert not problems, "\n".join(problems)


def test_every_benchmark_table_of_a_shown_section_is_on_the_site():
    """No table of benchmarks/README.md is kept off the site by a caption that tells history:
    measurement history lives in benchmarks/HISTORY.md."""
    hook = _hook()
    source = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    every = [b for name, blocks in hook.benchmark_sections(source) if name not in hook.BENCHMARKS_NOT_SHOWN
             for b in blocks if b[0].startswith("|")]
    assert len(hook.benchmark_tables(source)) == len(every)
    page = hook.benchmarks_page()
    assert "bench_encoders.py --parts bm25 --repeats 5 --record benchmarks/records/encoders-bm25.json" in page
    assert "| stage | seconds |" in page  # the demo's stage times, from results/demo/results.json
    assert (ROOT / "benchmarks" / "HISTORY.md").is_file()
