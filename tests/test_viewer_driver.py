"""A tiny driver for Debian's headless chromium over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands on fd 3, replies on fd 4, NUL-terminated JSON), and a
PNG decoder, for the viewer's browser tests (test_viewer_browser.py). Standard library only;
the decoder's own test is at the end."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from typing import Any, Optional

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars"]


def find_chromium() -> Optional[str]:
    """The system chromium (Debian's package), or None."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless chromium; :meth:`open` a page, then evaluate, click, hover, screenshot.
    Every wait is bounded by ``timeout`` seconds."""

    def __init__(self, exe: str, width: int = 1400, height: int = 900, timeout: float = 30.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="opgraph-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def wire() -> None:  # in the child: fd 3 reads commands, fd 4 writes replies
            high_r, high_w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_r, out_w))
            os.dup2(high_r, 3)  # dup2 makes the new descriptors inheritable
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, close_fds=False)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.session: Optional[str] = None

    # -- the wire --
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("timed out waiting for chromium")
            ready, _, _ = select.select([self._out_r], [], [], left)
            if ready:
                chunk = os.read(self._out_r, 1 << 16)
                if not chunk:
                    raise BrowserError("chromium closed the DevTools pipe")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: Optional[dict] = None, session: bool = True) -> dict:
        """Send a command and return its result (events that arrive meanwhile are kept)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise BrowserError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str) -> dict:
        """The first event ``method`` not yet consumed."""
        deadline = time.monotonic() + self.timeout
        while True:
            for k, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(k)
            self.events.append(self._read_message(deadline))

    # -- pages --
    def open(self, url: str) -> None:
        """A fresh tab on ``url``, with console, log and network events recorded."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        self.session = self.send("Target.attachToTarget",
                                 {"targetId": target["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.events.clear()
        self.send("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired")

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (exceptions raise BrowserError)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def mouse(self, selector: str, click: bool) -> None:
        """Move the mouse onto the centre of ``selector``'s element (and click it)."""
        box = self.eval(f"(function(){{var e=document.querySelector({json.dumps(selector)});"
                        "e.scrollIntoView({block:'center',inline:'center'});"
                        "var r=e.getBoundingClientRect();return [r.x+r.width/2,r.y+r.height/2];})()")
        x, y = box
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        if click:
            for kind in ("mousePressed", "mouseReleased"):
                self.send("Input.dispatchMouseEvent",
                          {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def screenshot(self, scale: float = 1.0) -> bytes:
        """A PNG of the viewport, scaled by ``scale``."""
        params: dict[str, Any] = {"format": "png"}
        if scale != 1.0:
            w, h = self.eval("[innerWidth, innerHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": w, "height": h, "scale": scale}
        return base64.b64decode(self.send("Page.captureScreenshot", params)["data"])

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions and log errors seen so far."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {p.get('args')}")
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')}")
        return out

    def requests(self) -> list[str]:
        """Every URL the page requested."""
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._cmd_w, self._out_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


# --- PNG ---------------------------------------------------------------------------------------
def png_pixels(data: bytes) -> list:
    """``[width, height, (r, g, b), ...]`` of an 8-bit RGB or RGBA PNG (alpha dropped)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            if depth != 8 or color not in (2, 6):
                raise ValueError(f"unsupported PNG: depth {depth}, colour type {color}")
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride = zlib.decompress(idat), width * bpp
    prev, pixels = bytearray(stride), [width, height]
    for row in range(height):
        f, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1:(row + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        pixels += [tuple(line[i:i + 3]) for i in range(0, stride, bpp)]
        prev = line
    return pixels


def make_png(width: int, height: int, pixels: list) -> bytes:
    """An RGB PNG (filter 0) of ``pixels`` — to test the decoder on known input."""
    raw = b"".join(b"\0" + bytes(v for p in pixels[r * width:(r + 1) * width] for v in p)
                   for r in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_png_decoder_on_known_pixels():
    pixels = [(0, 0, 0), (255, 0, 0), (0, 255, 0), (1, 2, 3), (250, 251, 252), (9, 9, 9)]
    assert png_pixels(make_png(3, 2, pixels)) == [3, 2, *pixels]
