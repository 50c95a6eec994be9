#!/usr/bin/env python3
"""Node losses under load: `troupe serve` at TP 2 with rank 1 on a `troupe node` and spares,
32 streaming clients, the node holding rank 1 killed (SIGKILL) again and again, a new spare
each time. Every stream must end with the text of an undisturbed greedy run; the server's
resident memory and open descriptors are sampled before the load and after each recovery.

Standard library only (loopback, no client packages). Prints one JSON line; exits 1 when a
stream's text differs, a stream fails, or a recovery does not come; 77 (skipped) without a
model: the default is SmolLM2 in the model cache ($TROUPE_MODEL_CACHE, else
~/.cache/troupe/models).

  python3 scripts/load-kill.py --troupe build/troupe [--model M.gguf] [--kills 5]
"""

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(troupe, secret):
    proc = subprocess.Popen(
        [troupe, "node", "--listen", "127.0.0.1:0", "--devices", "cpu:1",
         "--secret-file", secret, "--connection-timeout-ms", "2000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("troupe node listening on"):
            port = int(line.split()[4].rsplit(":", 1)[1])
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, port
    raise RuntimeError("troupe node did not start")


def request(port, method, path, body=None, timeout=600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def stream(port, prompt, max_tokens, out, progress):
    """One streaming completion: its text and finish reason into `out`."""
    try:
        conn, resp = request(port, "POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True})
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        text = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = json.dumps(chunk["error"])
                return
            choice = chunk["choices"][0]
            text.append(choice.get("text", ""))
            progress[0] += 1
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
        out["text"] = "".join(text)
        conn.close()
    except Exception as e:  # a broken stream is a failure of the run, reported below
        out["error"] = repr(e)


def run_streams(port, prompts, max_tokens, progress):
    outs = [dict() for _ in prompts]
    threads = [threading.Thread(target=stream, args=(port, p, max_tokens, o, progress))
               for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    return threads, outs


def proc_figures(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--troupe", default="build/troupe")
    cache = os.environ.get("TROUPE_MODEL_CACHE",
                           os.path.expanduser("~/.cache/troupe/models"))
    ap.add_argument("--model", default=os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--recovery-timeout", type=float, default=120)
    args = ap.parse_args()
    if not os.path.exists(args.model):
        print(f"skipped: {args.model} is not there (scripts/fetch-smollm2.sh fetches SmolLM2)")
        return 77

    tmp = tempfile.mkdtemp(prefix="troupe-load-kill-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write(os.urandom(24).hex())
    os.chmod(secret, 0o600)
    nodes = [start_node(args.troupe, secret) for _ in range(args.kills + 1)]
    port = free_port()
    serve = subprocess.Popen(
        [args.troupe, "serve", "--model", args.model, "--port", str(port),
         "--tensor-parallel-size", "2", "--nodes", f"127.0.0.1:{nodes[0][1]}",
         "--spare-nodes", ",".join(f"127.0.0.1:{p}" for _, p in nodes[1:]),
         "--max-restarts", str(args.kills), "--restart-window", "3600",
         "--secret-file", secret, "--node-timeout-ms", "2000",
         "--max-num-seqs", str(args.streams)],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "serve.log"), "w"))
    result = {"streams": args.streams, "max_tokens": args.max_tokens, "kills": 0}
    failed = []
    try:
        deadline = time.time() + 300
        while True:
            try:
                _, resp = request(port, "GET", "/health", timeout=5)
                if resp.status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or serve.poll() is not None:
                raise RuntimeError("troupe serve did not come up; see " + tmp + "/serve.log")
            time.sleep(0.5)

        prompts = [f"Question {i}: tell me about the number {i * 7 + 3}." for i in range(args.streams)]
        progress = [0]
        threads, reference = run_streams(port, prompts, args.max_tokens, progress)
        for t in threads:
            t.join()
        chunks = progress[0]  # what the whole load streams
        figures = [dict(proc_figures(serve.pid), at="before the load")]

        progress = [0]
        started = time.time()
        threads, outs = run_streams(port, prompts, args.max_tokens, progress)
        total = chunks
        recoveries = []
        for k in range(args.kills):
            # Each kill once the streams have made a share of their way.
            share = (k + 1) / (args.kills + 1)
            while progress[0] < share * total and any(t.is_alive() for t in threads):
                time.sleep(0.05)
            if not any(t.is_alive() for t in threads):
                break
            victim = nodes[k][0]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            killed = time.time()
            result["kills"] += 1
            # Recovered when the node after it holds the lease: the streams go on.
            before = progress[0]
            while progress[0] == before and any(t.is_alive() for t in threads):
                if time.time() - killed > args.recovery_timeout:
                    failed.append(f"no progress {args.recovery_timeout} s after kill {k + 1}")
                    break
                time.sleep(0.02)
            recoveries.append(round(time.time() - killed, 3))
            figures.append(dict(proc_figures(serve.pid), at=f"after kill {k + 1}"))
        for t in threads:
            t.join()
        result["seconds"] = round(time.time() - started, 2)
        figures.append(dict(proc_figures(serve.pid), at="after the load"))
        for i, (want, got) in enumerate(zip(reference, outs)):
            if "error" in want or "error" in got:
                failed.append(f"stream {i}: {want.get('error') or got.get('error')}")
            elif got.get("text") != want.get("text"):
                failed.append(f"stream {i}: its text differs from the undisturbed run's")
        result["seconds_to_progress_after_kill"] = recoveries
        result["server"] = figures
        result["identical_streams"] = sum(
            1 for w, g in zip(reference, outs) if "text" in g and g.get("text") == w.get("text"))
        with open(os.path.join(tmp, "serve.log")) as log:
            result["replacements_logged"] = sum(1 for line in log if "replaced in" in line)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    result["failures"] = failed
    print(json.dumps(result))
    return 1 if failed or result["kills"] < args.kills else 0


if __name__ == "__main__":
    sys.exit(main())
