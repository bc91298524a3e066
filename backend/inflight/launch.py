"""Python processes of the engine's own (the serving engine process, tensor-parallel workers): started
with one end of a pipe, and leaving when their parent does. Only the standard library here, so that
the Triton model can start its engine process before it imports torch and transformers itself."""

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time


def python_executable() -> str:
    """The Python that runs the workers (and the serving engine process). Inside tritonserver
    sys.executable is the backend's stub, so the launcher names the interpreter in INFLIGHT_PYTHON. (They
    are plain subprocesses, not multiprocessing's: that would hand them the stub's sys.path, which this
    interpreter cannot use.)"""
    named = os.environ.get("INFLIGHT_PYTHON")
    if named:
        return named
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    raise RuntimeError(f"cannot start a Python process from {sys.executable!r}: set INFLIGHT_PYTHON "
                       "to the Python interpreter of this environment")


def start_python_process(module: str, function: str) -> tuple[subprocess.Popen, multiprocessing.connection.Connection]:
    """Run `module.function()` in a new Python process (through run_child), given in sys.argv one end of
    a pipe and this process's pid; returns the process and this end of the pipe, which closes (EOF)
    when the process exits."""
    ours, theirs = multiprocessing.Pipe()
    backend = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `inflight` lives
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [backend, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([python_executable(), "-c", f"from inflight.launch import run_child; "
                                f"run_child({module!r}, {function!r})", str(theirs.fileno()), str(os.getpid())],
                               pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    return process, ours


def run_child(module: str, function: str) -> None:
    """A child's first step, before it imports torch (seconds): tie it to its parent, then run it."""
    tie_to_parent(int(sys.argv[2]))
    getattr(importlib.import_module(module), function)()
    # Done: leave without the interpreter's teardown, which takes 0.7-1.2 s with torch loaded (2 cores)
    # while the parent (stopping, unloading, exiting) waits for this process to end.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tie_to_parent(parent_pid: int) -> None:
    """This process leaves when its parent is gone, whatever it is doing (importing, or in a collective
    that may block for long), and neither a ctrl-c nor a SIGTERM ends it: they reach the whole process
    group (a terminal's ctrl-c; systemd stopping a service), and tritonserver then waits for the
    requests in flight, which this process must go on serving until its parent stops it (a stop
    message, its pipe closing, or the parent's exit). (Killed with tritonserver as it starts, an engine
    process would leave the Triton model's stub reporting the failure to a tritonserver that is gone:
    the stub hangs there for good.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    leave_with_parent(parent_pid)


def leave_with_parent(parent_pid: int, farewell: str | None = None) -> None:
    """End this process (saying `farewell` on stderr) as soon as its parent `parent_pid` is gone: it is then
    given to another parent (init, or a subreaper) at once, whether or not anything has reaped the one
    that died. (The Python backend's stub looks for its tritonserver by pid, which a dead tritonserver not
    yet reaped still holds: killed under a launcher that reads its output to the end before waiting for
    it, tritonserver left the stub, and the engine process under it, running for good, holding the
    launcher's pipes and the model's memory.)"""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        if farewell:
            print(farewell, file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="inflight-parent-watch", daemon=True).start()


def started_to_complete_config(model_name: str, args: list[str] | None = None) -> bool:
    """Whether this process is the Python backend stub that tritonserver (unless run with
    --disable-auto-complete-config) starts only to ask the model to complete its configuration, before
    the instances' own stubs: its command line (`args`, else this process's) names the model itself
    ("llm") where an instance's names the instance ("llm_0_0"). False where it cannot tell."""
    if args is None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            return False
    return model_name in args[2:]


def start_engine_process() -> tuple[subprocess.Popen, multiprocessing.connection.Connection]:
    """The serving engine process (serving/engine_process.py) and this end of its pipe: it imports what
    it needs, then waits for its settings."""
    return start_python_process("inflight.serving.engine_process", "engine_main")
