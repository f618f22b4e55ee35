"""The documentation site in a real browser: built as `make docs` builds it and served as `make docs-serve` serves it
(a local HTTP server: a browser refuses search's worker from a file), in headless Chromium driven over the DevTools
protocol (its pipe, so no extra package). Each page checked logs no console error, no failed request and no
request that leaves the machine; search finds a page; a formula is drawn as MathML; code is coloured; every image
of the Results page loads.

Chromium comes from Debian's packages: `apt-get install chromium` (.ci/run does it). Without it the test is skipped
with that command, except with DIFFTX_REQUIRE_BROWSER=1 (.ci/run sets it), where it fails."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("DIFFTX_REQUIRE_BROWSER") == "1":
            pytest.fail("DIFFTX_REQUIRE_BROWSER=1 but there is no chromium: apt-get install chromium")
        pytest.skip("needs Chromium for the browser check of the docs site: apt-get install chromium")
    return found


class Browser:
    """Headless Chromium and one page, driven by DevTools protocol messages over --remote-debugging-pipe (the
    browser reads commands on its descriptor 3 and writes replies and events on 4, each a JSON text ended by NUL)."""

    def __init__(self, binary: str, profile: Path) -> None:
        self._to_browser, command_end = os.pipe()[::-1]  # (write end, read end)
        reply_end, self._from_browser = os.pipe()[::-1]
        ends = (command_end, reply_end)

        def descriptors() -> None:  # in the child: the command pipe's read end as 3, the reply pipe's write end as 4
            os.dup2(command_end, 3)
            os.dup2(reply_end, 4)

        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
                 f"--user-data-dir={profile}", "--allow-file-access-from-files"]  # fmt: skip
        self.proc = subprocess.Popen([binary, *flags], pass_fds=(3, 4, *ends), preexec_fn=descriptors,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        os.close(command_end)
        os.close(reply_end)
        self._next, self._buffer, self.events = 0, b"", []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=self.session)

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]
            self.events.append(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, "the browser did not answer in time"
            if select.select([self._from_browser], [], [], left)[0]:
                chunk = os.read(self._from_browser, 1 << 16)
                assert chunk, "the browser closed its pipe"
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=self.session, url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=self.session, expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, f"{expression}: {result['exceptionDetails']}"
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15):
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"not true within {timeout} s: {expression}"
            time.sleep(0.1)
        return value

    def errors(self) -> list[str]:
        """What the page has logged as errors since it was opened: exceptions, console errors, failed requests."""
        self.evaluate("1")  # collect the events that came meanwhile
        found, urls = [], {}
        for event in self.events:
            if event.get("method") == "Network.requestWillBeSent":
                urls[event["params"]["requestId"]] = event["params"]["request"]["url"]
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(params["exceptionDetails"].get("text", "an exception"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
            elif method == "Network.loadingFailed":
                found.append(f"{urls.get(params['requestId'], 'a request')} failed: {params.get('errorText')}")
        return found

    def requested(self) -> list[str]:
        """Every URL the page has asked for since it was opened (data: URLs aside)."""
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"
                and not e["params"]["request"]["url"].startswith("data:")]  # fmt: skip

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built into a temporary directory and served on a free local port: its base URL."""
    import functools
    import http.server
    import threading

    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([mkdocs, "build", "--strict", "--site-dir", out], cwd=ROOT, env=env, capture_output=True)
    assert built.returncode == 0, built.stderr.decode()[-3000:]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opened = Browser(_chromium(), tmp_path_factory.mktemp("profile"))
    yield opened
    opened.close()


PAGES = ["", "paper/", "results/", "cli/", "tutorials/train-on-your-text/", "reference/attention/", "guide/training/"]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_opened_from_disk_logs_no_error(site, browser, page):
    browser.open(site + page)
    assert browser.evaluate("document.querySelector('h1') !== null")
    assert browser.errors() == []
    assert browser.requested() and all(url.startswith(site) for url in browser.requested()), browser.requested()


def test_search_works_from_disk(site, browser):
    browser.open(site)
    browser.evaluate(
        "const box = document.querySelector('input.md-search__input'); box.focus(); box.value = 'lambda_init';"
        "box.dispatchEvent(new Event('input', {bubbles: true}));"
    )
    found = browser.wait_for("document.querySelectorAll('.md-search-result__item').length")
    assert found >= 1
    assert browser.errors() == []


def test_formulas_are_drawn_as_mathml_and_code_is_coloured(site, browser):
    browser.open(site + "paper/")
    assert browser.evaluate("document.querySelectorAll('math').length") >= 4
    assert browser.evaluate("document.querySelector('math').getBoundingClientRect().height") > 10  # drawn, not text
    assert "\\frac" not in browser.evaluate("document.body.innerText")  # no formula left as LaTeX
    browser.open(site + "tutorials/add-to-your-model/")
    colours = browser.evaluate(
        "[...document.querySelectorAll('.highlight code span')].map(s => getComputedStyle(s).color)"
    )
    assert len(set(colours)) >= 3  # tokens in several colours, done at build time (no script)


def test_every_image_of_the_results_page_loads(site, browser):
    browser.open(site + "results/")
    images = browser.wait_for(
        "[...document.images].every(i => i.complete) && [...document.images].map(i => [i.src, i.naturalWidth])"
    )
    committed = sorted(ROOT.glob("experiments/reports/*/*.png"))
    assert len(images) >= len(committed) and all(width > 0 for _, width in images), images
