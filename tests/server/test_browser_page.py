"""The chat page at / driven in headless Chromium against a real `qserve serve` process.

Types a prompt, sends it, watches the reply element grow token by token (a MutationObserver
records every text the page writes into it), and checks that the final text equals what the
server returns non-streaming for the same body the page sent (captured from the browser's
request; the page's temperature field is set to 0, so the request is greedy).

Needs Debian's `chromium` (/usr/bin/chromium; `.ci/setup` installs it when run as root) and
the `playwright` package (the `test` extra); playwright's own browser download is not used.
"""

import json
import os
import shutil

import pytest
from live_server import LiveServer

httpx = pytest.importorskip("httpx")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")

CHROMIUM = os.environ.get("QSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MAX_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)),
    reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/setup does it as root)")

# Installed before the page's own script runs: every text the page puts into an assistant
# message is recorded (a childList record's added text node keeps the text it was set to),
# with the observer-callback number, so growth across separate tasks is visible too.
OBSERVER = """
window.__replyStates = [];
window.__callbacks = 0;
document.addEventListener("DOMContentLoaded", () => {
  new MutationObserver((records) => {
    const cb = ++window.__callbacks;
    for (const r of records) {
      const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
      if (!el || !el.classList || !el.classList.contains("assistant")) continue;
      for (const n of r.addedNodes) window.__replyStates.push({cb, text: n.textContent});
    }
  }).observe(document.getElementById("log"), {subtree: true, childList: true});
});
"""


@pytest.fixture(scope="module")
def server(tiny_dir):
    with LiveServer(tiny_dir) as live:
        yield live.base


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=30_000)
        except sync_api.Error as e:
            pytest.skip(f"playwright cannot launch {CHROMIUM}: {e}")
        try:
            yield b
        finally:
            b.close()


def test_chat_page_streams_greedy_reply(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    page.set_default_timeout(20_000)
    page.add_init_script(OBSERVER)
    console_errors = []
    page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
    page.on("pageerror", lambda e: console_errors.append(str(e)))
    page.on("response", lambda r: r.status >= 400 and console_errors.append(f"{r.status} {r.url}"))
    sent = []
    page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
            and sent.append(r.post_data))

    page.goto(server + "/")
    sync_api.expect(page.locator("#model")).to_have_text("tiny (chat)")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(MAX_TOKENS))
    prompt = "The quick brown fox"
    page.fill("#prompt", prompt)
    page.click("#send")

    # The stats line is added once the stream has ended ([DONE]).
    stats = page.locator("#log .stats")
    sync_api.expect(stats).to_have_count(1)
    assert page.locator("#log .error").count() == 0, page.inner_text("#log")
    sync_api.expect(page.locator("#log .user")).to_have_text(prompt)
    final = page.locator("#log .assistant").inner_text()
    assert final.strip(), "empty reply"
    page.screenshot(path=str(tmp_path / "chat_page.png"), full_page=True)

    # The page sent a greedy streaming request; the same body non-streaming gives the same text.
    assert len(sent) == 1
    body = json.loads(sent[0])
    assert body["stream"] is True and body["temperature"] == 0
    assert body["max_tokens"] == MAX_TOKENS and body["model"] == "tiny"
    assert body["messages"] == [{"role": "user", "content": prompt}]
    r = httpx.post(server + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
    r.raise_for_status()
    want = r.json()["choices"][0]["message"]["content"]
    final_text = page.evaluate("document.querySelector('#log .assistant').textContent")
    assert final_text == want

    # Tokens arrived one by one: the reply went through several non-empty texts, each a
    # prefix of the next, ending at the final text; and it grew in more than one task.
    states = page.evaluate("window.__replyStates")
    texts = [s["text"] for s in states if s["text"]]
    assert texts and texts[-1] == want
    assert len(set(texts[:-1])) >= 2, texts
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:])), texts
    n_chunks = int(stats.inner_text().split()[0])
    assert n_chunks == len(texts), (stats.inner_text(), texts)
    assert len({s["cb"] for s in states if s["text"]}) >= 2, states
    assert not console_errors, console_errors
