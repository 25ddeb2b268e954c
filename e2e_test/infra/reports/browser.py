"""Render a page in headless Chromium over the DevTools protocol: console errors + screenshot.

`render(path_or_url, screenshot=...)` starts Chromium (`chromium`, `chromium-browser`,
`google-chrome`, or $E2E_CHROMIUM) with its own throw-away profile, DevTools bound to
127.0.0.1 on a port Chromium picks (read back from DevToolsActivePort), loads the page, and
collects what a person would see in the console as an error: `console.error`/`console.assert`
calls, uncaught exceptions, and browser log entries of level error (a resource that failed to
load, a blocked request). The websocket client is `websockets` (its sync API).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HarnessError
from ..specs import settings

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    env = settings.get("E2E_CHROMIUM")
    if env:
        return env if shutil.which(env) or Path(env).is_file() else None
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


@dataclass
class PageReport:
    url: str
    title: str = ""
    console_errors: list[str] = field(default_factory=list)
    text_length: int = 0
    screenshot: str | None = None


def _url(target: str | Path) -> str:
    s = str(target)
    return s if "://" in s or s.startswith("about:") else Path(s).resolve().as_uri()


def render(target: str | Path, screenshot: str | Path | None = None, width: int = 1400,
           height: int = 1000, timeout: float = 60.0, settle_s: float = 0.5,
           full_page: bool = True) -> PageReport:
    """Load `target`; with `screenshot`, a PNG of the whole page there (`full_page`), or of
    the first width x height of it (a page of some 10^8 pixels takes Chromium seconds)."""
    from websockets.sync.client import connect

    exe = find_chromium()
    if not exe:
        raise HarnessError("no Chromium found (chromium, chromium-browser, google-chrome or "
                           "$E2E_CHROMIUM); on Debian: apt-get install -y chromium")
    url = _url(target)
    profile = tempfile.mkdtemp(prefix="e2e-chromium-")
    argv = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--disable-dev-shm-usage",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    rep = PageReport(url=url)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace")[-2000:]
                raise HarnessError(f"chromium exited with code {proc.returncode} before "
                                   "DevTools was up", err)
            if time.monotonic() > deadline:
                raise HarnessError(f"chromium: DevTools not up within {timeout:.0f} s")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        import httpx
        pages = []
        while not pages:
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list",
                                          timeout=5).json() if t.get("type") == "page"]
            if not pages:
                if time.monotonic() > deadline:
                    raise HarnessError("chromium: no page target")
                time.sleep(0.05)
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=2**28,
                     open_timeout=10) as ws:
            ids = iter(range(1, 1_000_000))
            events: list[dict] = []

            def call(method: str, **params) -> dict:
                mid = next(ids)
                ws.send(json.dumps({"id": mid, "method": method, "params": params}))
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise HarnessError(f"chromium: {method} got no answer within "
                                           f"{timeout:.0f} s")
                    msg = json.loads(ws.recv(timeout=left))
                    if msg.get("id") == mid:
                        if "error" in msg:
                            raise HarnessError(f"chromium: {method}: {msg['error']}")
                        return msg.get("result", {})
                    events.append(msg)

            def pump(until: float, stop=None) -> None:
                while time.monotonic() < until:
                    try:
                        msg = json.loads(ws.recv(timeout=max(0.01, until - time.monotonic())))
                    except TimeoutError:
                        return
                    events.append(msg)
                    if stop and stop(msg):
                        return

            for domain in ("Runtime", "Log", "Page"):
                call(f"{domain}.enable")
            call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                 deviceScaleFactor=1, mobile=False)
            nav = call("Page.navigate", url=url)
            if nav.get("errorText"):
                raise HarnessError(f"chromium: cannot load {url}: {nav['errorText']}")
            if not any(e.get("method") == "Page.loadEventFired" for e in events):
                pump(deadline, lambda m: m.get("method") == "Page.loadEventFired")
            pump(time.monotonic() + settle_s)
            res = call("Runtime.evaluate", expression="[document.title, "
                       "document.body ? document.body.innerText.length : 0]",
                       returnByValue=True)
            rep.title, rep.text_length = res.get("result", {}).get("value", ["", 0])
            if screenshot:
                shot = call("Page.captureScreenshot", format="png",
                            captureBeyondViewport=full_page)
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
                rep.screenshot = str(screenshot)
            rep.console_errors = console_errors(events)
            try:
                call("Browser.close")
            except (HarnessError, OSError, TimeoutError):
                pass            # it exits below either way (wait, then kill)
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
    return rep


def console_errors(events: list[dict]) -> list[str]:
    """The DevTools events that a person would read as a console error, one line each."""
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            out.append(f"console.{p['type']}: {args}")
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            desc = (d.get("exception") or {}).get("description") or d.get("text", "")
            out.append(f"uncaught: {desc.splitlines()[0] if desc else d}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            ent = p["entry"]
            out.append(f"{ent.get('source', 'log')}: {ent.get('text', '')} {ent.get('url', '')}"
                       .strip())
    return out
