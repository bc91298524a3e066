"""The serving path at the engine's speed: one workload offline and through a real tritonserver (gRPC
streaming, N streams at once, each sending its next request when one ends), with the time to first
token and inter-token latency seen by the clients, exactness (greedy, token ids in and out: every
stream must equal offline), a cancellation storm, the KV blocks free after, and where the serving
process spent its time (backend/inflight/serving/profile.py). Beside the Python clients, perf_analyzer
(Triton's C++ client, `.tools/perf`) streams the same requests at each stream count: its time to first
token and inter-token latency as genai-perf works them out from its export.

On a GPU it serves a random-weight model of the 1.2B Llama shape of `make bench-gpu` (throughput does
not depend on the weights' values); `--smoke` serves a tiny one on CPU with a few requests (the tests
run it). The clients run in processes of their own, so that their Python does not limit the server.

    python3 client/bench_served.py --out served.md                  # GPU
    python3 client/bench_served.py --smoke --streams 4,8            # CPU
"""

import argparse
import dataclasses
import multiprocessing
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "client")]

import perf_analyzer  # noqa: E402
from bench import agreeing_tokens, make_workload  # noqa: E402
from bench_gpu import SHAPES, SMOKE_SHAPE, Report, build_model, release  # noqa: E402

CANCEL_EVERY = 4  # in the cancellation storm, every 4th request is cancelled after its 2nd response


def run_streams(url: str, jobs: list[tuple[int, list[int], int, bool]], streams: int, results) -> None:
    """A client process: `streams` gRPC streams, each sending its next job (index, prompt ids, max
    tokens, cancel) when its request ends; puts one record per job on `results`."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from grpc_stream import make_inputs

    pending = queue.SimpleQueue()
    for job in jobs:
        pending.put(job)

    def stream_loop() -> None:
        while True:
            try:
                index, prompt, max_tokens, cancel = pending.get_nowait()
            except queue.Empty:
                return
            client = grpcclient.InferenceServerClient(url)
            events: queue.SimpleQueue = queue.SimpleQueue()
            client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
            inputs = make_inputs(None, input_ids=np.array(prompt, dtype=np.int32), max_tokens=max_tokens,
                                 temperature=0.0, ignore_eos=True)
            record = {"index": index, "sent": time.perf_counter(), "times": [], "counts": [], "ids": [],
                      "error": None, "cancelled": False}
            # Only the token ids, as a client of token ids asks: the server then builds no text output.
            client.async_stream_infer("llm", inputs, request_id=str(index), enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput("output_ids")])
            while True:
                at, result, error = events.get(timeout=600)
                if error is not None:
                    record["error"] = str(error)
                    break
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    record["times"].append(at)
                    record["counts"].append(int(ids.size))
                    record["ids"].extend(int(t) for t in ids.reshape(-1))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
                if cancel and len(record["times"]) >= 2:
                    client.stop_stream(cancel_requests=True)
                    record["cancelled"] = True
                    break
            client.stop_stream()
            client.close()
            results.put(record)

    threads = [threading.Thread(target=stream_loop) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def serve_workload(url: str, prompts, lengths, streams: int, processes: int, cancel: bool) -> tuple[list, float]:
    """Every request through `streams` streams at once, spread over client processes; the records and
    the wall time from the first send to the last final response."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    jobs = [(i, p, n, cancel and i % CANCEL_EVERY == CANCEL_EVERY - 1)
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    processes = max(1, min(processes, streams))
    # Daemons: a run that fails or is stopped ends them rather than waiting for their streams.
    workers = [context.Process(target=run_streams, args=(url, jobs[k::processes], len(range(k, streams, processes)),
                                                         results), daemon=True) for k in range(processes)]
    for w in workers:
        w.start()
    records = collect_records(results, len(jobs), workers)
    for w in workers:
        w.join()
    start = min(r["sent"] for r in records)
    end = max(r["times"][-1] if r["times"] else r["sent"] for r in records)
    return records, end - start


def collect_records(results, count: int, workers: list, timeout: float = 1800.0) -> list[dict]:
    """`count` records from the client processes' queue; an error as soon as a client process has died
    (its traceback is on stderr), not the whole timeout later: a GPU session has minutes to spend."""
    records = []
    deadline = time.monotonic() + timeout
    while len(records) < count:
        try:
            records.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"a client process exited with code {failed[0]} after {len(records)} of {count} "
                               "requests (its error is above)")
        if all(w.exitcode == 0 for w in workers):  # all done: what they put is in the queue by now
            try:
                records.append(results.get(timeout=5.0))
                continue
            except queue.Empty:
                raise RuntimeError(f"the client processes ended after {len(records)} of {count} requests") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(records)} of {count} requests ended in {timeout:.0f} s")
    return records


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"{1000 * pick(0.5):.1f} / {1000 * pick(0.99):.1f}"


def latencies(records: list[dict]) -> tuple[list[float], list[float]]:
    """Time to first token of each request; inter-token latency of each later token (a response's gap
    spread over the tokens it brought)."""
    ttft, itl = [], []
    for r in records:
        if not r["times"]:
            continue
        ttft.append(r["times"][0] - r["sent"])
        for before, after, count in zip(r["times"], r["times"][1:], r["counts"][1:]):
            itl.extend([(after - before) / count] * count)
    return ttft, itl


def exactness(records: list[dict], expected: list[list[int]]) -> str:
    """How many requests got exactly the offline tokens, and the share of all tokens that came before a
    request's first difference (16-bit numerics can differ between batch compositions)."""
    exact = sum(r["error"] is None and r["ids"] == expected[r["index"]] for r in records)
    agreeing = sum(agreeing_tokens(r["ids"], expected[r["index"]]) for r in records)
    total = sum(len(expected[r["index"]]) for r in records)
    return f"{exact}/{len(records)} ({agreeing / max(total, 1):.1%})"


def measure_perf_analyzer(server, work, streams: int, offline: float, where: str, timeout: float) -> str:
    """perf_analyzer streaming the workload at `streams` concurrent requests: its table row (what went
    wrong instead, if it failed: the measurements after it still run)."""
    before = server.serving_profile()
    try:
        run = perf_analyzer.stream_token_ids(server.grpc_url, streams, work.prompts, work.output_lens, timeout)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        print(f"perf_analyzer at {streams} streams: {e}", file=sys.stderr)
        said = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return f"| perf_analyzer | {streams} | {where} | failed: {said[:80]} ... {said[-160:]} |"
    time.sleep(2 * server.settings["metrics_interval_s"])  # the profile's last report
    rate = run.output_tokens / run.seconds
    return (f"| perf_analyzer | {streams} | {where} | {rate:,.0f} | {rate / offline:.1%} | {percentiles(run.ttft)} | "
            f"{percentiles(run.itl)} | {step_cells(before, server.serving_profile(), run.itl)} | "
            f"{run.responses / run.output_tokens:.2f} |")


def step_cells(before: dict, after: dict, itl: list[float]) -> str:
    """Two table cells: the engine's mean step (ms) between two serving profiles, and the median
    inter-token latency over it."""
    step_wall, _, step_count = (a - b for a, b in zip(after["engine_step"], before["engine_step"]))
    step = step_wall / max(step_count, 1)
    ratio = f"{statistics.median(itl) / step:.2f}" if itl and step else "-"
    return f"{1000 * step:.2f} | {ratio}"


def offline_streamed(llm, prompts: list[list[int]], params: list) -> float:
    """Seconds to run the requests offline through add_request/step, a delta a token as a streamed
    server's engine makes them (token ids alone: detokenize false, as the served clients' outputs)."""
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.add_request(f"streamed-{i}", prompt, dataclasses.replace(p, detokenize=False))
    while llm.has_unfinished():
        llm.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few requests")
    parser.add_argument("--streams", default=None, help="concurrent streams to measure, comma-separated")
    parser.add_argument("--requests", type=int, default=None, help="requests per measurement")
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--sender-threads", default=None, help="the server's sender_threads to compare, e.g. 1,4")
    parser.add_argument("--engine-process", default="true", choices=("true", "false", "both"),
                        help="the server's engine_process setting (both: compare)")
    parser.add_argument("--prompt-range", default=None, help="prompt lengths, e.g. 100,1024")
    parser.add_argument("--output-range", default=None, help="output lengths, e.g. 100,512")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    # A time limit's SIGTERM unwinds the `with` blocks, so that the server (in a session of its own,
    # where the signal does not reach it) is stopped rather than left holding the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from server_process import TritonServer

    from inflight import LLM, SamplingParams
    from inflight.serving.profile import profile_table

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_served.py needs a CUDA GPU (--smoke runs it on CPU)")
    streams = [int(s) for s in (args.streams or ("4" if args.smoke else "64,128,256")).split(",")]
    senders = [None] if args.sender_threads is None else [int(s) for s in args.sender_threads.split(",")]
    count = args.requests or (8 if args.smoke else 512)
    defaults = ((8, 40), (8, 24)) if args.smoke else ((100, 1024), (100, 512))
    ranges = [tuple(map(int, given.split(","))) if given else default
              for given, default in zip((args.prompt_range, args.output_range), defaults)]
    work = make_workload(count, 1, *ranges)
    engine_processes = {"true": [True], "false": [False], "both": [True, False]}[args.engine_process]
    variants = [(engine_process, threads) for engine_process in engine_processes for threads in senders]
    if args.smoke:
        settings = dict(dtype="float32", num_kv_blocks=1024, kv_cache_memory=None, max_num_seqs=max(streams))
    else:
        settings = dict(dtype="bfloat16", kv_cache_memory=40 << 30, max_num_seqs=256, max_num_batched_tokens=4096)
    report = Report(args.out)
    shape_name = "tiny (smoke)" if args.smoke else "1.2B Llama"
    report.add(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}; "
               f"{shape_name} shape, random weights; {count} requests, prompts {min(map(len, work.prompts))}-"
               f"{max(map(len, work.prompts))} tokens, outputs {min(work.output_lens)}-{max(work.output_lens)} "
               f"({work.output_tokens} tokens), greedy, EOS ignored")
    with tempfile.TemporaryDirectory(prefix="inflight-served-") as tmp:
        model_dir = build_model(SMOKE_SHAPE if args.smoke else SHAPES["1.2B Llama"], Path(tmp) / "model",
                                torch.float32 if args.smoke else torch.bfloat16, device)
        # Offline at each stream count's concurrency (max_num_seqs = streams), the fair peer of serving it:
        # generate() (each completion whole at its end), and the same requests streamed (a delta a token,
        # the token ids alone, as the served clients ask): what the engine's own output work costs.
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        offline, streamed, expected = {}, {}, None
        for n in streams:
            llm = LLM(model_dir, device=device, **{**settings, "max_num_seqs": n})
            llm.generate(work.prompts[:8], params[:8])  # warm-up
            start = time.perf_counter()
            outputs = [o.token_ids for o in llm.generate(work.prompts, params)]
            offline[n] = work.output_tokens / (time.perf_counter() - start)
            streamed[n] = work.output_tokens / offline_streamed(llm, work.prompts, params)
            expected = expected or outputs
            llm.close()
            del llm
            release()
        report.add("", "offline, output tok/s: " + ", ".join(f"{rate:,.0f} at max_num_seqs {n} (streamed: "
                                                             f"{streamed[n]:,.0f})" for n, rate in offline.items()),
                   "", "| streams | engine | sender threads | output tok/s | share of offline | share of offline "
                   "streamed | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | mean engine step (ms) | ITL p50 / step | "
                   "responses per token | exact (tokens before a first difference) |",
                   "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        profiles, storms, c_client = [], [], []
        for engine_process, sender_threads in variants:
            where = "own process" if engine_process else "thread"
            with TritonServer(model=model_dir, serving_profile=True, metrics_interval_s=1.0,
                              engine_process=engine_process, sender_threads=sender_threads, **settings) as server:
                serve_workload(server.grpc_url, work.prompts[:8], [4] * 8, 8, 1, False)  # warm-up
                for n in streams:
                    before = server.serving_profile()
                    records, seconds = serve_workload(server.grpc_url, work.prompts, work.output_lens, n,
                                                      args.client_processes, False)
                    time.sleep(2 * server.settings["metrics_interval_s"])  # the profile's last report
                    after = server.serving_profile()
                    records.sort(key=lambda r: r["index"])
                    tokens = sum(len(r["ids"]) for r in records)
                    ttft, itl = latencies(records)
                    responses = sum(len(r["times"]) for r in records)
                    report.add(f"| {n} | {where} | {sender_threads or 'default'} | {tokens / seconds:,.0f} | "
                               f"{tokens / seconds / offline[n]:.1%} | {tokens / seconds / streamed[n]:.1%} | "
                               f"{percentiles(ttft)} | {percentiles(itl)} | {step_cells(before, after, itl)} | "
                               f"{responses / tokens:.2f} | {exactness(records, expected)} |")
                    profiles.append((f"{n} streams, engine: {where}, sender threads {sender_threads or 'default'}",
                                     profile_table(before, after, seconds)))
                    if perf_analyzer.available():  # (a limit of its own: a GPU session's minutes are few)
                        c_client.append(measure_perf_analyzer(server, work, n, offline[n],
                                                              f"{where} | {sender_threads or 'default'}",
                                                              timeout=60 + 5 * seconds))
                # The cancellation storm: every 4th request cancelled after its 2nd response, at the most streams.
                records, _ = serve_workload(server.grpc_url, work.prompts, work.output_lens, max(streams),
                                            args.client_processes, True)
                records.sort(key=lambda r: r["index"])
                server.wait_for_metric("inflight_kv_blocks_used", lambda v: v == 0, timeout=60)
                server.wait_for_metric("inflight_num_requests_running", lambda v: v == 0, timeout=60)
                finished = [r for r in records if not r["cancelled"]]
                storms.append(f"cancellation storm ({max(streams)} streams, engine: {where}, sender threads "
                              f"{sender_threads or 'default'}): {len(records) - len(finished)} of "
                              f"{len(records)} requests cancelled mid-stream; the others: "
                              f"{exactness(finished, expected)} exact; every KV block free after")
        report.add("", *storms)
        if c_client:
            report.add("", "perf_analyzer 2.51 (C++ client, the same requests streamed as token ids; it asks for "
                       "every output, the text too), as genai-perf works out its figures (ITL: a request's time "
                       "from its first response to its last, over its tokens after the first):", "",
                       "| client | streams | engine | sender threads | output tok/s | share of offline | "
                       "TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | mean engine step (ms) | ITL p50 / step | "
                       "responses per token |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|", *c_client)
        else:
            report.add("", f"perf_analyzer: not run ({perf_analyzer.PERF / 'bin'} has none: make setup-serving, "
                       "or the bundle of scripts/pack_tritonserver.sh)")
        for what, table in profiles:
            report.add("", f"serving profile, {what} (wall seconds summed over threads and the engine process):",
                       "", table)


if __name__ == "__main__":
    main()
