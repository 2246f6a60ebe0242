"""One user flooding the Tinker API of `plexrl serve` while another trains: the other user's latency and the
server's memory, side by side with that user alone, in one run.

A server with two keyed users and one service. Ann is the SDK (`tinker`) training a LoRA session: each call is a
one-datum `forward_backward` and its result. Bob is hostile, over raw HTTP. Arms, on one server, in order:

- alone: ann's calls, nothing else running;
- queued samples: bob sends `--samples` `sample` calls (64 samples of `--tokens` tokens each) and never fetches
  a result; past `tinker.max_requests_per_user` they get 429. Ann's calls run while bob's queue drains;
- long polls: bob parks `--polls` `retrieve_future` connections on a request that never finishes; past
  `tinker.max_polls_per_user` they get 429, and past the connection limit the longest-parked ones are evicted.

Printed per arm: ann's calls served, their median and largest latency and the ratio to alone, bob's requests
accepted and refused, and the server process's resident memory. The bound of a flooded call is ann's call
alone plus one of bob's calls alone (his second: the first opens his sampler job), the one the service may be
running when hers comes (the planner takes turns between users, it does not preempt a call, and a finished
call's reply goes out before the next call runs); the bound of memory is what bob's accepted requests hold.

    .venv/bin/python benchmarks/tinker_flood.py [--samples 2000] [--polls 530] [--calls 8] [--tokens 256]
    .venv/bin/python benchmarks/tinker_flood.py --samples 300 --polls 10 --tokens 64 --driver dask
    .venv/bin/python benchmarks/tinker_flood.py --smoke   # small counts, seconds (the tests run it)

It takes the machine: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TINKER_TELEMETRY", "0")  # (the SDK would post its telemetry to the server)
sys.path.insert(0, str(Path(__file__).resolve().parent))

ANN, BOB = "ann-token-0123456789", "bob-token-0123456789"


def rss_mib() -> int:
    """This process's resident memory (the server runs in it, `driver: local`)."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def ann_calls(training: Any, datum: Any, n: int) -> list[float]:
    """The seconds of each of ann's `n` one-datum forward_backward calls, one after the other."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        training.forward_backward([datum], "cross_entropy").result(timeout=900)
        out.append(time.perf_counter() - t0)
    return out


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{url}/api/v1{path}", json=body, headers={"X-API-Key": f"tml-{BOB}"}, timeout=60)


def park(url: str, request_id: str) -> socket.socket:
    """A raw connection left waiting on one retrieve_future (a hostile client; the SDK never holds hundreds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    body = json.dumps({"request_id": request_id}).encode()
    head = (f"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: {host}:{port}\r\nX-API-Key: tml-{BOB}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    return sock


def bob_sample(url: str, asked: dict[str, Any]) -> float:
    """One of bob's sample calls, sent and waited for: its seconds."""
    t0 = time.perf_counter()
    request_id = post(url, "/asample", asked).json()["request_id"]
    while True:  # (a sample's result comes as protobuf; a long poll that ran out, as JSON try_again)
        r = post(url, "/retrieve_future", {"request_id": request_id})
        if not r.headers["content-type"].startswith("application/json") or "try_again" not in r.text:
            break
    if r.status_code != 200 or r.headers["content-type"].startswith("application/json"):
        raise RuntimeError(f"bob's sample call failed: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t0


def row(name: str, lat: list[float], alone: float, calls: int, bob: str) -> str:
    """One arm's line of the table, printed at once (a run cut short still shows the arms it finished)."""
    line = _row(name, lat, alone, calls, bob)
    print(line, flush=True)
    return line


def _row(name: str, lat: list[float], alone: float, calls: int, bob: str) -> str:
    med = statistics.median(lat) if lat else float("nan")
    top = max(lat) if lat else float("nan")
    return f"| {name} | {len(lat)}/{calls} | {med:.3f} | {top:.3f} | {med / alone:.2f}x | {bob} | {rss_mib()} |"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000, help="bob's sample calls, never fetched")
    ap.add_argument("--polls", type=int, default=530, help="bob's parked retrieve_future connections")
    ap.add_argument("--calls", type=int, default=8, help="ann's calls per arm")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each of bob's sample calls")
    ap.add_argument(
        "--driver",
        choices=("local", "dask"),
        default="local",
        help="the server's cluster.driver (dask: its default, a local Dask cluster; nodes sent ahead)",
    )
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.samples, args.polls, args.calls, args.tokens = 12, 12, 2, 4
    import tinker
    from service_api import tiny_smol
    from tinker import types

    from plexrl.server.api import start_server
    from plexrl.server.config import ServerConfig

    with tempfile.TemporaryDirectory(prefix="plexrl-tinker-flood-") as d:
        tmp = Path(d)
        model = tiny_smol(tmp / "model")
        tinker_cfg: dict[str, Any] = {"poll_s": 40}
        if args.smoke:
            tinker_cfg.update(max_requests_per_user=8, max_polls_per_user=4)
        cfg = ServerConfig(
            port=0, journal=str(tmp / "journal.db"), run_dir=str(tmp / "runs"), mlflow=False,
            cluster={"driver": args.driver, "services": {"count": 1}, "max_load": 64}, users={"ann": ANN, "bob": BOB},
            allowed_roots=[str(tmp)], tinker=tinker_cfg,
        )  # fmt: skip
        srv = start_server(cfg)
        socks: list[socket.socket] = []
        service: Any = None
        try:
            base_rss = rss_mib()
            service = tinker.ServiceClient(base_url=srv.url, api_key=f"tml-{ANN}")
            training = service.create_lora_training_client(base_model=str(model), rank=4, seed=0).result()
            toks = training.get_tokenizer().encode("What is 17 + 25? The answer is 42.")
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
            )
            ann_calls(training, datum, 1)  # (warm-up, not timed)
            print(
                f"tiny SmolLM2 (1 layer, real tokenizer), LoRA r4; ann: one-datum forward_backward; bob: "
                f"{args.samples} x sample(64 x {args.tokens} tokens), {args.polls} long polls",
                flush=True,
            )
            print("| arm | ann served | median s | max s | median / alone | bob | RSS MiB |")
            print("|---|---|---|---|---|---|---|", flush=True)
            rows: list[str] = []
            alone_lat = ann_calls(training, datum, args.calls)
            alone = statistics.median(alone_lat)
            rows.append(row("alone", alone_lat, alone, args.calls, "-"))

            sid = post(srv.url, "/create_session", {}).json()["session_id"]
            sampler = post(srv.url, "/create_sampling_session",
                           {"session_id": sid, "sampling_session_seq_id": 0, "base_model": str(model)})  # fmt: skip
            sampler_id = sampler.json()["sampling_session_id"]
            asked = {"sampling_session_id": sampler_id, "num_samples": 64, "prompt": {"chunks": [{"tokens": toks}]},
                     "sampling_params": {"max_tokens": args.tokens, "temperature": 1.0}}  # fmt: skip
            bob_sample(srv.url, {**asked, "seq_id": 0})  # (warm-up: opens bob's sampler job, not timed)
            bob_call = bob_sample(srv.url, {**asked, "seq_id": 1})  # one of bob's calls alone: part of the bound
            t0 = time.perf_counter()
            pending = srv.sessions.futures.new("bob", "sample").request_id  # (the long polls' request: never done)
            print(f"one of bob's sample calls alone: {bob_call:.2f} s", flush=True)
            codes: dict[int, int] = {}
            for i in range(args.samples):
                code = post(srv.url, "/asample", {**asked, "seq_id": i + 2}).status_code
                codes[code] = codes.get(code, 0) + 1
            print(f"bob's {args.samples} sample calls sent in {time.perf_counter() - t0:.1f} s", flush=True)
            flooded = ann_calls(training, datum, args.calls)
            rows.append(row("bob's queued samples", flooded, alone, args.calls,
                            f"{codes.get(200, 0)} accepted, {codes.get(429, 0)} refused (429)"))  # fmt: skip

            for _ in range(args.polls):
                try:
                    socks.append(park(srv.url, pending))
                except OSError:
                    break
            polled = ann_calls(training, datum, args.calls)
            rows.append(row("bob's long polls", polled, alone, args.calls, f"{len(socks)} connections opened"))
            print(f"server RSS before ann's session: {base_rss} MiB; one of bob's sample calls alone: {bob_call:.2f} s")
            bound = alone + bob_call
            print(f"bound of a flooded call: alone + one of bob's calls = {bound:.3f} s ({bound / alone:.2f}x alone); "
                  f"median / bound: {statistics.median(flooded) / bound:.2f} under bob's queued samples, "
                  f"{statistics.median(polled) / bound:.2f} under his long polls")  # fmt: skip
            srv.sessions.futures.complete(pending, "json", {})
        finally:
            for s in socks:
                s.close()
            if service is not None:
                service.close("success").result(timeout=60)
            srv.stop(120)


if __name__ == "__main__":
    main()
