"""Start and stop a real tritonserver on free loopback ports, serving this project's model repository
with the engine settings a test or benchmark asks for (written to a model.json of its own)."""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from serve import server_command  # noqa: E402

PORT_ATTEMPTS = 3  # starts on fresh ports where another process took one meanwhile


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class TritonServer:
    def __init__(self, env: dict | None = None, repository: Path | None = None, server_args: tuple = (),
                 **settings):
        """`settings` override the shipped model.json; `env` adds environment variables; `server_args`,
        tritonserver options. `repository`: a copy of the model repository to serve, its model.json
        rewritten with the settings (where an operator would edit it); by default this project's, the
        settings in a model.json of its own."""
        self.extra_env = dict(env or {})
        self.server_args = list(server_args)
        self.repository = repository or ROOT / "model_repository"
        base = json.loads((self.repository / "llm" / "1" / "model.json").read_text())
        base.update(settings)
        self._dir = tempfile.TemporaryDirectory(prefix="inflight-server-")
        self.settings_path = (self.repository / "llm" / "1" if repository else Path(self._dir.name)) / "model.json"
        self.settings_path.write_text(json.dumps(base))
        self.settings = base
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.ports_taken: list[tuple[int, int, int]] = []  # ports tried before, another process's meanwhile
        self.log_path = Path(self._dir.name) / "tritonserver.log"
        self.process = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 180.0) -> "TritonServer":
        """Start tritonserver and wait for the model to be ready. Where a port was taken between free_ports
        finding it free and tritonserver binding it (another server starting beside this one), the server
        starts again on other free ports, up to PORT_ATTEMPTS times in all."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            command, env = server_command(self.repository, self.http_port, self.grpc_port, self.metrics_port)
            command += self.server_args
            env["INFLIGHT_MODEL_JSON"] = str(self.settings_path)
            env.update(self.extra_env)
            self._log = open(self.log_path, "wb")
            self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if self.model_ready():
                    return self
                time.sleep(0.1)
            else:
                self.stop()
                raise RuntimeError(f"tritonserver was not ready in {timeout} s:\n{self.log_tail()}")
            if "already in use" not in self.log() or attempt == PORT_ATTEMPTS:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            self._signal_group(9)  # (its backend stubs, if any are left)
            self._log.close()
            self.ports_taken.append((self.http_port, self.grpc_port, self.metrics_port))
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)

    def model_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/models/llm/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def descendants(self, marker: str) -> list:
        """tritonserver's descendant processes whose command line contains `marker` (their names are cut
        to 15 characters: the command line tells them apart); those gone meanwhile are left out."""
        import psutil

        found = []
        for process in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if marker in " ".join(process.cmdline()):
                    found.append(process)
            except psutil.NoSuchProcess:
                continue
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, chars: int = 6000) -> str:
        """The log's end without tritonserver's tables (of options and models), which would push a load
        error's own lines out of the tail."""
        lines = [line for line in self.log().splitlines() if not line.startswith(("|", "+"))]
        return "\n".join(lines)[-chars:]

    def _metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """The inflight_* samples on the metrics port, by name (labels dropped; histograms by suffix)."""
        values = {}
        for line in self._metrics_text().splitlines():
            m = re.match(r"^(inflight_\w+?)(\{[^}]*\})?\s+(\S+)$", line)
            if m and 'le="' not in (m.group(2) or ""):
                values[m.group(1)] = float(m.group(3))
        return values

    def labeled(self, name: str, label: str) -> dict[str, float]:
        """The samples of the metric `name`, by the value of its label `label`."""
        pattern = re.compile(rf'^{name}\{{[^}}]*\b{label}="([^"]*)"[^}}]*\}}\s+(\S+)$')
        return {m.group(1): float(m.group(2)) for m in map(pattern.match, self._metrics_text().splitlines()) if m}

    def serving_profile(self) -> dict[str, tuple[float, float, float]]:
        """The serving process's profile so far (backend/inflight/serving/profile.py): part -> (wall
        seconds, CPU seconds, times run)."""
        text = self._metrics_text()
        columns = {"inflight_serving_seconds_total": 0, "inflight_serving_cpu_seconds_total": 1,
                   "inflight_serving_events_total": 2}
        profile: dict[str, list[float]] = {}
        for name, part, value in re.findall(r'^(inflight_serving_\w+)\{[^}]*part="(\w+)"[^}]*\}\s+(\S+)$', text, re.M):
            if name in columns:
                profile.setdefault(part, [0.0, 0.0, 0.0])[columns[name]] = float(value)
        return {part: tuple(values) for part, values in profile.items()}

    def histogram(self, name: str) -> dict[str, float]:
        """The `le` buckets of histogram `name` on the metrics port: {"0.005": count, ..., "+Inf": count}."""
        buckets = {}
        for line in self._metrics_text().splitlines():
            m = re.match(rf'^{name}_bucket\{{.*le="([^"]+)".*\}}\s+(\S+)$', line)
            if m:
                buckets[m.group(1)] = float(m.group(2))
        return buckets

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            # The whole process group, also when tritonserver itself is gone: a crashed server leaves
            # its Python backend stubs running otherwise.
            self._signal_group(15)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._signal_group(9)
                self.process.wait()
            self._wait_for_group(0.5)  # its stubs and engine processes leave with it
            self._signal_group(9)  # stragglers of the group
        if self.process is not None:
            self._log.close()
            self.final_log = self.log()  # kept for post-mortems after the folder is gone
        self._dir.cleanup()

    def stop_in_background(self) -> threading.Thread:
        """stop() on a thread of its own, so that the caller goes on (the next server starts) while this one
        shuts down: tritonserver takes ~3 s to, mostly its own waits and polls. The thread is not a daemon:
        the process exits only once the server has stopped."""
        thread = threading.Thread(target=self.stop, name="tritonserver-stop")
        thread.start()
        return thread

    def _wait_for_group(self, timeout: float) -> None:
        """Until no process of the server's group is left, or `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)

    def _signal_group(self, signal: int) -> None:
        try:
            os.killpg(self.process.pid, signal)
        except ProcessLookupError:
            pass  # nothing left in the group

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
