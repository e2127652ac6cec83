"""The documented path for a tool task of a user's own (examples/shop/): its data, the
shop answering calls and scoring totals, then its commands as the docs give them,
demonstrations -> `async-rl sft` -> `async-rl train` with the shop environment, on the
tiny chat model (the measured run on SmolLM2 is in docs/environments.md)."""
import importlib.util
import json
import re
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env

from async_rl.tasks.base import Prompt

EXAMPLE = ROOT / "examples/shop"
spec = importlib.util.spec_from_file_location("shop", EXAMPLE / "shop.py")
shop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shop)


def test_the_shop_answers_a_call_with_the_price_and_scores_the_total():
    item = sorted(shop.KNOWN)[0]
    env = shop.make(Prompt(id=0, text="", answer="", fields={"item": item, "quantity": 3}))  # the row's columns
    turn = env.step(f"<price>{item}s</price>")  # named as the question names it
    assert turn.messages == [{"role": "user", "content": f"<result>{shop.price(item)}</result>"}] and not turn.done
    assert env.step("<price>nothing</price>").messages[0]["content"] == "<result>unknown item</result>"
    assert env.step(f"Total: {3 * shop.price(item)}").reward == 1.0
    other = shop.make(Prompt(id=0, text="", answer="", fields={"item": item, "quantity": 2}))
    assert other.step(f"Total: {3 * shop.price(item)}").reward == 0.0


def test_the_data_holds_out_items_and_demonstrates_the_call(tmp_path):
    shop.write(tmp_path, prompts=50, held_out=20, demos=10)
    rows = {name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("prompts.jsonl", "eval.jsonl", "demos.jsonl")}
    assert {r["item"] for r in rows["prompts.jsonl"]}.isdisjoint(r["item"] for r in rows["eval.jsonl"])
    for row in rows["prompts.jsonl"]:
        assert int(row["answer"]) == row["quantity"] * shop.price(row["item"])
    for demo in rows["demos.jsonl"]:
        call, result, answer = (m["content"] for m in demo["messages"][2:])
        item = call.removeprefix("<price>").removesuffix("s</price>")
        assert result == f"<result>{shop.price(item)}</result>"
        quantity, price, total, said = map(int, re.findall(r"\d+", answer))
        assert price == shop.price(item) and quantity * price == total == said


def test_demonstrations_then_rl_with_the_shop_as_documented(chat_model, tmp_path):
    shop.write(tmp_path / "data", prompts=64, held_out=16, demos=32)
    data = tmp_path / "data"
    common = [f"model.path={chat_model}", f"task.train_path={data / 'prompts.jsonl'}",
              f"task.eval_path={data / 'eval.jsonl'}", f"env.name={EXAMPLE / 'shop.py'}:make", "learner.threads=1"]
    config = str(EXAMPLE / "shop.yaml")
    sft = subprocess.run([sys.executable, "-m", "async_rl.cli", "sft", config, *common, f"run_dir={tmp_path / 'sft'}",
                          f"sft.data={data / 'demos.jsonl'}"], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(), cwd=tmp_path)
    assert sft.returncode == 0, sft.stderr[-3000:]
    model = tmp_path / "sft" / "model"
    common[0] = f"model.path={model}"
    rl = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", config, *common, f"run_dir={tmp_path / 'rl'}",
                         "train.max_steps=2", "train.batch_groups=4", "train.group_size=4",
                         "actors.groups_per_request=4", "eval.every=0", "eval.size=8"],
                        capture_output=True, text=True, timeout=180, env=subprocess_env(), cwd=tmp_path)
    assert rl.returncode == 0, rl.stderr[-3000:]
    steps, evals = read_metrics(tmp_path / "rl")
    assert [s["step"] for s in steps] == [1, 2] and evals
    assert all("env/turns_mean" in s for s in steps)
