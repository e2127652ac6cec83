"""reward.components in a real run: the task's reward trained on with a reward model
beside it (a learned source, scored in batches in the reward's workers), a listwise
scorer of each prompt's whole group, and a watcher of weight 0 that always fails; each
is logged on its own, and the watcher's failures leave every sample scorable; a
component that scores step by step trains grpo_process; a judge that answers garbage
stops the run in one line, its samples unscorable, never trained on as 0."""
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import ROOT, read_metrics, subprocess_env, train

WATCHER = """def judge(prompt, response, answer):
    raise RuntimeError("the judge is down")


def shortest(prompt, responses, answer):
    return [float(len(r) == min(map(len, responses))) for r in responses]
"""


def test_a_run_trains_on_weighted_components_and_logs_each(tmp_path, demo_model, reward_model_dir):
    watcher = tmp_path / "watcher.py"
    watcher.write_text(WATCHER)
    run = tmp_path / "run"
    components = (f"reward.components=[{{name: exact, reward: task}}, "
                  f"{{name: rm, reward: reward_model, model: {reward_model_dir}, weight: 0.1}}, "
                  f"{{name: judge, reward: '{watcher}:judge', weight: 0}}, "
                  f"{{name: shortest, reward: '{watcher}:shortest', weight: 0.1, scope: group}}]")
    train(run, demo_model, "train.max_steps=2", "eval.every=0", components)
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["reward/exact/error_frac"] == 0.0 and step["reward/rm/error_frac"] == 0.0
        assert step["reward/rm/latency_p50_ms"] > 0 and "reward/rm/mean" in step
        assert step["reward/judge/error_frac"] == 1.0 and step["reward/judge/errors_raised"] == 32
        assert step["reward/judge/unscorable_frac"] == 0.0 and step["reward/unscorable_frac"] == 0.0
        assert step["reward/errors"] == 0  # a watcher's failures are its own, not the sample's
        assert step["reward/shortest/error_frac"] == 0.0 and 0 < step["reward/shortest/mean"] <= 1


PROCESS = """from async_rl.rewards import StepRewards


def digits(prompt, response, answer):
    # A step per character; a digit of the answer is worth 1.
    return StepRewards([(i + 1, float(c in answer)) for i, c in enumerate(response)] or [(1, 0.0)], value=0.0)
"""


def test_a_component_that_scores_step_by_step_trains_grpo_process(tmp_path, demo_model):
    process = tmp_path / "process.py"
    process.write_text(PROCESS)
    run = tmp_path / "run"
    proc = train(run, demo_model, "train.max_steps=2", "eval.every=0", "train.advantage.name=grpo_process",
          "metrics.samples_every=1", f"reward.components=[{{name: exact, reward: task}}, "
                                     f"{{name: digits, reward: '{process}:digits', weight: 0.5}}]")
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["reward/steps_mean"] >= 1 and s["reward/digits/error_frac"] == 0.0 for s in steps)
    dumped = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for sample in dumped:
        assert sample["step_ends"] and len(sample["step_ends"]) == len(sample["step_rewards"])
        assert sample["step_ends"][-1] == len(sample["response_ids"]) - 1  # the task's reward: the last token
    logs = proc.stderr + "".join(log.read_text() for log in (run / "logs").glob("*"))
    assert "leaves unused" not in logs and "step rewards" not in logs


class GarbageJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose every reply is no verdict."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "As an AI, I cannot say."}}]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_a_judge_that_answers_garbage_stops_the_run_naming_it_and_trains_on_no_zero(tmp_path, demo_model):
    server = ThreadingHTTPServer(("127.0.0.1", 0), GarbageJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run = tmp_path / "run"
    try:
        cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
               f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4",
               "actors.groups_per_request=4", "task.eval_size=32", "train.max_steps=5", "eval.every=0",
               f"reward.components=[{{name: judge, reward: judge, judge: {{url: 'http://127.0.0.1:"
               f"{server.server_address[1]}/v1'}}}}, {{name: exact, reward: task, weight: 0}}]"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=subprocess_env())
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 4, proc.stderr[-3000:]
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("async-rl: stopped:")]
    assert len(stopped) == 1 and "component judge" in stopped[0] and "unparsable" in stopped[0], stopped
    steps, _ = read_metrics(run)
    assert steps[0]["reward/unscorable_frac"] == 1.0 and steps[0]["reward/judge/errors_not_a_number"] == 32
    assert steps[0]["reward/groups_dropped"] == 8  # every group left out: nothing trained on as 0
