"""The review page in a real headless Chromium (Debian's chromium + chromium-driver, driven
by Selenium): grade items with keyboard shortcuts, kill the server mid-way (SIGKILL),
restart it, and find every answer, the unsaved draft included.

Set CALIBRL_SME_SCREENSHOTS=DIR to keep a screenshot of each page there.
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("flask", reason="the review page needs Flask: pip install 'calibrl[sme]'")
pytest.importorskip("selenium", reason="the browser test drives Chromium with Selenium: pip install selenium")

from calibrl.judge_server import cli as judge_cli
from calibrl.judge_server.authoring.feedback import read_feedback, write_feedback
from tests.sme_fixtures import write_rubric, write_sample

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="headless Chromium not found: on Debian/Ubuntu run 'apt-get install chromium chromium-driver' "
        "(as root), then 'pip install selenium'",
    ),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ReviewServer:
    """``calibrl sme review`` as a subprocess on a fixed loopback port (a restart keeps the origin)."""

    def __init__(self, args: list[str], port: int) -> None:
        self.args, self.port, self.process = args, port, None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "calibrl.cli", "sme", "review", *self.args, "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.process.stdout.readline()
        assert f"listening on http://127.0.0.1:{self.port}/" in line, line + self.process.stdout.read()
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2)
                return
            except OSError:
                assert time.monotonic() < deadline, "review server did not answer /healthz"
                time.sleep(0.2)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)  # no clean shutdown: a crash
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=20)


@pytest.fixture()
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,1100", "--disable-extensions"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait_for(driver, condition, what, timeout=30.0):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page may be between two documents when polled ("node does not belong to the document",
    # stale or missing elements): that is "not yet", not a failure.
    wait = WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException, WebDriverException))
    return wait.until(lambda d: condition(d), message=what)


def press(driver, *keys):
    from selenium.webdriver.common.action_chains import ActionChains

    actions = ActionChains(driver)
    for key in keys:
        actions.send_keys(key)
    actions.perform()


def on_item(driver, number, total):
    script = "const el = document.getElementById('position'); return el ? el.textContent : '';"
    return wait_for(driver, lambda d: d.execute_script(script).strip().startswith(f"Item {number} of {total}")
                    and d.execute_script("return document.readyState") == "complete", f"item {number} page")


def shot(driver, name):
    folder = os.environ.get("CALIBRL_SME_SCREENSHOTS")
    if folder:
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(pathlib.Path(folder) / f"{name}.png"))


def test_grade_with_keys_kill_restart_and_find_every_answer(tmp_path, browser):
    from selenium.webdriver.common.keys import Keys

    items = write_sample(tmp_path / "sample.jsonl", 6)
    rubric, golden = write_rubric(tmp_path)
    golden_path = tmp_path / "golden.jsonl"
    write_feedback(golden_path, golden)
    assert judge_cli.validate(["--rubric", str(rubric), "--golden", str(golden_path), "--judge", "programmatic",
                               "embedder=hashed-ngrams"]) in (0, 1)
    out = tmp_path / "feedback.jsonl"
    port = free_port()
    server = ReviewServer(["--sample", str(tmp_path / "sample.jsonl"), "--rubric", str(rubric), "--out", str(out),
                           "--golden", str(golden_path), "--judge-option", "embedder=hashed-ngrams"], port)
    base = f"http://127.0.0.1:{port}"
    server.start()
    try:
        browser.get(base + "/")
        wait_for(browser, lambda d: d.find_elements("id", "name"), "the reviewer page")
        shot(browser, "reviewer")
        browser.find_element("id", "name").send_keys("alice", Keys.ENTER)
        on_item(browser, 1, 6)
        first_tag = browser.find_element("css selector", "input[name=tags][data-key=a]").get_attribute("value")

        press(browser, "4", "a", Keys.ENTER)  # grade 4, first rubric tag, save
        on_item(browser, 2, 6)
        assert "1 / 6 graded by alice" in browser.find_element("id", "progress").text
        press(browser, "2", "f", "/", "dropped the ticker", Keys.ESCAPE, Keys.ENTER)
        on_item(browser, 3, 6)
        press(browser, "5", "p")
        shot(browser, "item")
        press(browser, Keys.ENTER)
        on_item(browser, 4, 6)
        assert len(read_feedback(out)) == 3  # each answer on disk as soon as the page moved on

        press(browser, "3", "/", "half typed when the server died")  # typed, not saved
        server.kill()
        assert [r.id for r in read_feedback(out)] == [f"{i.id}@alice" for i in items[:3]]  # survived SIGKILL

        server.start()
        browser.refresh()
        on_item(browser, 4, 6)
        wait_for(browser, lambda d: d.find_element("id", "notes").get_attribute("value")
                 == "half typed when the server died", "the draft restored after the restart")
        assert browser.find_element("css selector", "input[name=grade][value='3']").is_selected()
        press(browser, Keys.ESCAPE, Keys.ENTER)
        on_item(browser, 5, 6)

        browser.get(base + "/review")  # resumes at the first item alice has not graded
        on_item(browser, 5, 6)
        press(browser, "1", Keys.ENTER)
        on_item(browser, 6, 6)
        press(browser, "p", Keys.ENTER)  # a verdict alone is an answer
        wait_for(browser, lambda d: "has graded all 6 items" in d.find_element("id", "message").text, "all done")

        records = {r.id: r for r in read_feedback(out)}
        assert sorted(records) == sorted(f"{i.id}@alice" for i in items)
        by_item = [records[f"{i.id}@alice"] for i in items]
        assert [r.grade for r in by_item] == [4, 2, 5, 3, 1, None]
        assert [r.verdict for r in by_item] == [None, "fail", "pass", None, None, "pass"]
        assert by_item[0].error_tags == (first_tag,)
        assert by_item[1].notes == "dropped the ticker" and by_item[3].notes == "half typed when the server died"

        # A second reviewer, then the agreement page.
        browser.get(base + "/reviewer")
        field = wait_for(browser, lambda d: d.find_element("id", "name"), "reviewer page")
        field.clear()
        field.send_keys("bob", Keys.ENTER)
        on_item(browser, 1, 6)
        press(browser, "4", Keys.ENTER)
        on_item(browser, 2, 6)
        press(browser, "5", Keys.ENTER)
        on_item(browser, 3, 6)
        browser.get(base + "/agreement")
        wait_for(browser, lambda d: "alice vs bob" in d.page_source, "agreement page")
        assert f'href="/item/2">{items[1].id}</a>' in browser.page_source  # alice failed it, bob passed it
        shot(browser, "agreement")
        browser.get(base + "/rubric")
        wait_for(browser, lambda d: d.find_elements("css selector", ".validation .kappa"), "rubric page")
        assert "Golden items where judge and experts disagree" in browser.page_source
        browser.set_window_size(1280, 2400)
        shot(browser, "rubric")
    finally:
        server.stop()
    assert len(read_feedback(out)) == 8
