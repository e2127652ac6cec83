"""task.name=dataset: Hugging Face datasets written by the `datasets` library itself, in
each format it saves, with the prompt and answer in columns of any name; every other
column reaches the environment (`prompt.fields`) and the reward that names it."""
import json

import pytest

from async_rl.tasks import make_task
from async_rl.tasks.base import EVAL_ID_OFFSET
from async_rl.tasks.rows import with_fields

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"{a}+3=", "solution": str(a + 3), "db_id": f"db{a % 3}", "extra_info": {"level": a % 2}}
        for a in range(10, 30)]


def written(tmp_path, kind):
    data = datasets.Dataset.from_list(ROWS)
    if kind == "save_to_disk":
        path = tmp_path / "folder"
        datasets.DatasetDict({"train": data, "test": data.select(range(4))}).save_to_disk(str(path))
        return path
    path = tmp_path / f"rows.{kind}"
    {"parquet": data.to_parquet, "csv": data.to_csv, "jsonl": data.to_json}[kind](str(path))
    return path


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "save_to_disk"])
def test_any_format_with_other_column_names_and_its_fields(tmp_path, kind):
    task = make_task("dataset", seed=0, path=written(tmp_path, kind), prompt_column="question",
                     answer_column="solution", reward="exact_match")
    prompts = [task.train_prompt(i) for i in range(task.num_train)]
    held = task.eval_prompts()
    assert len(prompts) == 18 and len(held) == 2 and held[0].id == EVAL_ID_OFFSET
    assert {p.text for p in prompts} | {p.text for p in held} == {r["question"] for r in ROWS}
    row = next(r for r in ROWS if r["question"] == prompts[0].text)
    assert prompts[0].answer == row["solution"]
    assert prompts[0].fields == {"db_id": row["db_id"], "extra_info": row["extra_info"]}
    assert task.reward(prompts[0].text, row["solution"], prompts[0].answer, **prompts[0].fields) == 1.0


def test_a_csv_file_and_a_named_held_out_split(tmp_path):
    task = make_task("dataset", seed=0, path=written(tmp_path, "csv"), prompt_column="question",
                     answer_column="solution", reward="exact_match")
    assert task.train_prompt(0).fields.keys() == {"db_id", "extra_info"}  # csv keeps the dict as its text
    folder = written(tmp_path, "save_to_disk")
    task = make_task("dataset", seed=0, path=folder, prompt_column="question", answer_column="solution",
                     eval_split="test", reward="exact_match")
    assert task.num_train == 20 and [p.text for p in task.eval_prompts()] == [r["question"] for r in ROWS[:4]]


def test_chat_prompts_and_no_answer_where_the_environment_scores(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{k}"}],
             "db_id": k} for k in range(10)]
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    task = make_task("dataset", seed=0, path=path, prompt_column="messages", reward=None)
    prompt = task.train_prompt(0)
    assert prompt.messages[0] == ("system", "Be brief.") and prompt.text == prompt.messages[-1][1]
    assert prompt.answer == "" and set(prompt.fields) == {"db_id"}
    with pytest.raises(RuntimeError, match="scored by the environment"):
        task.reward(prompt.text, "x", "")


@pytest.mark.parametrize(("change", "needle"), [
    ({"path": "nowhere.parquet"}, "nowhere.parquet: no such file or folder"),
    ({"prompt_column": "prompt"}, "no column 'prompt' (task.prompt_column); it has db_id, extra_info, question, "
                                  "solution"),
    ({"answer_column": "answer"}, "no column 'answer' (task.answer_column)"),
    ({"split": "validation", "kind": "save_to_disk"}, "no split 'validation' (it has train, test)"),
])
def test_bad_paths_columns_and_splits_are_one_line(tmp_path, change, needle):
    kind = change.pop("kind", "parquet")
    options = {"path": written(tmp_path, kind), "prompt_column": "question", "answer_column": "solution",
               "reward": "exact_match", **change}
    with pytest.raises(ValueError) as err:
        make_task("dataset", seed=0, **options)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_empty_split_and_an_unknown_format(tmp_path):
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(empty))
    with pytest.raises(ValueError, match="no rows"):
        make_task("dataset", seed=0, path=empty, prompt_column="question", answer_column="solution",
                  reward="exact_match")
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError, match="must end in .parquet"):
        make_task("dataset", seed=0, path=tmp_path / "rows.txt")


def test_a_jsonl_lines_other_keys_are_its_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{k}+1=", "answer": str(k + 1), "db_id": k}) + "\n"
                            for k in range(10)))
    task = make_task("jsonl", seed=0, path=path, reward="exact_match")
    prompt = task.train_prompt(0)
    assert prompt.fields == {"db_id": int(prompt.text.split("+")[0])}


def test_a_reward_gets_the_fields_it_names_or_all_with_kwargs():
    def names_one(prompt, response, answer, db_id):
        return float(db_id == "db1")

    def takes_all(prompt, response, answer, **fields):
        return float(len(fields))

    def takes_three(prompt, response, answer):
        return 0.5

    fields = {"db_id": "db1", "extra_info": {}}
    assert with_fields(names_one)("p", "r", "a", **fields) == 1.0
    assert with_fields(takes_all)("p", "r", "a", **fields) == 2.0
    assert with_fields(takes_three)("p", "r", "a", **fields) == 0.5
