#!/usr/bin/env python3
"""Probes `troupe serve` as a hostile or careless client would, on loopback only.

    python3 scripts/probe-serve.py TROUPE_BINARY [SOURCE_DIR]

Starts three servers on the tiny test model (one under a low file-descriptor limit, one
with a small connection cap) and runs each probe against them with raw sockets (Python's
standard library only: nothing of troupe's own client code). Each probe is bounded in
count and time. Prints one JSON object per probe and a summary; exits 1 when any failed.
The test suite runs it (ctest: serve_survives_the_probes).
"""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

TROUPE = sys.argv[1]
SOURCE = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), ".."))
FIXTURES = os.path.join(SOURCE, "tests", "fixtures")
KEY = "probe key long enough"
AUTH = {"Authorization": "Bearer " + KEY}
VOCAB = 512
MAX_LEN = 2048
LORA = None  # written by main


class Server:
    """A `troupe serve` process on a free loopback port."""

    def __init__(self, model, *flags, nofile=None):
        self.log = tempfile.NamedTemporaryFile(prefix="probe-serve-", suffix=".log", delete=False)
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(
            [TROUPE, "serve", "--model", model, "--port", "0", "--served-model-name", "tiny",
             "--kv-cache-memory", str(64 << 20), "--swap-space", "0", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=limit)
        self.port = None
        deadline = time.time() + 60
        while time.time() < deadline and self.proc.poll() is None:
            text = open(self.log.name, errors="replace").read()
            if " on http://127.0.0.1:" in text:
                self.port = int(text.split(" on http://127.0.0.1:")[1].split()[0])
                return
            time.sleep(0.1)
        raise RuntimeError("the server did not start:\n" + open(self.log.name, errors="replace").read())

    def stop(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        os.unlink(self.log.name)

    def rss_kib(self):
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def fds(self):
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def output(self):
        return open(self.log.name, errors="replace").read()


def connect(port, timeout=10.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.settimeout(timeout)
    return s


def request_bytes(method, path, body=None, headers=None, version="1.1"):
    head = f"{method} {path} HTTP/{version}\r\nHost: probe\r\n"
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if body is not None:
        all_headers["Content-Length"] = str(len(data))
    for k, v in all_headers.items():
        head += f"{k}: {v}\r\n"
    return head.encode() + b"\r\n" + data


def read_all(s):
    """Everything the server sends until it closes the connection (or the timeout)."""
    got = b""
    try:
        while True:
            part = s.recv(65536)
            if not part:
                break
            got += part
    except (socket.timeout, ConnectionResetError):
        pass
    return got


def call(port, method, path, body=None, headers=None, timeout=20.0):
    """(status, parsed JSON body or text) of one request on its own connection."""
    s = connect(port, timeout)
    s.sendall(request_bytes(method, path, body, {**(headers or {}), "Connection": "close"}))
    got = read_all(s)
    s.close()
    if not got:
        return 0, None
    head, _, rest = got.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    try:
        return status, json.loads(rest)
    except ValueError:
        return status, rest.decode(errors="replace")


def closed_within(s, seconds):
    """Whether the server closes `s` (reading and dropping what it sends) within `seconds`."""
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


class Stream(threading.Thread):
    """A streamed completion on its own connection, read to its end in the background."""

    def __init__(self, port, body, headers=None):
        super().__init__(daemon=True)
        self.sock = connect(port, 60)
        body = {**body, "stream": True}
        self.sock.sendall(request_bytes("POST", "/v1/completions", body,
                                        {**(headers or {}), "Connection": "close"}))
        self.raw = b""
        self.first = threading.Event()
        self.stamps = []
        self.start()

    def run(self):
        try:
            while True:
                part = self.sock.recv(65536)
                if not part:
                    break
                self.raw += part
                if b"data: " in self.raw:
                    self.stamps.append(time.time())
                    self.first.set()
        except OSError:
            pass
        self.first.set()

    def ran_past(self, t):
        """Whether events came after time `t`."""
        self.join(120)
        return bool(self.stamps) and self.stamps[-1] > t

    def events(self):
        out = []
        for line in self.raw.decode(errors="replace").split("\n"):
            line = line.strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
        return out

    def result(self):
        """(token ids, finish reason, error or None)."""
        self.join(120)
        ids, reason, err = [], None, None
        for e in self.events():
            if "error" in e:
                err = e["error"]
                continue
            c = e["choices"][0]
            ids += c.get("token_ids") or []
            reason = c.get("finish_reason") or reason
        return ids, reason, err


PROBES = []


def probe(fn):
    PROBES.append(fn)
    return fn


def expect(cond, why):
    if not cond:
        raise AssertionError(why)


# -- the probes ----------------------------------------------------------------------------

@probe
def accepts_again_after_running_out_of_file_descriptors(servers):
    srv = servers["fd_limited"]
    held = []
    for _ in range(60):  # beyond the process's descriptor limit
        try:
            held.append(connect(srv.port, 5))
        except OSError:
            break
    time.sleep(1.0)
    for s in held:
        s.close()
    status, body = call(srv.port, "GET", "/health", timeout=15)
    expect(status == 200, f"/health after the descriptors came back: {status} {body}")
    expect("accept failed" in srv.output(), "the server never ran out of descriptors: the probe proved nothing")
    return {"connections_opened": len(held)}


@probe
def a_chunk_extension_without_end_is_refused(servers):
    srv = servers["main"]
    before = srv.rss_kib()
    s = connect(srv.port, 10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: probe\r\nTransfer-Encoding: chunked\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n5;")
    sent, piece = 0, b"a" * 65536
    try:
        while sent < (64 << 20):
            s.sendall(piece)
            sent += len(piece)
    except OSError:
        pass
    got = read_all(s)
    s.close()
    grew = srv.rss_kib() - before
    expect(got.startswith(b"HTTP/1.1 400"), f"answer to an endless chunk extension: {got[:200]!r}")
    expect(sent < (64 << 20), "the server read 64 MiB of one chunk header")
    expect(grew < 16 << 10, f"the server grew by {grew} KiB")
    return {"bytes_sent_before_refusal": sent, "rss_growth_kib": grew}


@probe
def a_bad_token_id_fails_only_its_own_request(servers):
    srv = servers["main"]
    streams = [Stream(srv.port, {"prompt": [1, 2, 3 + i], "max_tokens": 300, "temperature": 0,
                                 "ignore_eos": True}, AUTH) for i in range(4)]
    for st in streams:
        st.first.wait(30)
    status, body = call(srv.port, "POST", "/v1/completions",
                        {"prompt": [VOCAB], "max_tokens": 1}, AUTH)
    answered = time.time()
    expect(status == 400 and body["error"]["param"] == "prompt", f"a token id past the vocabulary: {status} {body}")
    for st in streams:
        ids, reason, err = st.result()
        expect(err is None and reason == "length" and len(ids) == 300,
               f"a stream beside it ended with {len(ids)} tokens, {reason}, {err}")
        expect(st.ran_past(answered), "a stream had ended before the bad request: the probe proved nothing")
    return {"streams_intact": len(streams)}


@probe
def unloading_a_lora_ends_only_its_requests(servers):
    srv = servers["main"]
    status, body = call(srv.port, "POST", "/v1/load_lora_adapter",
                        {"lora_name": "qv", "lora_path": LORA}, AUTH)
    expect(status == 200, f"load: {status} {body}")
    body = {"prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    base = [Stream(srv.port, body, AUTH) for _ in range(2)]
    lora = Stream(srv.port, {**body, "model": "qv"}, AUTH)
    for st in base + [lora]:
        st.first.wait(30)
    status, answer = call(srv.port, "POST", "/v1/unload_lora_adapter", {"lora_name": "qv"}, AUTH)
    answered = time.time()
    expect(status == 200, f"unload: {status} {answer}")
    for st in base:
        ids, reason, err = st.result()
        expect(err is None and reason == "length" and len(ids) == 400,
               f"a base-model stream ended with {len(ids)} tokens, {reason}, {err}")
        expect(st.ran_past(answered), "a stream had ended before the unload: the probe proved nothing")
    ids, reason, err = lora.result()
    expect(err is not None and "unloaded" in err["message"], f"the adapter's stream: {len(ids)} tokens, {reason}, {err}")
    return {"lora_stream_tokens_before_unload": len(ids)}


@probe
def an_idle_connection_is_closed(servers):
    s = connect(servers["main"].port)
    expect(closed_within(s, 6), "an idle connection was still open after 6 s (idle timeout 1 s)")
    s.close()


def cut_off_while_trickling(port, start, byte, seconds):
    """Whether the server closes a connection that sent `start` and then one `byte` every
    quarter of a second, within `seconds`."""
    s = connect(port)
    s.sendall(start)
    began = time.time()
    try:
        while time.time() - began < seconds:
            s.sendall(byte)
            time.sleep(0.25)
    except OSError:
        pass
    cut = time.time() - began < seconds or closed_within(s, 0.1)
    s.close()
    return cut


@probe
def a_slow_header_is_cut_off(servers):
    expect(cut_off_while_trickling(servers["main"].port, b"POST /v1/completions HTTP/1.1\r\n", b"X", 8),
           "a header sent a byte at a time was still read after 8 s (header timeout 1 s)")


@probe
def a_slow_body_is_cut_off(servers):
    head = request_bytes("POST", "/v1/completions", None, {**AUTH, "Content-Length": "100000"})
    start = time.time()
    expect(cut_off_while_trickling(servers["main"].port, head, b"{", 10),
           "a body sent a byte at a time was still read after 10 s (body timeout 3 s)")
    # The body's own deadline, not the header's (1 s), cut it.
    expect(time.time() - start >= 2, f"cut off after {time.time() - start:.1f} s, before the body timeout of 3 s")


@probe
def connections_beyond_the_cap_get_503(servers):
    srv = servers["capped"]
    base_fds = srv.fds()
    held = [connect(srv.port) for _ in range(8)]
    extra = [connect(srv.port) for _ in range(8)]
    answers = [read_all(s)[:12] for s in extra]
    expect(all(a == b"HTTP/1.1 503" for a in answers), f"connections beyond the cap of 8: {answers}")
    fds = srv.fds()
    expect(fds <= base_fds + 8 + 2, f"the server holds {fds} descriptors, {base_fds} before 8 connections")
    for s in held + extra:
        s.close()
    for _ in range(50):  # the server sees the closes in its own time
        status, _ = call(srv.port, "GET", "/health")
        if status == 200:
            break
        time.sleep(0.1)
    expect(status == 200, f"/health once they closed: {status}")
    return {"descriptors_with_cap_reached": fds - base_fds}


@probe
def a_wrong_key_is_refused_before_the_body(servers):
    srv = servers["main"]
    before = srv.rss_kib()
    socks = []
    for _ in range(8):
        s = connect(srv.port, 5)
        s.sendall(request_bytes("POST", "/v1/completions", None,
                                {"Authorization": "Bearer wrong", "Content-Length": str(8 << 20)}))
        socks.append(s)
    answers = [read_all(s)[:12] for s in socks]
    for s in socks:
        s.close()
    expect(all(a == b"HTTP/1.1 401" for a in answers), f"answers before any body byte: {answers}")
    # A client that sends its whole body still reads the answer: the server reads and
    # drops the rest rather than resetting the connection.
    s = connect(srv.port, 10)
    body = b"x" * (4 << 20)
    sender = threading.Thread(target=lambda: _send_quietly(s, request_bytes(
        "POST", "/v1/completions", body, {"Authorization": "Bearer wrong"})), daemon=True)
    sender.start()
    answer = read_all(s)[:12]
    sender.join(10)
    s.close()
    expect(answer == b"HTTP/1.1 401", f"a wrong key with a 4 MiB body sent whole: {answer}")
    return {"rss_growth_kib": srv.rss_kib() - before}


def _send_quietly(s, data):
    try:
        s.sendall(data)
    except OSError:
        pass


@probe
def a_huge_prompt_is_refused_and_streams_go_on(servers):
    srv = servers["main"]
    stream = Stream(srv.port, {"prompt": [1, 2, 3], "max_tokens": 1500, "temperature": 0,
                               "ignore_eos": True}, AUTH)
    stream.first.wait(30)
    text = "hello world " * (600 << 10)  # 7.2 MB, under the 8 MiB body bound
    status, body = call(srv.port, "POST", "/v1/completions",
                        {"prompt": text, "max_tokens": 4}, AUTH, timeout=60)
    answered = time.time()
    expect(status == 400 and body["error"]["param"] == "prompt", f"a 7 MB prompt: {status} {body}")
    ids, reason, err = stream.result()
    expect(stream.ran_past(answered), "the stream had ended before the prompt was refused: the probe proved nothing")
    expect(err is None and len(ids) == 1500, f"the stream beside it: {len(ids)} tokens, {err}")
    gaps = [b - a for a, b in zip(stream.stamps, stream.stamps[1:])]
    return {"stream_longest_gap_s": round(max(gaps), 3) if gaps else None}


@probe
def a_fifo_as_an_adapter_config_is_refused_at_once(servers):
    srv = servers["main"]
    with tempfile.TemporaryDirectory() as d:
        os.mkfifo(os.path.join(d, "adapter_config.json"))
        status, body = call(srv.port, "POST", "/v1/load_lora_adapter",
                            {"lora_name": "fifo", "lora_path": d}, AUTH, timeout=20)
    expect(status == 400 and "not a regular file" in body["error"]["message"], f"{status} {body}")
    status, _ = call(srv.port, "GET", "/health")
    expect(status == 200, f"/health after: {status}")


@probe
def out_of_range_values_are_400(servers):
    srv = servers["main"]
    cases = [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2**64 - 1}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 100000}, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * (MAX_LEN - 8), "max_tokens": 9}, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * MAX_LEN, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "logprobs": 2**32}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 2], "temperature": 1e308}, "temperature"),
        ("/v1/completions", {"prompt": [1, 2], "seed": 2**64 - 1}, "seed"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": 5}]}]}, "messages"),
        ("/collective_rpc", {"method": "no_such_method"}, None),
        ("/collective_rpc", {"method": "check_health", "timeout": -1}, "timeout"),
        ("/wake_up?tags=foo", None, "tags"),
        ("/sleep?level=3", None, "level"),
    ]
    seen = []
    for path, body, param in cases:
        status, answer = call(srv.port, "POST", path, body, AUTH)
        seen.append((path, status))
        expect(status == 400, f"{path} {json.dumps(body)[:80]}: {status} {answer}")
        expect(isinstance(answer, dict) and "error" in answer, f"{path}: not an error object: {answer}")
        if param:
            expect(answer["error"]["param"] == param, f"{path}: param {answer['error']['param']}, not {param}")
    status, answer = call(srv.port, "POST", "/v1/completions",
                          {"prompt": [1] * (MAX_LEN - 8), "max_tokens": 8, "temperature": 0}, AUTH)
    expect(status == 200, f"the longest completion that fits: {status} {answer}")
    return {"cases": len(cases)}


def write_lora(directory, layers, hidden, rank=4):
    """A PEFT LoRA adapter on every layer's q_proj (zero factors: the base model's tokens)."""
    os.makedirs(directory)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"],
                   "task_type": "CAUSAL_LM"}, f)
    header, offset = {}, 0
    for layer in range(layers):
        for factor, shape in (("lora_A", [rank, hidden]), ("lora_B", [hidden, rank])):
            size = 4 * shape[0] * shape[1]
            name = f"base_model.model.model.layers.{layer}.self_attn.q_proj.{factor}.weight"
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    text = json.dumps(header).encode()
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + bytes(offset))


def main():
    with tempfile.TemporaryDirectory() as work:
        # A model slow enough that streams are still running when a probe's request comes
        # (the suite's fixtures finish hundreds of tokens in milliseconds), with the tiny
        # test tokenizer (ids below 423), so that text prompts are tokenized.
        model = os.path.join(work, "model")
        subprocess.run([TROUPE, "make-model", "--out", model, "--layers", "8", "--hidden", "256",
                        "--vocab", str(VOCAB), "--max-position", str(MAX_LEN)], check=True,
                       stdout=subprocess.DEVNULL)
        os.symlink(os.path.join(FIXTURES, "tiny-tokenizer", "tokenizer.json"), os.path.join(model, "tokenizer.json"))
        write_lora(os.path.join(work, "lora"), layers=8, hidden=256)
        global LORA
        LORA = os.path.join(work, "lora")
        servers = {}
        try:
            servers["main"] = Server(model, "--api-key", KEY, "--enable-admin-api", "--max-loras", "2",
                                     "--max-lora-rank", "8",
                                     "--idle-timeout", "1", "--header-timeout", "1", "--body-timeout", "3")
            servers["capped"] = Server(model, "--max-connections", "8")
            probe_fds = Server(model)  # how many descriptors a server needs at rest
            base = probe_fds.fds()
            probe_fds.stop()
            servers["fd_limited"] = Server(model, nofile=base + 24)
            failed = 0
            for fn in PROBES:
                start = time.time()
                result = {"probe": fn.__name__}
                try:
                    details = fn(servers) or {}
                    result.update(ok=True, **details)
                except Exception as e:  # a probe's failure is reported, and the rest run
                    failed += 1
                    result.update(ok=False, why=f"{type(e).__name__}: {e}")
                result["seconds"] = round(time.time() - start, 2)
                print(json.dumps(result), flush=True)
                for name, srv in servers.items():
                    if srv.proc.poll() is not None:
                        print(json.dumps({"probe": fn.__name__, "ok": False,
                                          "why": f"server '{name}' died: " + srv.output()[-2000:]}))
                        return 1
            print(json.dumps({"probes": len(PROBES), "failed": failed}))
            return 1 if failed else 0
        finally:
            for srv in servers.values():
                srv.stop()


if __name__ == "__main__":
    sys.exit(main())
