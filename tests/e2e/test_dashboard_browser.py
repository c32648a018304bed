"""The KV cache's page in a real headless browser (Debian's chromium and chromium-driver, driven by selenium),
over `kvserve serve`'s app on the bundled demo model."""
from __future__ import annotations

import shutil
import tempfile
import threading

import httpx
import pytest

from kvserve.config import EngineConfig, ServerConfig
from kvserve.server.app import build_app
from servers import ServerThread

KEY = "sk-browser"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 96
# flags for a closed machine: nothing the browser would fetch for itself (updates, sync, QUIC probes)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]
PROMPT = "Paged attention splits the KV cache into blocks, like pages of memory. " * 40


def browser():
    """A headless chromium under selenium, with a profile of its own; skips where there is none."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no browser: install chromium and chromium-driver (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tempfile.mkdtemp(prefix='kvserve-chromium-')}"]:
        options.add_argument(flag)
    # the driver's path given: selenium looks for nothing to download
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


@pytest.fixture(scope="module")
def url():
    config = EngineConfig(model=None, num_kv_blocks=NUM_BLOCKS)      # the bundled demo model
    with ServerThread(build_app(config, "demo", ServerConfig(api_key=KEY, kv_dashboard_content=True))) as base:
        yield base


def stream_until(url: str, body: dict, started: threading.Event, stop: threading.Event) -> None:
    """Stream completions one after another until told to stop; leaving a stream aborts its request.

    One request on the demo model may finish between two polls of the page, so the page is given
    request after request until it has seen one."""
    while not stop.is_set():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return


def test_the_page_shows_blocks_taken_and_returned(url, tmp_path):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser()

    def count(name: str) -> int:
        return int(driver.find_element(By.ID, f"n-{name}").text)

    def until(condition, what: str) -> None:
        """Wait for the page to show `what`; if it never does, say what it shows."""
        try:
            WebDriverWait(driver, 60).until(condition)
        except TimeoutException:
            shows = {"status": driver.find_element(By.ID, "status").text, "in use": count("inuse"),
                     "cached": count("cached"), "console": driver.get_log("browser")}
            raise AssertionError(f"the page never showed {what}; it shows {shows}") from None

    try:
        driver.get(f"{url}/dashboard")
        # the page asks for the key once
        until(lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the form asking for the key")
        driver.find_element(By.ID, "key-input").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
        until(lambda d: d.find_element(By.ID, "status").text == "live", "the state")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#grid > i")) == NUM_BLOCKS
        # no second KV tier: no counters of one
        assert not any(driver.find_element(By.ID, f"spark-{s}").is_displayed() for s in ("tier", "tier-hits"))
        assert count("inuse") == 0 and count("cached") == 0

        prompt_len = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()["count"]
        body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1023 - prompt_len, "ignore_eos": True,
                "stream": True}
        started, stop = threading.Event(), threading.Event()
        request = threading.Thread(target=stream_until, args=(url, body, started, stop))
        request.start()
        try:
            assert started.wait(60)
            until(lambda d: count("inuse") >= prompt_len // 16, "the prompt's blocks in use")
            until(lambda d: "cmpl-" in d.find_element(By.ID, "rows").text, "the request")
        finally:
            stop.set()
            request.join()
        until(lambda d: count("inuse") == 0 and count("cached") >= prompt_len // 16, "the blocks returned, cached")
        cells = driver.find_elements(By.CSS_SELECTOR, "#grid > i.cached")
        assert len(cells) == count("cached")
        cells[2].click()          # a cached block inside the prompt: its tokens as text
        until(lambda d: d.find_element(By.ID, "block-text").text.strip() != "", "the block's tokens")
        assert driver.find_element(By.ID, "block-text").text.strip() in PROMPT
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 0
    finally:
        driver.quit()


def test_the_page_shows_the_offload_tier_where_there_is_one(tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    config = EngineConfig(model=None, num_kv_blocks=NUM_BLOCKS, kv_offload=f"disk:{tmp_path / 'tier'}",
                          kv_offload_size="16MiB")
    with ServerThread(build_app(config, "demo", ServerConfig(api_key=KEY))) as base:
        driver = browser()
        try:
            driver.get(f"{base}/dashboard")
            WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "key-form").is_displayed())
            driver.find_element(By.ID, "key-input").send_keys(KEY)
            driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
            WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "status").text == "live")
            tier = driver.find_element(By.ID, "spark-tier")
            assert tier.is_displayed() and driver.find_element(By.ID, "spark-tier-hits").is_displayed()
            # nothing has left the pool yet: the tier is empty
            assert tier.find_element(By.CLASS_NAME, "v").text == "0.0% · disk, 0 blocks, 0.0 MiB of 16.0 MiB"
        finally:
            driver.quit()
