"""The chat page in a real browser (Debian's chromium + chromedriver, headless, driven by
selenium) against the app served over TCP on the fake engine: a streamed reply and its
figures, the settings reaching the request, the stop button, the API key asked once and
kept, and the Markdown renderer keeping model text out of the HTML parser.

``make test-e2e`` runs them and provides chromium where it can (scripts/install_browser.sh).
Without it the tests are skipped on a developer's machine but fail under CI (``CI`` set),
so CI cannot pass without running them."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

from server.app import create_app
from server.engine_bridge import EngineBridge
from server.settings import ServerSettings
from tests.fake_engine import FakeEngine, ScriptedEngine
from tests.server.live import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "page-key"

pytestmark = pytest.mark.e2e  # a real browser: `make test-e2e`


def _need_browser() -> None:
    """Fail under CI, skip elsewhere, when chromium or chromedriver is missing (checked when
    the tests run, so that deselecting them needs no browser)."""
    if CHROMIUM and CHROMEDRIVER:
        return
    if os.environ.get("CI"):
        pytest.fail("chromium and chromedriver are needed (make test-e2e provides them)")
    pytest.skip("chromium / chromedriver not installed (scripts/install_browser.sh)")


class Served:
    """The app on the fake engine, served by uvicorn in a thread."""

    def __init__(
        self,
        api_key: str | None = None,
        loaded: threading.Event | None = None,
        engine: FakeEngine | None = None,
    ) -> None:
        self.engine = engine if engine is not None else FakeEngine(token_delay=0.03)
        engine: Any = self.engine
        if loaded is not None:  # the model "loads" until the event is set

            def factory() -> FakeEngine:
                loaded.wait(20)
                return self.engine

            engine = EngineBridge(factory)
        app = create_app(engine, ServerSettings(api_key=api_key))
        self.bridge = app.state.ctx.bridge
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _need_browser()
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in CI containers
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        # No network beyond loopback: keep Chromium from trying.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, condition: Any, timeout: float = 15) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(condition)


def page_errors(driver: Any) -> list[str]:
    """Console errors (a CSP violation or a script error shows here)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def set_value(driver: Any, element_id: str, value: str) -> None:
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(value)


def ask(driver: Any, text: str) -> None:
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)


def last_reply(driver: Any) -> Any:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def test_streamed_reply_with_figures_and_settings(browser):
    with Served() as served:
        browser.get(served.url)
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        assert browser.find_element(By.ID, "model").text == "fake-model"
        drafters = [o.text for o in Select(browser.find_element(By.ID, "drafter")).options]
        assert drafters == ["server default", "mtp", "ngram", "none"]
        set_value(browser, "temperature", "0")
        set_value(browser, "max-tokens", "40")
        set_value(browser, "system", "Be brief.")
        Select(browser.find_element(By.ID, "drafter")).select_by_value("ngram")
        Select(browser.find_element(By.ID, "depth")).select_by_value("2")
        ask(browser, "Hello there")
        # Streaming: text shows while the reply is still being written.
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant.streaming"))
        wait(
            browser,
            lambda d: (
                last_reply(d).text.strip() and "streaming" in last_reply(d).get_attribute("class")
            ),
        )
        stats = wait(browser, lambda d: last_reply(d).find_elements(By.CLASS_NAME, "stats"))[0]
        request = served.engine.requests[-1]
        assert request.drafter == "ngram" and request.depth == 2 and request.max_tokens == 40
        assert request.sampler.temperature == 0
        assert "Be brief." in served.engine.tokenizer.decode(request.prompt_ids)
        body = last_reply(browser).find_element(By.CLASS_NAME, "body").text
        assert body == served.engine.expected_text(request).strip()
        # The fake engine accepts every draft: three positions, all at 100%.
        assert "40 tokens" in stats.text and "tok/s" in stats.text
        assert stats.text.startswith("cut at max tokens")
        assert "acceptance 100%" in stats.text and "per position 100% · 100% · 100%" in stats.text
        assert browser.find_element(By.ID, "send").is_displayed()
        # The conversation goes on: the next request carries the history.
        ask(browser, "And then?")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2)
        prompt = served.engine.tokenizer.decode(served.engine.requests[-1].prompt_ids)
        assert "Hello there" in prompt and "And then?" in prompt and body in prompt
        assert page_errors(browser) == []


def test_a_reasoning_models_thinking_shows_folded_above_the_answer(browser):
    script = "<think>\nTwo and two make four.\n</think>\n\nIt is **4**."
    with Served(engine=ScriptedEngine(script, token_delay=0.01)) as served:
        browser.get(served.url)
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        ask(browser, "What is 2+2?")
        wait(browser, lambda d: last_reply(d).find_elements(By.CLASS_NAME, "stats"))
        thinking = last_reply(browser).find_element(By.CSS_SELECTOR, "details.thinking")
        assert thinking.get_attribute("open") is None  # folded once the answer began
        thinking.find_element(By.TAG_NAME, "summary").click()
        assert thinking.text.endswith("Two and two make four.")
        body = last_reply(browser).find_element(By.CLASS_NAME, "body")
        assert body.text == "It is 4." and body.find_element(By.TAG_NAME, "strong").text == "4"
        # The next turn's history carries the answer, not the thinking.
        ask(browser, "And 3+3?")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2)
        prompt = served.engine.tokenizer.decode(served.engine.requests[-1].prompt_ids)
        assert "It is **4**." in prompt and "Two and two" not in prompt
        assert page_errors(browser) == []


def test_stop_button_aborts_the_stream(browser):
    with Served() as served:
        browser.get(served.url)
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        set_value(browser, "max-tokens", "3000")
        ask(browser, "Go on forever")
        stop = wait(browser, lambda d: d.find_element(By.ID, "stop"))
        wait(browser, lambda d: stop.is_displayed() and last_reply(d).text.strip())
        stop.click()
        stats = wait(browser, lambda d: last_reply(d).find_elements(By.CLASS_NAME, "stats"))[0]
        assert stats.text.startswith("stopped")
        assert browser.find_element(By.ID, "send").is_displayed()
        # The server let the request go (the engine closed it) well before 3000 tokens.
        deadline = time.monotonic() + 5
        while served.bridge.stats().cancelled < 1:
            assert time.monotonic() < deadline, "the stopped request was not cancelled"
            time.sleep(0.02)
        assert page_errors(browser) == []


def test_api_key_is_asked_once_and_kept(browser):
    with Served(api_key=KEY) as served:
        browser.get(served.url)
        panel = wait(browser, lambda d: d.find_element(By.ID, "key-panel"))
        wait(browser, lambda d: panel.is_displayed())
        assert browser.find_element(By.ID, "send").get_attribute("disabled")
        set_value(browser, "key-input", "wrong")
        browser.find_element(By.ID, "key-save").click()
        wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-message").text)
        set_value(browser, "key-input", KEY)
        browser.find_element(By.ID, "key-save").click()
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        set_value(browser, "max-tokens", "12")
        ask(browser, "Hello")
        stats = wait(browser, lambda d: last_reply(d).find_elements(By.CLASS_NAME, "stats"))[0]
        assert "12 tokens" in stats.text and "acceptance" in stats.text
        # Kept: a reload asks no more.
        browser.refresh()
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        assert not browser.find_element(By.ID, "key-panel").is_displayed()
        errors = page_errors(browser)
        # The refused key's 401 is logged by the browser as a failed load; nothing else.
        assert all("401" in e for e in errors), errors


def test_page_waits_for_a_loading_model(browser):
    loaded = threading.Event()
    try:
        with Served(loaded=loaded) as served:
            browser.get(served.url)
            wait(browser, lambda d: d.find_element(By.ID, "model").text == "model loading…")
            assert not browser.find_element(By.ID, "send").is_enabled()
            loaded.set()
            wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
            assert browser.find_element(By.ID, "model").text == "fake-model"
    finally:
        loaded.set()


MARKDOWN = (
    "# Title\n\nSome **bold**, *italic* and `code <b>` text.\n\n"
    "```python\nprint('<script>alert(1)</script>')\n```\n\n"
    "- one\n- two <img src=x onerror=alert(1)>\n\n"
    "[good](https://example.com) [bad](javascript:alert(1))"
)


def test_markdown_renderer_builds_nodes_not_html(browser):
    with Served() as served:
        browser.get(served.url)
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        html = browser.execute_async_script(
            """
            const [text, done] = arguments;
            import("/static/markdown.js").then(({ renderMarkdown }) => {
              const box = document.createElement("div");
              box.append(renderMarkdown(text));
              done(box.innerHTML);  // read back only, to compare the structure
            });
            """,
            MARKDOWN,
        )
    assert "<h3>Title</h3>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html
    assert "<code>code &lt;b&gt;</code>" in html
    assert '<pre data-lang="python"><code data-lang="python">' in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<li>two &lt;img src=x onerror=alert(1)&gt;</li>" in html
    assert (
        '<a href="https://example.com" rel="noopener noreferrer" target="_blank">good</a>' in html
    )
    assert "javascript:" not in html.replace("[bad](javascript:alert(1))", "")
    assert "<script" not in html and "<img" not in html


def test_markdown_renderer_is_fast_on_long_backtick_runs(browser):
    # Was cubic: "x" + 3000 backticks took seconds per render (the page re-renders a
    # streaming reply every frame), 20000 froze the tab.
    with Served() as served:
        browser.get(served.url)
        wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled())
        elapsed, html = browser.execute_async_script(
            """
            const done = arguments[0];
            import("/static/markdown.js").then(({ renderMarkdown }) => {
              const text = "x" + "`".repeat(20000) + "\\n" + "`".repeat(3000) + "a" +
                "`".repeat(2999) + "\\nsee ``a`b`` here";
              const box = document.createElement("div");
              const start = performance.now();
              box.append(renderMarkdown(text));
              done([performance.now() - start, box.innerHTML.slice(-40)]);
            });
            """
        )
    assert elapsed < 1000, elapsed
    assert "<code>a`b</code> here" in html
