"""Tasks (arithmetic, JSONL, reward specs) and the built-in demo model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_rl.tasks import (
    EVAL_ID_OFFSET,
    ArithmeticTask,
    JsonlTask,
    Prompt,
    Task,
    exact_match,
    is_eval_id,
    load_reward_fn,
    make_task,
)


def _pair(p: Prompt) -> tuple[int, int]:
    a, b = p.text.rstrip("=").split("+")
    return int(a), int(b)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_prompts_are_well_formed_and_deterministic() -> None:
    task = make_task("arithmetic", seed=3)
    assert isinstance(task, Task)
    first = [task.train_prompt(i) for i in range(200)]
    again = ArithmeticTask(seed=3)
    # Random access in any order gives the same prompt: the cursor is just an int.
    assert [again.train_prompt(i) for i in reversed(range(200))][::-1] == first
    for i, p in enumerate(first):
        a, b = _pair(p)
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert p.answer == str(a + b) and p.id == i and not is_eval_id(p.id)
    other = [ArithmeticTask(seed=4).train_prompt(i) for i in range(200)]
    assert other != first


def test_arithmetic_eval_is_fixed_and_disjoint_from_training() -> None:
    task = ArithmeticTask(seed=0)
    evals = task.eval_prompts()
    assert len(evals) == 256 and len({p.text for p in evals}) == 256
    assert all(is_eval_id(p.id) for p in evals)
    assert [p.id for p in evals] == [EVAL_ID_OFFSET + k for k in range(256)]
    # The eval set does not depend on the run seed: runs are scored alike.
    assert ArithmeticTask(seed=7).eval_prompts() == evals
    held = {_pair(p) for p in evals}
    held |= {(b, a) for a, b in held}  # neither order may be trained on
    trained = {_pair(task.train_prompt(i)) for i in range(20_000)}
    assert not trained & held
    assert len(trained) > 6_000  # the generator covers the space, not a corner


def test_arithmetic_options_and_errors() -> None:
    one = ArithmeticTask(seed=0, digits=1, eval_size=10)
    assert all(len(p.text) == 4 for p in one.eval_prompts())
    assert ArithmeticTask(seed=0, digits=3, eval_size=5).train_prompt(0).text.count("+") == 1
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(seed=0, digits=0)
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(seed=0, digits=1)  # 256 eval pairs out of 100 is impossible
    with pytest.raises(IndexError):
        ArithmeticTask(seed=0).train_prompt(-1)


def test_exact_match_reward() -> None:
    task = ArithmeticTask(seed=0)
    assert task.reward("37+45=", "82", "82") == 1.0
    assert task.reward("37+45=", " 82\n", "82") == 1.0
    assert task.reward("37+45=", "83", "82") == 0.0
    assert task.reward("37+45=", "820", "82") == 0.0
    assert task.reward("37+45=", "", "82") == 0.0
    assert exact_match("p", "x", "x") == 1.0


# ---------------------------------------------------------------- reward specs


def test_load_reward_fn() -> None:
    fn = load_reward_fn("async_rl.tasks.arithmetic:exact_match")
    assert fn is exact_match
    for spec, needle in [
        ("no_colon_here", "module:function"),
        ("a:b:c", "no module named 'a:b'"),
        (":exact_match", "module:function"),
        ("async_rl.no_such_module:f", "no module named 'async_rl.no_such_module'"),
        ("async_rl.tasks.arithmetic:no_such_fn", "no attribute"),
        ("async_rl.tasks.base:EVAL_ID_OFFSET", "not callable"),
    ]:
        with pytest.raises(ValueError, match=needle):
            load_reward_fn(spec)


def test_make_task_errors() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess", seed=0)
    with pytest.raises(ValueError, match="arithmetic"):
        make_task("arithmetic", seed=0, colour="blue")


# ---------------------------------------------------------------- JSONL


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _rows(n: int) -> list[object]:
    return [{"prompt": f"q{i}", "answer": f"a{i}", "extra": i} for i in range(n)]


def test_jsonl_holdout_epochs_and_determinism(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.jsonl", _rows(40))
    task = make_task("jsonl", seed=1, path=str(path), eval_fraction=0.25)
    assert isinstance(task, JsonlTask) and task.num_train == 30
    evals = task.eval_prompts()
    assert len(evals) == 10 and all(is_eval_id(p.id) for p in evals)
    epoch0 = [task.train_prompt(i) for i in range(30)]
    epoch1 = [task.train_prompt(i) for i in range(30, 60)]
    # Each epoch visits every training row once, in a new order.
    assert len({p.text for p in epoch0}) == 30 and {p.text for p in epoch0} == {p.text for p in epoch1}
    assert [p.text for p in epoch0] != [p.text for p in epoch1]
    assert not {p.text for p in epoch0} & {p.text for p in evals}
    assert all(p.answer == "a" + p.text[1:] for p in epoch0 + evals)
    # Same seed: same prompts, even when read backwards (resume from a cursor).
    again = JsonlTask(seed=1, path=path, eval_fraction=0.25)
    assert [again.train_prompt(i) for i in reversed(range(60))][::-1] == epoch0 + epoch1
    assert again.eval_prompts() == evals
    # Another seed reorders training but keeps the held-out set.
    other = JsonlTask(seed=2, path=path, eval_fraction=0.25)
    assert other.eval_prompts() == evals
    assert [other.train_prompt(i).text for i in range(30)] != [p.text for p in epoch0]


def test_jsonl_eval_file_and_custom_reward(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.jsonl", [*_rows(5), "", {"prompt": "n", "answer": 7}])
    held = _write(tmp_path / "eval.jsonl", [{"prompt": "e", "answer": "x"}])
    task = JsonlTask(seed=0, path=train, eval_path=held, reward="async_rl.tasks.arithmetic:exact_match")
    assert task.num_train == 6  # blank line skipped; numeric answer kept as text
    assert [p.text for p in task.eval_prompts()] == ["e"]
    assert {task.train_prompt(i).answer for i in range(6)} >= {"7"}
    assert task.reward("q", " x ", "x") == 1.0 and task.reward("q", "y", "x") == 0.0
    calls = []
    lenient = JsonlTask(seed=0, path=train, eval_path=held, reward=lambda p, r, a: calls.append(p) or 0.5)
    assert lenient.reward("q", "r", "a") == 0.5 and calls == ["q"]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        ('["prompt", "answer"]', "JSON object"),
        ('{"answer": "1"}', "'prompt'"),
        ('{"prompt": "", "answer": "1"}', "'prompt'"),
        ('{"prompt": "p"}', "'answer'"),
        ('{"prompt": "p", "answer": true}', "'answer'"),
        ('{"messages": [], "answer": "1"}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "hi"}], "answer": "1"}', "messages\\[0\\] must be"),
        ('{"messages": [{"role": "user", "content": 3}], "answer": "1"}', "messages\\[0\\] must be"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"}',
         "last message must be the user's turn"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [*_rows(3), line, *_rows(2)])
    with pytest.raises(ValueError, match=needle) as info:
        JsonlTask(seed=0, path=path)
    assert f"{path}:4:" in str(info.value)


def test_jsonl_chat_rows(tmp_path: Path) -> None:
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    path = _write(tmp_path / "chat.jsonl", [{"messages": turns, "answer": "4"}, {"prompt": "plain", "answer": "5"}])
    task = JsonlTask(seed=0, path=path, eval_path=path)
    chat, plain = task.eval_prompts()
    # A conversation keeps its turns for the template; its text (what rewards get) is the last user turn.
    assert chat.messages == (("system", "Be brief."), ("user", "What is 2+2?")) and chat.text == "What is 2+2?"
    assert plain.messages is None and plain.text == "plain" and plain.answer == "5"


def test_jsonl_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        JsonlTask(seed=0, path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        JsonlTask(seed=0, path=_write(tmp_path / "empty.jsonl", [""]))
    one = _write(tmp_path / "one.jsonl", _rows(1))
    with pytest.raises(ValueError, match="too few"):
        JsonlTask(seed=0, path=one)
    with pytest.raises(ValueError, match="eval_fraction"):
        JsonlTask(seed=0, path=_write(tmp_path / "ten.jsonl", _rows(10)), eval_fraction=1.5)
    with pytest.raises(ValueError, match="no attribute"):
        JsonlTask(seed=0, path=one, eval_path=one, reward="async_rl.tasks.arithmetic:nope")


# ---------------------------------------------------------------- demo model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from async_rl.models.demo import build_demo_model

    # Seed 1 is among the quicker warm starts measured (~300 steps).
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model", seed=1)


@pytest.mark.integration  # a real warm start (~300 steps): the integration tier
def test_demo_model_loads_and_tokenizes(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"]:
        assert (demo_dir / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert len(tok) == 16 and model.config.vocab_size == 16
    assert 120_000 < sum(p.numel() for p in model.parameters()) < 140_000
    ids = tok("37+45=82")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 9
    assert tok.decode(ids, skip_special_tokens=True) == "37+45=82"
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    # transformers' own generate() works with the saved generation config.
    out = model.generate(torch.tensor([ids[:7]]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= 11


@pytest.mark.integration  # a real warm start (~300 steps): the integration tier
def test_demo_model_warm_start_accuracy(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rl.models.demo import answer_statistics, greedy_accuracy

    model = AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    tok = AutoTokenizer.from_pretrained(demo_dir)
    task = ArithmeticTask(seed=1)
    evals = task.eval_prompts()
    accuracy = greedy_accuracy(model, tok, task, evals)
    assert 0.1 <= accuracy <= 0.5
    exact, p_correct = answer_statistics(model, tok, evals)
    # The one-pass shortcut agrees with real greedy decoding for exact match.
    assert exact.float().mean().item() == pytest.approx(accuracy)
    # Not confidently wrong: most prompts have a real chance of a right sample.
    assert (p_correct > 0.05).float().mean().item() > 0.5
    info = json.loads((demo_dir / "async_rl_demo.json").read_text())
    assert info["eval_accuracy"] == pytest.approx(accuracy)


def test_demo_warm_start_is_deterministic(tmp_path: Path) -> None:
    from async_rl.models.demo import build_demo_model

    # A target of 0 stops at the first check: cheap, yet covers init + training.
    kwargs = dict(seed=5, target_accuracy=0.0, min_mixed_fraction=0.0, check_every=3)
    a = build_demo_model(tmp_path / "a", **kwargs)
    b = build_demo_model(tmp_path / "b", **kwargs)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = build_demo_model(tmp_path / "c", **{**kwargs, "seed": 6})
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
