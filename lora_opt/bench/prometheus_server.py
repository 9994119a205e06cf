"""A real Prometheus server for tests and experiments: started on 127.0.0.1 with a config written here
(its targets scraped every ``scrape_interval``), its data in a folder of the caller's, stopped at the end
(``with PrometheusServer(...) as prom: prom.url``), returning once every target was scraped.  The executable: $PROMETHEUS_BIN or ``prometheus`` on
PATH (``tools/prometheus/install.sh`` installs Debian's package)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_text


def prometheus_binary() -> str | None:
    return os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """``targets``: ``host:port`` of each server whose ``/metrics`` it scrapes (job ``gateway``)."""

    def __init__(self, targets: list[str], data_dir: str | Path, *, scrape_interval: str = "1s",
                 start_timeout_s: float = 60.0, port: int | None = None):
        binary = prometheus_binary()
        if binary is None:
            raise InputError("prometheus is not installed (tools/prometheus/install.sh, or set PROMETHEUS_BIN)")
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()       # a server started again on its data: the same port
        self.url = f"http://127.0.0.1:{self.port}"
        targets_yaml = ", ".join(f'"{t}"' for t in targets)
        config = (f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
                  f"scrape_configs:\n  - job_name: gateway\n    static_configs:\n      - targets: [{targets_yaml}]\n")
        atomic_write_text(self.dir / "prometheus.yml", config)
        self.log = open(self.dir / "prometheus.log", "w")       # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([binary, f"--config.file={self.dir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={self.dir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        # ready, then every target scraped once (up or not): Prometheus' discovery hands its targets to the
        # scrapers only after ~5 s, and a counter's first sample is no increase
        deadline = time.time() + start_timeout_s
        while not self._scraped_once():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _scraped_once(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url + "/api/v1/targets?state=active", timeout=2) as r:
                targets = json.loads(r.read())["data"]["activeTargets"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False
        return bool(targets) and all(not t.get("lastScrape", "0001").startswith("0001") for t in targets)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
