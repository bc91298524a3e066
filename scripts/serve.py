"""Start a real tritonserver on 127.0.0.1 with this project's model repository.

Uses the bundle unpacked at TRITONSERVER_HOME when that is set (scripts/pack_tritonserver.sh: a
machine with no package registry), else `tritonserver` from PATH when there is one (the NGC image),
else the binary inside the nvidia-pytriton wheel that `scripts/setup.sh --serving` put under .tools/.
Ports come from HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000, 8001, 8002).
"""

import argparse
import os
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools"


def server_command(model_repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                   address: str = "127.0.0.1", log_verbose: int = 0) -> tuple[list[str], dict]:
    """The tritonserver command line and environment for this project."""
    env = dict(os.environ)
    env["INFLIGHT_ROOT"] = str(ROOT)
    env["INFLIGHT_PYTHON"] = sys.executable  # the engine process runs on it (the stub is no Python)
    # The stub's Python ignores PYTHONPATH: model.py puts these first on its sys.path.
    site_packages = [*filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), sysconfig.get_paths()["purelib"]]
    home = Path(env["TRITONSERVER_HOME"]) if env.get("TRITONSERVER_HOME") else None
    stub_numpy = home / "stub-numpy" if home else TOOLS / "stub-numpy"
    if stub_numpy.exists():
        # The bundled stub's C++ side reads numpy arrays with the numpy 1 ABI: numpy 1.26 must win.
        site_packages.insert(0, str(stub_numpy))
    env["INFLIGHT_SITE_PACKAGES"] = os.pathsep.join(site_packages)
    if home:  # an unpacked scripts/pack_tritonserver.sh bundle: bin/, backends/, lib/
        bundled, backends, libs = home / "bin" / "tritonserver", home / "backends", home / "lib"
    else:  # the nvidia-pytriton wheel of `make setup-serving`
        bundled = TOOLS / "pytriton" / "pytriton" / "tritonserver" / "bin" / "tritonserver"
        backends, libs = TOOLS / "backends", TOOLS / "pytriton" / "nvidia_pytriton.libs"
    binary = str(bundled) if home else shutil.which("tritonserver") or str(bundled)
    if not Path(binary).exists():
        raise SystemExit("tritonserver not found: run `make setup-serving` (or use the Docker image)")
    args = [binary, "--model-repository", str(model_repository),
            "--http-address", address, "--http-port", str(http_port),
            "--grpc-address", address, "--grpc-port", str(grpc_port),
            "--metrics-address", address, "--metrics-port", str(metrics_port),
            "--allow-gpu-metrics", "false", "--log-verbose", str(log_verbose),
            # Explicit model control, so that a model whose engine stopped can unload itself and
            # report not-ready; every model of the repository is still loaded at start.
            "--model-control-mode", "explicit", "--load-model", "*",
            # config.pbtxt is complete: without this, the Python backend starts a stub of its own to ask
            # model.py to complete it (importing torch and transformers: 10 s on a CI host) before the
            # instance's stub starts.
            "--disable-auto-complete-config"]
    if binary == str(bundled):
        args += ["--backend-directory", str(backends)]
        env["LD_LIBRARY_PATH"] = str(libs) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return args, env


def ports_refused(address: str, ports: dict[str, int]) -> list[str]:
    """Why tritonserver could not listen on `ports` (by the setting that names each) at `address`: a port
    named twice, or one another process listens on. tritonserver finds out only after it has loaded every
    model, and then exits."""
    problems, seen = [], {}
    for name, port in ports.items():
        if port in seen:
            problems.append(f"{seen[port]} and {name} are both {port}")
            continue
        seen[port] = name
        family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            # (as tritonserver's own listeners do: a port whose last connections are in TIME_WAIT is free)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(where)
            except OSError as e:
                problems.append(f"{name} {port} on {address}: {e.strerror}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--address", default="127.0.0.1")
    args = parser.parse_args()
    try:
        refused = ports_refused(args.address, {"HTTP_PORT": args.http_port, "GRPC_PORT": args.grpc_port,
                                               "METRICS_PORT": args.metrics_port})
    except socket.gaierror as e:
        raise SystemExit(f"cannot serve on {args.address}: {e.strerror}")
    if refused:
        raise SystemExit(f"cannot serve: {'; '.join(refused)} (stop what listens there, or choose other ports: "
                         "make serve HTTP_PORT=... GRPC_PORT=... METRICS_PORT=...)")
    command, env = server_command(Path(args.model_repository), args.http_port, args.grpc_port,
                                  args.metrics_port, args.address)
    print("starting:", " ".join(command), file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
