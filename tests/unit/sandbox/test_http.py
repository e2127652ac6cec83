import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from async_rl.sandbox import HttpSandbox, SandboxLimits, SandboxUnavailable, score_code


class FakeSandboxFusion(BaseHTTPRequestHandler):
    """Answers POST /run_code the way SandboxFusion does, deciding by a word in the code."""

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.requests.append((self.path, request))
        code = request["code"]
        if "BUSY" in code:
            return self.send_error(429)
        if "FLAKY" in code and len(server.requests) <= 2:
            return self.send_error(503)
        if "CUT" in code and len(server.requests) == 1:  # an answer cut off mid-body
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"status": ')
            self.close_connection = True
            return None
        if "BAD" in code:
            return self.send_error(400)
        if "SLOW" in code:
            server.release.wait(10)
        if "SANDBOX_ERROR" in code:
            return self.answer({"status": "SandboxError", "message": "runner crashed", "run_result": None})
        if "TLE" in code:
            return self.answer(self.outcome("Failed", "TimeLimitExceeded", None, "", ""))
        if "KILL" in code:
            return self.answer(self.outcome("Failed", "Finished", -9, "", ""))
        if "BIG" in code:
            return self.answer(self.outcome("Success", "Finished", 0, "x" * 5000, ""))
        if "exit(3)" in code:
            return self.answer(self.outcome("Failed", "Finished", 3, "", "Traceback...\nSystemExit: 3\n"))
        if "assert" in code:  # an assert harness: report every test passed, in its format
            nonce = code.split("_NONCE = ")[1].split("\n")[0].strip("'")
            lines = "".join(f"\n{nonce} {json.dumps({'test': i})}\n" for i in range(code.count("'assert ")))
            return self.answer(self.outcome("Success", "Finished", 0, lines, ""))
        files = {name: base64.b64decode(text).decode() for name, text in request["files"].items()}
        stdout = f"{request['stdin']}|{files}|{request['run_timeout']}|{request['memory_limit_MB']}\n"
        return self.answer(self.outcome("Success", "Finished", 0, stdout, ""))

    @staticmethod
    def outcome(status, run_status, code, stdout, stderr):
        return {"status": status, "message": "", "compile_result": None, "files": {},
                "run_result": {"status": run_status, "execution_time": 0.01, "return_code": code,
                               "stdout": stdout, "stderr": stderr}}

    def answer(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    server.requests, server.release = [], threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_run_sends_sandboxfusion_s_request_and_reads_its_answer(service):
    server, url = service
    sandbox = HttpSandbox(url, timeout_s=3, limits=SandboxLimits(memory_mb=512))
    result = sandbox.run("print(1)", stdin="in", files={"data.txt": "é"})
    assert (result.status, result.exit_code, result.stderr) == ("ok", 0, "")
    assert result.stdout == "in|{'data.txt': 'é'}|3|512\n"
    assert result.isolation == f"remote: SandboxFusion at {url}/run_code"
    path, request = server.requests[0]
    assert path == "/run_code" and request["language"] == "python" and request["code"] == "print(1)"


@pytest.mark.parametrize(("code", "status", "exit_code"), [
    ("exit(3)", "error", 3), ("TLE", "timeout", None), ("KILL", "killed", -9), ("SANDBOX_ERROR", "unavailable", None),
])
def test_the_answer_s_outcome_becomes_the_status(service, code, status, exit_code):
    result = HttpSandbox(service[1], timeout_s=3).run(code)
    assert (result.status, result.exit_code) == (status, exit_code)
    if code == "SANDBOX_ERROR":
        assert result.stderr == "sandbox service error: runner crashed\n"


def test_output_beyond_the_cap_is_cut_and_flagged(service):
    result = HttpSandbox(service[1], limits=SandboxLimits(output_bytes=1000)).run("BIG")
    assert (result.status, len(result.stdout)) == ("output_limit", 1000)


def test_a_5xx_answer_is_retried(service):
    server, url = service
    result = HttpSandbox(url, timeout_s=3, retries=2).run("FLAKY")
    assert result.status == "ok" and len(server.requests) == 3


def test_a_cut_off_answer_is_retried(service):
    server, url = service
    result = HttpSandbox(url, timeout_s=3, retries=1).run("print('CUT')")
    assert result.status == "ok" and len(server.requests) == 2


def test_retries_end_with_an_error_naming_the_answer(service):
    server, url = service
    result = HttpSandbox(url, timeout_s=3, retries=2).run("BUSY")
    assert result.status == "unavailable" and len(server.requests) == 3
    assert "HTTP 429 (after 3 attempts)" in result.stderr


def test_a_4xx_answer_is_not_retried(service):
    server, url = service
    result = HttpSandbox(url, timeout_s=3, retries=2).run("BAD")
    assert result.status == "unavailable" and len(server.requests) == 1
    assert "HTTP 400" in result.stderr


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_a_timeout_is_never_retried(service):
    server, url = service
    started = time.monotonic()
    result = HttpSandbox(url, timeout_s=0.5, retries=3, grace_s=0.5).run("SLOW")
    assert time.monotonic() - started <= 1.0 + 1.0
    assert result.status == "timeout" and len(server.requests) == 1


def test_an_unreachable_service_is_an_error_naming_it():
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = HttpSandbox(f"http://127.0.0.1:{port}", timeout_s=1, retries=2, grace_s=0.5).run("print(1)")
    assert time.monotonic() - started <= 1.5 + 1.0
    assert result.status == "unavailable" and result.exit_code is None
    assert "unreachable" in result.stderr and f"127.0.0.1:{port}" in result.stderr


def test_score_code_runs_through_it(service):
    result = score_code("def f():\n    return 1\n", ["assert f() == 1", "assert f() != 2"], HttpSandbox(service[1]))
    assert (result.passed, result.total) == (2, 2)


def test_a_service_that_stays_down_fails_the_score_instead_of_scoring_0(service):
    """Retried while the deadline allows, then no verdict: the reward call fails (the
    sample is unscorable), where a 0 would train the policy on the service's outage."""
    server, url = service
    with pytest.raises(SandboxUnavailable, match="HTTP 429"):
        score_code("def f():\n    return 1\n", ["assert f() == 1  # BUSY"], HttpSandbox(url, timeout_s=3, retries=1))
    assert len(server.requests) == 2
