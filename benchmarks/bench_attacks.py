"""What another tenant's attack costs a victim: its latency under each attack against its idle latency.

One stack (memory service, compute service, gateway with its HTTP front and two API keys) serves
the default model. Tenant b, the victim, sends short completions (8 tokens, greedy) one after
another through the HTTP front, and ``/health`` is asked beside them; first idle, then while tenant
a (or a client without a key) runs each attack for ``--seconds``:

- ``tools``: chat requests with 128 function tools of 220 properties each (a 3.8 MB body): a fast
  400 before rendering or tokenizing (the prompt cap counts the tools' text);
- ``prompt_scores``: a 1,315-token prompt with ``n`` 64, ``echo``, ``logprobs`` 20 and
  ``prompt_logprobs`` 20, not streamed: a 400 before any work (the reply budget counts every copy);
- ``connection_flood``: without a key, as many half-sent requests as the gateway takes
  (``--flood-connections``), each reopened when the server closes it: the connection waiting
  longest for its headers gives its place to a new one, so keyed clients keep theirs;
- ``costly_grammar``: a JSON schema of 1,200 optional properties, compiled to its timeout and
  refused (the compile worker runs at nice 5, its timeout in CPU seconds).

Each attack runs ``--attackers`` clients in a loop, back to back (a flood, harsher than one attack
request at a time), or with ``--interval-s`` between each answer and the next request.
``--attacker-requests-per-s R`` gives tenant a the tenants file's ``max_requests_per_s`` (the
operator's bound on such floods; b has none). Prints a table, then as its last line one JSON
object: per attack the victim's p50 and worst latency and their ratios to the idle p50, ``/health``'s
worst, the gateway's and compute service's CPU seconds per second (what the attack costs the
servers, apart from the benchmark's own clients on the same cores), and what the attack's
requests were answered. From the repository root:

    python -m benchmarks.bench_attacks                  # default model, 20 s per attack
    python -m benchmarks.bench_attacks --quick          # tiny random model, 4 s per attack
    python -m benchmarks.bench_attacks --attacker-requests-per-s 5   # the same with a's rate bounded
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from benchmarks.cpu_info import cpu_name
from pagedserve.service_auth import API_KEYS_ENV
from pagedserve.sockets import free_port
from pagedserve import stack as launcher
from pagedserve.process import wait_until
from pagedserve_testing.stack import StackConfig

KEY_A, KEY_B = "attacker-key-0123456789abcdef", "victim-key-0123456789abcdef01"
VICTIM_PROMPT = "The capital of France is"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "near an old harbour where ships unload grain timber and wool every single morning").split()


def tools_body(model: str, num_tools: int = 128, num_properties: int = 220) -> dict:
    properties = {f"field_{i}": {"type": "string", "description": f"the value of field number {i} of this record"}
                  for i in range(num_properties)}
    tools = [{"type": "function", "function": {"name": f"tool_{t}", "description": f"tool number {t}",
                                               "parameters": {"type": "object", "properties": properties}}}
             for t in range(num_tools)]
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 8}


def prompt_scores_body(model: str, num_words: int = 1000) -> dict:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(num_words))
    return {"model": model, "prompt": prompt, "n": 64, "echo": True, "logprobs": 20, "prompt_logprobs": 20,
            "max_tokens": 8}


def costly_grammar_body(model: str) -> dict:
    schema = {"type": "object", "properties": {str(i): {} for i in range(1200)}}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


class Victim:
    """Tenant b's completions and ``/health``, one after another, latencies kept per phase."""

    def __init__(self, base_url: str, model: str) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {KEY_B}"})
        self.model = model
        self.failures: collections.Counter[str] = collections.Counter()

    def completion_s(self) -> float:
        start = time.perf_counter()
        reply = self.client.post("/v1/completions", json={"model": self.model, "prompt": VICTIM_PROMPT,
                                                          "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        if reply.status_code != 200:
            self.failures[f"completion {reply.status_code}"] += 1
        return time.perf_counter() - start

    def health_s(self) -> float:
        start = time.perf_counter()
        reply = self.client.get("/health")
        if reply.status_code != 200:
            self.failures[f"health {reply.status_code}"] += 1
        return time.perf_counter() - start

    def measure(self, until: Callable[[], bool], min_count: int = 3) -> dict[str, list[float]]:
        completions, health = [], []
        while len(completions) < min_count or not until():
            completions.append(self.completion_s())
            health.append(self.health_s())
        return {"completion": completions, "health": health}


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system, /proc); its children's not counted."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_attack(attack: Callable[[threading.Event, collections.Counter], None], num_attackers: int,
               victim: Victim, seconds: float,
               servers: dict[str, int]) -> tuple[dict[str, list[float]], collections.Counter, dict[str, float]]:
    stop, answers = threading.Event(), collections.Counter()
    threads = [threading.Thread(target=attack, args=(stop, answers), daemon=True) for _ in range(num_attackers)]
    for thread in threads:
        thread.start()
    time.sleep(min(1.0, seconds / 4))  # the attack under way before the victim measures
    start, cpu_before = time.monotonic(), {name: cpu_seconds(pid) for name, pid in servers.items()}
    end = start + seconds
    try:
        latencies = victim.measure(lambda: time.monotonic() >= end)
        elapsed = time.monotonic() - start
        # The servers' cores spent a second of attack (the victim's own requests included): what a
        # remote attacker costs the machine, apart from this benchmark's own clients.
        cpu = {f"{name}_cpu_per_s": round((cpu_seconds(pid) - cpu_before[name]) / elapsed, 2)
               for name, pid in servers.items()}
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return latencies, answers, cpu


def http_attack(base_url: str, path: str, body: dict,
                interval_s: float = 0.0) -> Callable[[threading.Event, collections.Counter], None]:
    payload = json.dumps(body).encode()

    def attack(stop: threading.Event, answers: collections.Counter) -> None:
        with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {KEY_A}",
                                                                   "Content-Type": "application/json"}) as client:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    reply = client.post(path, content=payload)
                    answers[f"{reply.status_code} ({len(reply.content)} bytes)"] += 1
                except httpx.HTTPError as exc:
                    answers[type(exc).__name__] += 1
                answers["seconds"] += time.perf_counter() - start
                stop.wait(interval_s)
    return attack


def flood_attack(port: int, num_connections: int) -> Callable[[threading.Event, collections.Counter], None]:
    half_sent = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    def attack(stop: threading.Event, answers: collections.Counter) -> None:
        conns: list[socket.socket] = []
        try:
            while not stop.is_set():
                while len(conns) < num_connections and not stop.is_set():
                    try:
                        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
                        conn.sendall(half_sent)
                        conn.setblocking(False)
                        conns.append(conn)
                        answers["opened"] += 1
                    except OSError:
                        answers["refused"] += 1
                        break
                alive = []
                for conn in conns:  # the ones the server closed are reopened
                    try:
                        data = conn.recv(4096)
                        answers["closed by the server" if not data else "answered"] += 1
                        conn.close()
                    except BlockingIOError:
                        alive.append(conn)
                    except OSError:
                        answers["reset"] += 1
                        conn.close()
                conns = alive
                time.sleep(0.05)
        finally:
            for conn in conns:
                conn.close()
    return attack


def summary(latencies: dict[str, list[float]], idle_p50: float) -> dict:
    completions, health = latencies["completion"], latencies["health"]
    p50, worst = statistics.median(completions), max(completions)
    return {"victim_requests": len(completions), "victim_p50_s": round(p50, 3), "victim_max_s": round(worst, 3),
            "p50_ratio": round(p50 / idle_p50, 2), "max_ratio": round(worst / idle_p50, 2),
            "health_max_s": round(max(health), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 4 s per attack")
    parser.add_argument("--seconds", type=float, default=None, help="each attack's duration (default 20, quick 4)")
    parser.add_argument("--attackers", type=int, default=2, help="attacking clients per HTTP attack")
    parser.add_argument("--flood-connections", type=int, default=1100)
    parser.add_argument("--attacks", default="tools,prompt_scores,connection_flood,costly_grammar")
    parser.add_argument("--interval-s", type=float, default=0.0,
                        help="each HTTP attacker's pause after each answer (default 0: back to back, a flood)")
    parser.add_argument("--attacker-requests-per-s", type=float, default=None,
                        help="tenant a's max_requests_per_s in the gateway's tenants file (default: none)")
    args = parser.parse_args()
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    os.environ.pop(API_KEYS_ENV, None)
    with tempfile.TemporaryDirectory(prefix="bench-attacks-") as tmp:
        attacker: dict = {"keys": [KEY_A]}
        if args.attacker_requests_per_s is not None:
            attacker["max_requests_per_s"] = args.attacker_requests_per_s
        keys_file = Path(tmp) / "tenants.json"
        keys_file.write_text(json.dumps({"tenants": {"a": attacker, "b": {"keys": [KEY_B]}}}))
        if args.quick:
            from pagedserve_testing.tiny_model import build_service_model
            model = str(build_service_model(Path(tmp) / "tiny-model").path)
        else:
            model = "default"
        http_port = free_port()
        config = StackConfig(model=model, max_num_blocks=4096, max_num_seqs=64, dtype="auto",
                             gateway_args=("--http-port", str(http_port), "--api-keys-file", str(keys_file)))
        (Path(tmp) / "run").mkdir()
        # pagedserve.stack's launcher, as ``pagedserve up``: the test kit's start warms up through gRPC
        # without a key, and this gateway has two.
        stack = launcher.start_stack(config.stack_config(free_port()), Path(tmp) / "run")
        try:
            base_url = f"http://127.0.0.1:{http_port}"
            wait_until(lambda: victim_model(base_url) is not None, 600, "the model served over HTTP", interval_s=0.5)
            victim = Victim(base_url, model_name := victim_model(base_url))
            for _ in range(3):
                victim.completion_s()  # warm
            servers = {"gateway": stack.gateway.pid, "compute": stack.compute.pid}
            idle_start, idle_cpu = time.monotonic(), {name: cpu_seconds(pid) for name, pid in servers.items()}
            idle = victim.measure(lambda: True, min_count=10)
            idle_s = time.monotonic() - idle_start
            idle_p50 = statistics.median(idle["completion"])
            chat, completions = "/v1/chat/completions", "/v1/completions"
            attacks = {
                "tools": lambda: http_attack(base_url, chat, tools_body(model_name), args.interval_s),
                "prompt_scores": lambda: http_attack(base_url, completions, prompt_scores_body(model_name),
                                                     args.interval_s),
                "connection_flood": lambda: flood_attack(http_port, args.flood_connections),
                "costly_grammar": lambda: http_attack(base_url, chat, costly_grammar_body(model_name), args.interval_s),
            }
            results = {"idle": summary(idle, idle_p50)}
            results["idle"].update({f"{name}_cpu_per_s": round((cpu_seconds(pid) - idle_cpu[name]) / idle_s, 2)
                                    for name, pid in servers.items()})
            for name in args.attacks.split(","):
                num = 1 if name == "connection_flood" else args.attackers
                latencies, answers, cpu = run_attack(attacks[name](), num, victim, seconds, servers)
                results[name] = {**summary(latencies, idle_p50), **cpu}
                num_answered = sum(v for k, v in answers.items() if k != "seconds")
                if "seconds" in answers and num_answered:
                    results[name]["attack_mean_s"] = round(answers.pop("seconds") / num_answered, 3)
                results[name]["attack_answers"] = dict(answers)
        finally:
            stack.stop()
    print(f"{'phase':<18} {'victim p50':>10} {'victim max':>10} {'p50 x':>7} {'max x':>7} {'health max':>10} "
          f"{'gw cpu/s':>8} {'compute cpu/s':>13}")
    for name, row in results.items():
        print(f"{name:<18} {row['victim_p50_s']:>10.3f} {row['victim_max_s']:>10.3f} {row['p50_ratio']:>7.2f} "
              f"{row['max_ratio']:>7.2f} {row['health_max_s']:>10.3f} {row['gateway_cpu_per_s']:>8.2f} "
              f"{row['compute_cpu_per_s']:>13.2f}")
    print(json.dumps({"benchmark": "attacks", "cpu": cpu_name(), "num_cpus": os.cpu_count(),
                      "model": "tiny-random" if args.quick else "default", "seconds_per_attack": seconds,
                      "attackers": args.attackers, "interval_s": args.interval_s,
                      "attacker_requests_per_s": args.attacker_requests_per_s,
                      "victim_failures": dict(victim.failures), **results}))


def victim_model(base_url: str) -> str | None:
    """The served model's name, once the HTTP front serves it (None before)."""
    try:
        reply = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    except httpx.HTTPError:
        return None
    return reply.json()["data"][0]["id"] if reply.status_code == 200 else None


if __name__ == "__main__":
    main()
