"""Tensor parallelism over torch.distributed: N ranks, one process each.

Rank 0 is the engine's own process: it schedules, samples and detokenizes, and runs its shard of the
model like every rank. Ranks 1..N-1 are worker processes started here. Each step, rank 0 sends the
step's StepInputs to every worker in one message (a pickle through a pipe); then all ranks run the
forward together, transformers' tensor-parallel plan all-reducing inside the model over gloo (CPU) or
NCCL (GPU). The logits come out whole on every rank; rank 0 samples from its own.

A failed rank breaks the collectives for all: rank 0's forward then raises (gloo at once, when a peer's
connection drops; NCCL after its timeout), and RanksFailedError tells the engine to stop, ending every
request with an error naming the rank. Workers leave with rank 0's process: their pipe closes, and a
watchdog thread notices the parent is gone.
"""

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoConfig

from . import quantization
from .config import EngineConfig
from .input_buffers import StepInputs
from .kv_offload import BlockCopy
from .launch import start_python_process
from .model_runner import ModelRunner
from .model_support import kv_heads_and_head_dim
from .scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

# Loading a large shard can take minutes; a collective that long overdue means a rank is stuck.
WORKER_START_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 120.0
# How long rank 0 waits, after a failed step, for a worker's own account of what went wrong.
FAILURE_REPORT_WAIT_S = 2.0


class RanksFailedError(RuntimeError):
    """A rank failed or died: the ranks can no longer run a step together."""


def check_tensor_parallel(config: EngineConfig, full_config) -> None:
    """Clear errors, before any process starts, for what tensor parallelism cannot do."""
    n = config.tensor_parallel_size
    hf_config = getattr(full_config, "text_config", full_config)
    heads = hf_config.num_attention_heads
    kv_heads, _ = kv_heads_and_head_dim(hf_config)
    if heads % n or kv_heads % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the model's {heads} attention heads and "
                         f"{kv_heads} KV heads")
    quantization.check_tensor_parallel(full_config, n, config.quantization)
    accelerator = torch._C._get_accelerator().type
    if accelerator != config.device_type:
        # transformers builds the tensor-parallel mesh on the accelerator torch detects.
        raise ValueError(f"tensor parallelism runs on this machine's {accelerator}, not on device "
                         f"{config.device!r}")
    if config.device_type == "cuda":
        count = torch.cuda.device_count()
        missing = [d for d in config.rank_devices() if int(d.split(":")[1]) >= count]
        if missing:
            raise ValueError(f"tensor_parallel_size {n} needs GPUs {', '.join(config.rank_devices())}; "
                             f"this machine has {count} (cuda:0 to cuda:{count - 1})")


def _join_group(config: EngineConfig, rank: int, store: dist.Store) -> None:
    device = torch.device(config.rank_devices()[rank])
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)  # transformers places the shard on cuda:LOCAL_RANK
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=config.tensor_parallel_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=device if device.type == "cuda" else None)


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: multiprocessing.connection.Connection  # closes (EOF here) when the worker exits
    error: str | None = None  # the worker's own report of its failure

    @classmethod
    def start(cls, config: EngineConfig, rank: int, port: int) -> "_Worker":
        process, ours = start_python_process("inflight.parallel", "worker_main")
        try:
            ours.send((config, rank, port))
        except OSError:
            pass  # it exited already: _await reports how
        return cls(rank, process, ours)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def receive(self) -> str:
        """The kind of the worker's next message, "died" once it has exited; an error's account is kept."""
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):  # the pipe closed: it exited
            _reap(self.process)
            return "died"
        if kind == "error":
            self.error = detail
        return kind

    def describe(self) -> str:
        what = f"rank {self.rank} (pid {self.process.pid})"
        if self.error:
            return f"{what} failed: {self.error}"
        if not self.alive:
            return f"{what} exited with code {self.process.returncode}"
        return f"{what} is running"


class TensorParallelRunner:
    """The engine's runner when tensor_parallel_size > 1: rank 0's ModelRunner plus the workers.
    Everything but execute(), load_lora_slot() and close() is rank 0's ModelRunner's."""

    def __init__(self, config: EngineConfig, beside: tuple[int, int] = (0, 0)):
        """`beside`: what a draft model takes beside rank 0's pool (ModelRunner's; the draft model runs whole
        on rank 0, and every rank's pool has as many blocks as the smallest)."""
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        check_tensor_parallel(config, hf_config)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: "
                               "one tensor-parallel engine per process")
        self.workers: list[_Worker] = []
        self._closed = False
        self._slot_loads: list = []  # LoRA tasks loaded since the last step: sent with the next (load_lora_slot)
        self.step_messages = 0  # steps sent to the workers: how many, their bytes, the seconds sending them
        self.step_message_bytes = 0
        self.step_message_seconds = 0.0
        world = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=WORKER_START_TIMEOUT_S))
        try:
            for rank in range(1, world):
                self.workers.append(_Worker.start(config, rank, store.port))
            self._await("started")
            _join_group(config, 0, store)
            self.runner = ModelRunner(config, rank=0, beside=beside)
            self._await("ready")
        except BaseException as e:
            reports = self._failure_reports()
            self.close()
            if reports:
                raise RuntimeError(f"tensor-parallel start-up failed: {reports}") from e
            raise
        logger.info("tensor parallelism: %d ranks on %s; worker pids %s", world, ", ".join(config.rank_devices()),
                    [w.process.pid for w in self.workers])

    def __getattr__(self, name):
        if name == "runner":  # not built (a failed start-up)
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def _await(self, what: str) -> None:
        """Wait for every worker to say `what`; raise if one fails, dies or takes too long."""
        waiting = {w.conn: w for w in self.workers}
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"tensor-parallel workers did not get {what} within {WORKER_START_TIMEOUT_S:.0f} s: "
                                   + "; ".join(w.describe() for w in waiting.values()))
            for ready in multiprocessing.connection.wait(list(waiting), timeout=left):
                worker = waiting.pop(ready)
                if worker.receive() != what:
                    raise RuntimeError(f"tensor-parallel worker {worker.describe()}")

    def execute(self, batch: ScheduledBatch, logits_at: list[int], block_copies: list[BlockCopy] | None = None,
                pending: None = None) -> torch.Tensor:
        """ModelRunner.execute's, without `pending`: async scheduling is refused under tensor parallelism
        (config.py), since the workers would need rank 0's sampled tokens."""
        assert pending is None
        inputs = self.runner.prepare(batch, logits_at, block_copies)
        inputs.lora_slot_loads, self._slot_loads = self._slot_loads, []
        try:
            self._send(inputs)
            return self.runner.run(inputs)
        except Exception as e:
            # Whatever failed, the ranks may be out of step in their collectives: none can go on.
            reports = self._failure_reports()
            raise RanksFailedError(f"tensor-parallel step failed: {reports or f'rank 0: {e}'}") from e

    def load_lora_slot(self, slot: int, lora_id: int, matrices: dict) -> None:
        """A LoRA task's A and B: every rank loads them before the next step, from its message."""
        self._slot_loads.append((slot, lora_id, matrices))

    def _send(self, inputs: StepInputs) -> None:
        started = time.perf_counter()
        message = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            worker.conn.send_bytes(message)
        self.step_messages += 1
        self.step_message_bytes += len(message)
        self.step_message_seconds += time.perf_counter() - started

    def _failure_reports(self) -> str:
        """What the workers say went wrong (a failed worker reports, then exits), or who died."""
        deadline = time.monotonic() + FAILURE_REPORT_WAIT_S
        failed = []
        for worker in self.workers:
            while worker.error is None and time.monotonic() < deadline:
                if worker.conn.poll(0.05):
                    if worker.receive() == "died":
                        break
                elif worker.alive:
                    break  # nothing to say and running: not the one that failed
            if worker.error or not worker.alive:
                failed.append(worker.describe())
        return "; ".join(failed)

    def close(self) -> None:
        """Stop the workers (they leave their process group) and leave rank 0's."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            try:
                worker.conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # it is gone already
        for worker in self.workers:
            try:
                worker.process.wait(10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reap(process: subprocess.Popen) -> None:
    """Collect the exit code of a worker whose pipe closed (it is exiting)."""
    try:
        process.wait(FAILURE_REPORT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def worker_main() -> None:
    """A worker rank (its process runs this through launch.run_child, given the pipe's descriptor): join
    the group, load the shard, then run every step rank 0 sends until told to stop."""
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    config, rank, port = conn.recv()
    logging.basicConfig(level=logging.WARNING, format=f"inflight rank {rank}: %(levelname)s %(message)s")
    try:
        conn.send(("started", None))
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                              timeout=datetime.timedelta(seconds=WORKER_START_TIMEOUT_S))
        _join_group(config, rank, store)
        runner = ModelRunner(config, rank)
        conn.send(("ready", None))
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:  # rank 0 is gone
                break
            inputs: StepInputs | None = pickle.loads(message)
            if inputs is None:
                break
            runner.run(inputs)
    except BaseException as e:
        logger.exception("rank %d failed", rank)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)  # a rank out of step must not linger in the group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.close()
