"""A small Chrome DevTools protocol client: headless Chromium, one page, commands and events.

with Browser() as page:                       # Debian's `chromium`, a fresh profile
    page.open(Path("report.html"))
    page.evaluate("document.title")
    page.errors                               # console errors and uncaught exceptions
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = "chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-port=0",  # any free port, written to DevToolsActivePort
)


def chromium_path() -> str | None:
    return shutil.which(CHROMIUM)


class Browser:
    """Headless Chromium with its first page driven over the DevTools protocol."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 30.0):
        self.width, self.height, self.timeout = width, height, timeout
        self.errors: list[str] = []
        self._id = 0

    def __enter__(self) -> Browser:
        import websocket  # websocket-client

        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        self._proc = subprocess.Popen(
            [chromium_path(), *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helper processes share one group, stopped together
        )
        try:
            port = self._wait_for_port()
            page = next(t for t in self._targets(port) if t["type"] == "page")
            self._ws = websocket.create_connection(
                page["webSocketDebuggerUrl"], timeout=self.timeout, suppress_origin=True
            )
            for domain in ("Page", "Runtime", "Log"):
                self.send(f"{domain}.enable")
            self.send(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        self._signal_group(signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._proc.wait()
        # helpers that outlive the browser by a moment may still write to the profile
        self._signal_group(signal.SIGKILL)
        for _ in range(50):
            try:
                self._profile.cleanup()
                return
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(self._profile.name, ignore_errors=True)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_for_port(self) -> int:
        marker = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with status {self._proc.returncode}")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.05)
        raise TimeoutError(f"chromium wrote no {marker.name} in {self.timeout} s")

    def _targets(self, port: int) -> list[dict]:
        deadline = time.monotonic() + self.timeout
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                targets = json.loads(r.read())
            if any(t["type"] == "page" for t in targets) or time.monotonic() > deadline:
                return targets
            time.sleep(0.05)

    # ---- the protocol --------------------------------------------------------------------------

    def send(self, method: str, **params: Any) -> dict:
        """Send one command and wait for its result, recording the events that come first."""
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = self._receive()
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def wait_for(self, event: str) -> dict:
        while True:
            msg = self._receive()
            if msg.get("method") == event:
                return msg.get("params", {})

    def _receive(self) -> dict:
        msg = json.loads(self._ws.recv())
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(
                "console: "
                + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(
                "exception: " + details.get("exception", {}).get("description", details["text"])
            )
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(f"log: {params['entry']['text']}")
        return msg

    # ---- what a test does --------------------------------------------------------------------

    def open(self, path: Path) -> None:
        """Load a local file and wait until it has loaded."""
        self.send("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (JSON-serialisable), run in the page."""
        result = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")
