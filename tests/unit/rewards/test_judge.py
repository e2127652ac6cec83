"""rewards/judge.py: an LLM judge as a reward source, against a real OpenAI-compatible
server on loopback (ours, in the test) and a local causal LM: verdicts and scores
parsed, an unparsable reply unscorable (never 0), replies cached, a failing server
retried and then unscorable, a silent one a timeout; the reward's workers build it
from reward.components."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from async_rl.config import build_config
from async_rl.rewards.judge import Judge, parse
from async_rl.rewards.outcome import Failed
from async_rl.rewards.pool import Call, RewardPool


class FakeJudgeServer(BaseHTTPRequestHandler):
    """POST /v1/chat/completions as OpenAI-compatible servers answer it, deciding by the question."""

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, request, self.headers.get("Authorization")))
        question = request["messages"][0]["content"]
        if "BUSY" in question and len(self.server.requests) <= 2:
            return self.send_error(503)
        if "SILENT" in question:
            self.server.release.wait(10)
        reply = "I cannot tell." if "GARBAGE" in question else \
            "Yes, it is." if question.split("Response: ")[1].startswith(question.split("answer: ")[1][:2]) else "No."
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}],
                           "usage": {"completion_tokens": 3}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudgeServer)
    httpd.requests, httpd.release = [], threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("reply, parser, score", [
    ("Yes.", "verdict", 1.0), ("no, 12 is wrong", "verdict", 0.0), ("Correct!", "verdict", 1.0),
    ("Score: 7/10", "score", 7.0), ("-0.5", "score", -0.5)])
def test_a_reply_is_read_as_its_parser_says(reply, parser, score):
    assert parse(reply, parser) == score


@pytest.mark.parametrize("reply, parser", [("Maybe yes.", "verdict"), ("", "verdict"), ("none at all", "score")])
def test_a_reply_without_a_verdict_or_a_score_is_unscorable(reply, parser):
    with pytest.raises(Failed, match="unparsable") as failed:
        parse(reply, parser)
    assert failed.value.reason == "not_a_number"


def test_a_server_judges_and_repeats_come_from_the_cache(server, monkeypatch):
    httpd, url = server
    judge = Judge(url=url, api_key="k3y")
    assert judge("7+5=", "12", "12") == 1.0 and judge("7+5=", "13", "12") == 0.0
    assert judge("7+5=", "12", "12") == 1.0 and len(httpd.requests) == 2  # the repeat was cached
    path, request, auth = httpd.requests[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k3y" and request["temperature"] == 0.0
    assert "Response: 12" in request["messages"][0]["content"] and judge.tokens == 6
    with pytest.raises(Failed, match="unparsable") as failed:
        judge("GARBAGE", "12", "12")
    assert failed.value.reason == "not_a_number"


def test_a_failing_server_is_retried_then_a_silent_or_absent_one_fails(server):
    httpd, url = server
    assert Judge(url=url, retries=3)("BUSY", "12", "12") == 1.0 and len(httpd.requests) == 3  # two 503s, then yes
    with pytest.raises(Failed) as silent:
        Judge(url=url, timeout_s=0.5)("SILENT", "12", "12")
    assert silent.value.reason == "timeout"
    httpd.release.set()
    with pytest.raises(Failed, match="unreachable") as absent:
        Judge(url="http://127.0.0.1:9", retries=1, timeout_s=2)("q", "12", "12")
    assert absent.value.reason == "raised"


def test_a_local_model_judges_in_the_process(demo_model):
    judge = Judge(model=demo_model, parser="score", max_tokens=4, template="{prompt}{response}=")
    try:
        value = judge("12+7=", "19", "19")
        assert isinstance(value, float)
    except Failed as failure:  # a tiny model may answer with no digit at all: unscorable, not 0
        assert failure.reason == "not_a_number"
    assert judge.calls == 1 and judge.tokens >= 1


def test_the_reward_workers_build_a_judge_from_the_components(server):
    httpd, url = server
    components = [{"name": "judge", "reward": "judge", "weight": 1.0, "judge": {"url": url}},
                  {"name": "exact", "reward": "task", "weight": 0.0}]
    with RewardPool({"name": "arithmetic"}, 0, processes=1, timeout_s=10, components=components) as pool:
        right, wrong, garbage = pool.score([Call("1+1=", "2", "2"), Call("1+1=", "3", "2"),
                                            Call("GARBAGE", "2", "2")])
    assert right.settle() == 1.0 and wrong.settle() == 0.0
    failed = garbage.settle()
    assert isinstance(failed, Failed) and failed.reason == "not_a_number" and "component judge" in str(failed)


def test_a_judge_is_a_server_or_a_model():
    served = build_config({"reward": {"components": [{"name": "j", "reward": "judge", "judge": {"url": "http://x"}}]}})
    assert served.reward.components[0].judge.parser == "verdict"
    local = build_config({"reward": {"components": [{"name": "j", "reward": "judge", "model": "m"}]}})
    assert local.reward.components[0].judge is None and local.reward.components[0].model == "m"
    with pytest.raises(Exception, match="a judge is a server"):
        build_config({"reward": {"components": [{"name": "j", "reward": "judge"}]}})
    with pytest.raises(Exception, match="`judge` is for `reward: judge`"):
        build_config({"reward": {"components": [{"name": "j", "reward": "task", "judge": {"url": "http://x"}}]}})


def test_the_judge_section_holds_the_judges_own_keywords_and_template():
    import inspect

    from async_rl.actor.config import JudgeConfig
    from async_rl.rewards.judge import DEFAULT_TEMPLATE

    section = JudgeConfig().model_dump()
    assert set(section) - {"api_key_env"} <= set(inspect.signature(Judge).parameters)
    assert section["template"] == DEFAULT_TEMPLATE
