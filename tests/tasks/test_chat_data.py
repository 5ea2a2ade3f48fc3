"""Issue #43: chat-format data as verl, TRL and NeMo-RL read it. A prompt that is a list of
{role, content} messages is kept as a chat (system turns included) for the tokenizer's chat
template; anything else that is not prompt text is refused naming the file, the line and the
key, never turned into text with str(); an answer that is not text reaches the reward as its
JSON text; examples keep their source line through every saved state."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_rl.rollout.batches import Rollouts
from mcore_rl.rollout.engine import Completion
from mcore_rl.tasks.base import Example, Message
from mcore_rl.tasks.jsonl import DatasetError, JsonlTask, read_jsonl
from mcore_rl.tasks.tokenizer import encode_prompts, prompt_texts

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

SYSTEM = {"role": "system", "content": "Answer with the number only."}
USER = {"role": "user", "content": "2+2?"}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_messages_prompt_is_a_chat_with_its_system_turn(tmp_path):
    data = _write(tmp_path / "chat.jsonl", [{"messages": [SYSTEM, USER], "answer": "4"},
                                            {"messages": "plain text", "answer": "5"}])
    chat, text = read_jsonl(data, "messages", "answer")
    assert chat.prompt == (Message("system", "Answer with the number only."),
                           Message("user", "2+2?"))
    assert text.prompt == "plain text"
    assert (chat.source, text.source) == (f"{data}:1", f"{data}:2")


GOOD = {"messages": [SYSTEM, USER], "answer": "4"}


@pytest.mark.parametrize("prompt,problem", [
    (None, "'messages' is null: expected the prompt text or a list of chat messages"),
    ("", "'messages' is empty text"),
    ("  \n\t", "'messages' is blank text"),
    (42, "'messages' is a number (42)"),
    (True, "'messages' is a boolean (true)"),
    ({"role": "user", "content": "hi"}, "'messages' is an object"),
    ([], "'messages' is an empty list"),
    (["hi"], "'messages' message 0 is a str, not an object with \"role\" and \"content\""),
    ([SYSTEM, {"content": "hi"}], "'messages' message 1 has no 'role'"),
    ([{"role": "user"}], "'messages' message 0 has no 'content'"),
    ([{"role": "human", "content": "hi"}], "message 0 has role 'human': expected one of "
                                           "system, user, assistant, tool"),
    ([{"role": "user", "content": ["hi"]}], "message 0 (user) has content that is a list: "
                                            "expected text"),
    ([{"role": "user", "content": None}], "message 0 (user) has content that is null"),
    ([{"role": "user", "content": " "}], "message 0 (user) has blank content"),
    ([{"role": "user", "content": "hi", "name": "x"}], "message 0 has keys other than 'role' "
                                                       "and 'content' (name)"),
    ([SYSTEM], "'messages' has no user message"),
    ([USER, {"role": "assistant", "content": "4"}], "ends with the assistant's message"),
])
def test_a_prompt_that_is_no_text_and_no_chat_is_refused_naming_the_line(tmp_path, prompt,
                                                                        problem):
    data = _write(tmp_path / "bad.jsonl", [GOOD, {"messages": prompt, "answer": "4"}])
    with pytest.raises(DatasetError) as err:
        JsonlTask(data, prompt_key="messages")
    assert str(err.value).startswith(f"{data}:2: ")
    assert problem in str(err.value)
    assert err.value.key == "messages" and "\n" not in str(err.value)


def test_a_multi_turn_task_refuses_a_chat_prompt(tmp_path):
    data = _write(tmp_path / "chat.jsonl", [{"messages": "text", "answer": "1"}, GOOD])
    with pytest.raises(DatasetError, match=f"{data}:2: 'messages' is a list of chat messages, "
                                           r"but a multi-turn task \(task.env\)"):
        JsonlTask(data, prompt_key="messages", chats=False)


@pytest.mark.parametrize("answer,text", [
    (7, "7"), (2.5, "2.5"), (False, "false"), (["a", "b"], '["a", "b"]'),
    ({"x": 1, "unit": "km"}, '{"x": 1, "unit": "km"}'), ("été", "été"), ("", ""),
])
def test_an_answer_that_is_not_text_is_its_json_text(tmp_path, answer, text):
    data = _write(tmp_path / "a.jsonl", [{"question": "q", "answer": answer}])
    (example,) = read_jsonl(data, "question", "answer")
    assert example.answer == text
    if not isinstance(answer, str):
        assert json.loads(example.answer) == answer


def test_a_null_answer_is_refused_naming_the_line(tmp_path):
    data = _write(tmp_path / "a.jsonl", [{"question": "q", "answer": "1"},
                                         {"question": "q", "answer": None}])
    with pytest.raises(DatasetError, match=f"{data}:2: 'answer' is null") as err:
        read_jsonl(data, "question", "answer")
    assert err.value.key == "answer"


def test_examples_round_trip_through_every_saved_state(tmp_path):
    """Chats and sources survive the off-policy buffer (`Rollouts.to_state`) and the partial
    rollouts' examples (`Example.to_state`) through torch.save / load(weights_only=True); an
    earlier checkpoint's [prompt, answer] pairs still load."""
    data = _write(tmp_path / "chat.jsonl", [GOOD, {"messages": "text", "answer": [1]}])
    examples = read_jsonl(data, "messages", "answer")
    rollouts = Rollouts(step=3, examples=examples, prompt_ids=[[1, 2], [3]],
                        completions=[[Completion((5,), (-0.5,), "stop")]] * 2,
                        scores=[[1.0], [0.0]], stats={"reward/errors": 0.0})
    torch.save({"r": rollouts.to_state(), "e": [e.to_state() for e in examples]},
               tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    back = Rollouts.from_state(saved["r"]).examples
    again = [Example.from_state(e) for e in saved["e"]]
    for restored in (back, again):
        assert restored == examples
        assert [e.source for e in restored] == [f"{data}:1", f"{data}:2"]
        assert isinstance(restored[0].prompt, tuple) and restored[1].answer == "[1]"
    old = dict(saved["r"], prompts=["p", "q"], answers=["a", "b"])
    del old["sources"]
    assert Rollouts.from_state(old).examples == [Example("p", "a"), Example("q", "b")]
    assert Example.from_state(["p", "a"]) == Example("p", "a")


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory):
    """The addition task's sentencepiece tokenizer (adds BOS to text) with a template that
    writes BOS itself, as Llama 3's does."""
    from mcore_rl.tasks.tokenizer import build_tokenizer_dir, load_tokenizer

    tok = load_tokenizer(build_tokenizer_dir(tmp_path_factory.mktemp("tok")))
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}={% endfor %}"
                         "{% if add_generation_prompt %}+{% endif %}")
    return tok


def test_a_rendered_template_gets_no_second_bos(bos_tok):
    chat = (Message("system", "1"), Message("user", "2+3"))
    dicts = [{"role": m.role, "content": m.content} for m in chat]
    ids = encode_prompts(bos_tok, [chat, "12+34=", "5+6"], chat_template=False)
    assert ids[0] == bos_tok.apply_chat_template(dicts, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    assert ids[0].count(bos_tok.bos_token_id) == 1 and ids[0][0] == bos_tok.bos_token_id
    assert ids[1] == bos_tok("12+34=")["input_ids"]  # text: BOS added by the tokenizer
    assert prompt_texts(bos_tok, [chat])[0] == "<s>1=2+3=+"
    # text through the template (task.chat_template): one user turn, BOS once too
    (templated,) = encode_prompts(bos_tok, ["5+6"], chat_template=True)
    assert templated == bos_tok.apply_chat_template(
        [{"role": "user", "content": "5+6"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert templated.count(bos_tok.bos_token_id) == 1


def test_a_chat_with_a_tokenizer_without_a_template_names_the_tokenizer_and_the_file(
        bos_tok, tmp_path):
    template, bos_tok.chat_template = bos_tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="the prompts are chat messages but the tokenizer "
                                             r"\(.*\) has no chat template"):
            encode_prompts(bos_tok, [(Message("user", "1+1"),)])
        data = _write(tmp_path / "chat.jsonl", [GOOD])
        task = JsonlTask(data, prompt_key="messages")
        with pytest.raises(DatasetError, match=f"^{data}: the prompts are chat messages but "
                                               r"the tokenizer \(LlamaTokenizer"):
            task.fit_prompts(lambda p: [len(ids) for ids in encode_prompts(bos_tok, p)], 64,
                             drop=False)
    finally:
        bos_tok.chat_template = template
