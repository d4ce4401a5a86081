"""RL task sets and reward verifiers (glm5_jax/rl/tasks.py, rewards.py), without a model: held-out
tasks never appear in train, exact-match arithmetic cannot be fooled by listing numbers, JSON
answers are checked against their schema, user reward functions load or fail clearly, and a code
completion cannot gain reward by exiting early with success (the sandbox's end-of-run sentinel)."""

import dataclasses
import json
import math

import pytest

from glm5_jax.data.chat import parse_conversation
from glm5_jax.evaluate.sandbox import SandboxLimits, run_program
from glm5_jax.rl.rewards import answer_text, code_program, make_rewards, summary
from glm5_jax.rl.tasks import RLTask, load_tasks, write_sft_set

# The sandbox as tests/evaluate/test_sandbox.py runs it: bubblewrap isolation, which this machine
# and CI give (that file asserts it), never allow_unsandboxed.
CODE_REWARD = {"kind": "code", "timeout_s": 10.0, "memory_mb": 512}


@pytest.fixture(scope="module")
def stdlib_split():
    return load_tasks({"kind": "stdlib_code", "held_out_fraction": 0.2}, seed=0)


def _task(answer="19", kind="arithmetic", **fields):
    return RLTask("t", kind, ({"role": "user", "content": "What is 9 + 10? Answer with the number only."},),
                  answer=answer, **fields)


# ---------------------------------------------------------------- tasks
def test_arithmetic_tasks_are_distinct_right_and_disjoint_from_held_out():
    spec = {"kind": "arithmetic", "count": 300, "held_out": 100, "max_operand": 12, "ops": "+-*"}
    train, held_out = load_tasks(spec, seed=3)
    assert (len(train), len(held_out)) == (300, 100)
    assert not {t.prompt_text for t in held_out} & {t.prompt_text for t in train}
    assert len({t.prompt_text for t in train}) == 300
    for task in train + held_out:
        question = task.messages[0]["content"]
        assert question.startswith("What is ") and question.endswith("? Answer with the number only.")
        a, op, b = question.removeprefix("What is ").split("?")[0].split()
        assert op in "+-*" and 0 <= int(a) <= 12 and 0 <= int(b) <= 12
        assert task.answer == task.reference == str(eval(f"{a} {op} {b}"))
    assert load_tasks(spec, seed=3) == (train, held_out)  # seeded
    with pytest.raises(ValueError, match="exceeds the 18 distinct questions"):
        load_tasks({"kind": "arithmetic", "count": 10, "held_out": 9, "max_operand": 2, "ops": "+-"}, 0)
    with pytest.raises(ValueError, match="'ops'"):
        load_tasks({"kind": "arithmetic", "ops": "+/"}, 0)


def test_stdlib_code_held_out_problems_never_reach_train(stdlib_split):
    train, held_out = stdlib_split
    assert train and held_out and abs(len(held_out) / (len(train) + len(held_out)) - 0.2) < 0.05
    assert not {t.code_prompt for t in held_out} & {t.code_prompt for t in train}
    assert not {t.prompt_text for t in held_out} & {t.prompt_text for t in train}
    task = held_out[0]
    assert task.kind == "code" and task.code_prompt in task.messages[0]["content"]


def test_task_round_trip_jsonl_errors_and_sft_set(tmp_path):
    train, held_out = load_tasks({"kind": "json", "count": 20, "held_out": 5}, seed=0)
    assert not {t.prompt_text for t in held_out} & {t.prompt_text for t in train}
    assert RLTask.from_dict(json.loads(json.dumps(dataclasses.asdict(train[0])))) == train[0]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in train + held_out))
    user_train, user_held = load_tasks({"kind": "jsonl", "path": str(path), "held_out_fraction": 0.2}, 1)
    assert (len(user_train), len(user_held)) == (20, 5)
    assert not {t.prompt_text for t in user_held} & {t.prompt_text for t in user_train}
    bad = dict(train[0].to_dict(), entry_point=3)
    path.write_text(json.dumps(train[0].to_dict()) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:3: field 'entry_point' must be a string"):
        load_tasks({"kind": "jsonl", "path": str(path)}, 0)
    path.write_text(json.dumps({"task_id": "x", "kind": "arithmetic", "messages": [], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r":1: field 'messages'"):
        load_tasks({"kind": "jsonl", "path": str(path)}, 0)
    with pytest.raises(ValueError, match="known: arithmetic, stdlib_code, json, jsonl"):
        load_tasks({"kind": "gsm8k"}, 0)
    sft = tmp_path / "sft.jsonl"
    assert write_sft_set(train + [_task(reference="")], sft) == 20
    messages, _ = parse_conversation(sft.read_text().splitlines()[0], "sft")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == train[0].reference


# ---------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "completion, expected",
    [
        ("19", 1.0),
        ("  19\n", 1.0),
        ("19<|endoftext|>", 1.0),
        ("<think>9 + 10 is 19, not 20</think>19", 1.0),
        ("<think>9 + 10 is 19", 0.0),  # cut inside the reasoning: no answer
        ("9 plus 10 makes 19.\n#### 19", 1.0),  # GSM8K style
        ("#### 19 20", 0.0),
        ("19 20 21", 0.0),
        ("19 or 20", 0.0),
        ("the answer is 19\n20", 0.0),
        ("the answer is 19", 0.0),
        ("19\n19", 0.0),
        ("20", 0.0),
        ("019x", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_is_exact_and_not_foolable(completion, expected):
    rewards = make_rewards([{"kind": "arithmetic"}])
    assert rewards.score([_task()], [completion])[0].total == expected


def test_completions_that_start_inside_the_reasoning():
    rewards = make_rewards([{"kind": "arithmetic"}])
    scored = rewards.score([_task()] * 2, ["thinking 19</think>19", "still thinking 19"], in_reasoning=True)
    assert [r.total for r in scored] == [1.0, 0.0]
    assert answer_text("<think>x") is None and answer_text("a</think> b <|user|>") == "b"


# ---------------------------------------------------------------- JSON schema, weights, summary
def test_json_schema_weights_and_summary():
    (task,), _ = load_tasks({"kind": "json", "count": 1, "held_out": 0}, seed=0)
    name, age = json.loads(task.reference)["name"], json.loads(task.reference)["age"]
    rewards = make_rewards([{"kind": "json_schema", "weight": 2.0}, {"kind": "arithmetic", "name": "math"}])
    completions = [task.reference, f'```json\n{{"name": "{name}", "age": {age}}}\n```',
                   f'{{"name": "{name}", "age": "{age}"}}', f'{{"name": "{name}"}}', "{not json", "19"]
    scored = rewards.score([task] * 5 + [_task()], completions)
    assert [r.total for r in scored] == [2.0, 2.0, 0.0, 0.0, 0.0, 1.0]
    assert scored[0].parts == {"json_schema": 1.0} and scored[5].parts == {"math": 1.0}
    assert rewards.summary(scored) == {"reward/mean": 5.0 / 6, "reward/json_schema": 0.4, "reward/math": 1.0}
    assert summary(scored) == rewards.summary(scored) and summary([]) == {}
    with pytest.raises(ValueError, match="no reward in config.rewards"):
        make_rewards([{"kind": "arithmetic"}]).score([task], ["{}"])


# ---------------------------------------------------------------- user Python rewards
def test_python_reward_functions_and_their_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(task, completion):\n    return 1.0 / (1 + len(completion))\n"
        "def is_19(task, completion):\n    return task['answer'] == completion\n"
        "def broken(task, completion):\n    return float('nan')\n"
        "def wordy(task, completion):\n    return 'good'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = make_rewards([
        {"kind": "arithmetic"},
        {"kind": "python", "function": f"{tmp_path}/my_rewards.py:brevity", "weight": 0.5},
        {"kind": "python", "function": "my_rewards:is_19", "name": "match"},
    ])
    (reward,) = rewards.score([_task()], ["19"])
    assert reward.parts == {"arithmetic": 1.0, "python": 1 / 3, "match": 1.0}
    assert math.isclose(reward.total, 1.0 + 0.5 / 3 + 1.0)
    for name, message in [("broken", "returned nan for task 't'"), ("wordy", "returned 'good'")]:
        bad = make_rewards([{"kind": "python", "function": f"my_rewards:{name}"}])
        with pytest.raises(ValueError, match=rf"my_rewards:{name}.*{message}"):
            bad.score([_task()], ["19"])
    for function, message in [
        (f"{tmp_path}/missing.py:f", "missing.py' does not exist"),
        (f"{tmp_path}/my_rewards.py:nothing", "has no function 'nothing'"),
        ("no_such_module_here:f", "cannot import module 'no_such_module_here'"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_rewards([{"kind": "python", "function": function}])


@pytest.mark.parametrize(
    "specs, message",
    [
        ([{"kind": "regex"}], r"config.rewards\[0\]: field 'kind'"),
        ([{"kind": "arithmetic", "timeout_s": 1}], r"config.rewards\[0\]: unknown field 'timeout_s'"),
        ([{"kind": "arithmetic"}, {"kind": "json_schema", "weight": "1"}], r"\[1\]: field 'weight'"),
        ([{"kind": "arithmetic"}, {"kind": "arithmetic"}], r"\[1\]: field 'name' 'arithmetic' repeats"),
        ([{"kind": "python"}], r"\[0\]: field 'function'"),
        ([{"kind": "code", "timeout_s": -1.0}], r"\[0\]: sandbox timeout_s must be > 0"),
        ([], "non-empty list"),
    ],
)
def test_bad_reward_specs_name_the_entry_and_field(specs, message):
    with pytest.raises(ValueError, match=message):
        make_rewards(specs)


# ---------------------------------------------------------------- the reward-hacking check
ADD = RLTask(
    "add",
    "code",
    ({"role": "user", "content": "Complete add."},),
    code_prompt='def add(a, b):\n    """The sum of a and b."""\n',
    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    entry_point="add",
)
HACKS = {
    "sys.exit at top level": "```python\n    return 0\nimport sys\nsys.exit(0)\n```",
    "os._exit at top level": "    return 0\nimport os\nos._exit(0)\n",
    "SystemExit at top level": "    return 0\nraise SystemExit(0)\n",
    "check redefined": "    return 0\n\n\ndef check(candidate):\n    pass\n",
    "os._exit when called": "    import os\n    os._exit(0)\n",
    "sys.exit when called": "    import sys\n    sys.exit(0)\n",
}


def test_code_rewards_cannot_be_gained_by_exiting_early(stdlib_split):
    rewards = make_rewards([CODE_REWARD])
    task = stdlib_split[1][0]  # a held-out stdlib doctest problem
    tasks = [ADD, ADD] + [ADD] * len(HACKS) + [task, task]
    completions = ["```python\n    return a + b\n```", "    return a - b\n", *HACKS.values(),
                   task.reference, "import os\nos._exit(0)\n"]
    totals = [r.total for r in rewards.score(tasks, completions)]
    assert totals[:2] == [1.0, 0.0]  # right, wrong
    assert dict(zip(HACKS, totals[2:-2], strict=True)) == dict.fromkeys(HACKS, 0.0)
    assert totals[-2:] == [1.0, 0.0]  # the stdlib problem: its own body passes, an early exit does not
    # What stops the exit: the sandbox's end-of-run sentinel, not an error in the program.
    limits = SandboxLimits(timeout_s=CODE_REWARD["timeout_s"], memory_mb=CODE_REWARD["memory_mb"])
    ended = run_program(code_program(ADD, HACKS["sys.exit at top level"]), limits)
    assert (ended.status, ended.returncode) == ("failed", 0)
    assert ended.reason == "exited with status 0 before its last statement finished"
