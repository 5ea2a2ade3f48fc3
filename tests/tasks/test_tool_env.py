"""The tool environment: parsing calls in the tag format, results and error observations for
every bad call, the answer ending the episode with the task's reward, the env config, and
factories by import path."""

import pytest

from mcore_rl.config import ConfigError
from mcore_rl.tasks.envs import (EpisodeConfig, MalformedCall, TagFormat, ToolCall, ToolEnv,
                           calculator_env, load_env_factory, tools_env)
from mcore_rl.tasks.base import Example

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast

FMT = TagFormat()


def exact(prompt, response, answer):
    return 1.0 if response.endswith(answer + "</s>") else 0.0


@pytest.mark.parametrize("turn,want", [
    ("<call>calc: 12*3</call>", ToolCall("calc", "12*3")),
    ("let me see <call> calc :  2+2 </call>", ToolCall("calc", "2+2")),
    ("<call>lookup: gold</call><call>calc: 1</call>", ToolCall("lookup", "gold")),
    ("1665</s>", None),
    ("", None),
    ("<call>calc: 12*3", MalformedCall("<call> without </call>")),
    ("calc: 12*3</call>", MalformedCall("</call> without <call>")),
    ("<call>calc 12*3</call>", MalformedCall("expected <call>tool: argument</call>")),
    ("<call>: 12*3</call>", MalformedCall("expected <call>tool: argument</call>")),
    ("<call>ca lc: 1</call>", MalformedCall("bad tool name")),
])
def test_parse(turn, want):
    assert FMT.parse(turn) == want


def run(env, turns):
    assert env.reset() == env.example.prompt
    return [env.step(t) for t in turns]


def test_call_then_answer():
    env = calculator_env(Example("37*45=", "1665"), exact)
    first, last = run(env, ["<call>calc: 37*45</call>", "1665</s>"])
    assert (first.observation, first.reward, first.done) == ("<result>1665</result>", 0.0, False)
    assert (first.tool_calls, first.tool_errors) == (1, 0)
    assert (last.observation, last.reward, last.done, last.tool_calls) == (None, 1.0, True, 0)
    assert env.transcript == "<call>calc: 37*45</call><result>1665</result>1665</s>"


@pytest.mark.parametrize("turn,error", [
    ("<call>calc: 37*45", "malformed call (<call> without </call>)"),
    ("<call>calc 37*45</call>", "malformed call"),
    ("<call>search: cats</call>", "unknown tool search"),
    ("<call>lookup: gold</call>", "unknown tool lookup"),  # not offered by calculator_env
    ("<call>calc: 1/0</call>", "division by zero"),
    ("<call>calc: __import__('os')</call>", "only numbers"),
    ("<call>calc: 9**63</call>", "result longer than"),
])
def test_bad_calls_become_error_observations(turn, error):
    env = calculator_env(Example("37*45=", "1665"), exact)
    step, = run(env, [turn])
    assert not step.done and step.tool_calls == 1 and step.tool_errors == 1
    assert step.observation.startswith("<result>error: ") and error in step.observation


def test_over_long_and_crashing_tools_are_errors():
    def crash(arg):
        raise RuntimeError("boom")

    env = ToolEnv(Example("p", "a"), exact, {"long": lambda a: "x" * 65, "crash": crash,
                                             "ok": lambda a: "y" * 64})
    long, crashed, ok = run(env, ["<call>long: 1</call>", "<call>crash: 1</call>",
                                  "<call>ok: 1</call>"])
    assert long.observation == "<result>error: result longer than 64 characters</result>"
    assert crashed.observation == "<result>error: tool failed (RuntimeError)</result>"
    assert ok.observation == "<result>" + "y" * 64 + "</result>" and ok.tool_errors == 0


def test_lookup_env_and_factories_by_path():
    env = tools_env(Example("gold?", "79"), exact)
    step, answer = run(env, ["<call>lookup: Gold</call>", "79</s>"])
    assert step.observation == "<result>79</result>" and answer.reward == 1.0
    assert load_env_factory("mcore_rl.tasks.envs.tool_env:calculator_env") is calculator_env
    with pytest.raises(ValueError, match="module:function"):
        load_env_factory("mcore_rl.tasks.envs.tool_env")
    with pytest.raises(ValueError, match=r"must accept \(example, reward_fn, tool_format\)"):
        load_env_factory("mcore_rl.tasks.envs.tools:lookup")
    with pytest.raises(AttributeError):
        load_env_factory("mcore_rl.tasks.envs.tool_env:nope")


def test_episode_config_is_validated():
    assert EpisodeConfig(max_turns=1, max_total_tokens=2).max_turns == 1
    with pytest.raises(ConfigError, match="max_turns"):
        EpisodeConfig(max_turns=0)
    with pytest.raises(ConfigError, match="max_total_tokens"):
        EpisodeConfig(max_total_tokens=1)


def test_observation_spans():
    text = "<call>calc: 1+1</call><result>2</result>2</s><result>x"
    spans = FMT.observation_spans(text)
    assert [text[a:b] for a, b in spans] == ["<result>2</result>", "<result>x"]


HERMES = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
          "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
          "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from mcore_rl.tasks import tokenizer as tk

    tok = tk.load_tokenizer(tk.build_tokenizer_dir(tmp_path_factory.mktemp("tok")))
    tok.chat_template = HERMES
    return tok


def test_chat_template_tool_format(chat_tok):
    from mcore_rl.tasks.envs.tool_format import ChatToolFormat, tool_format

    fmt = tool_format(chat_tok, True)
    assert isinstance(fmt, ChatToolFormat) and isinstance(tool_format(chat_tok, False), TagFormat)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "37*45"}}\n</tool_call></s>'
    assert fmt.parse(call) == ToolCall("calc", "37*45")
    assert fmt.parse('<tool_call>{"name": "lookup", "arguments": "gold"}</tool_call>') == \
        ToolCall("lookup", "gold")
    assert fmt.parse("1665</s>") is None
    assert fmt.parse("<tool_call>{name: calc}</tool_call>") == MalformedCall("the call is not JSON")
    assert fmt.parse('<tool_call>["calc"]</tool_call>') == \
        MalformedCall('expected {"name": ..., "arguments": ...}')
    assert fmt.parse('<tool_call>{"name": "calc"') == \
        MalformedCall("<tool_call> without </tool_call>")
    assert fmt.stop_token_ids(chat_tok) == [] and fmt.cut_after_call([5, 6], chat_tok) == 2
    env = calculator_env(Example("37*45=", "1665"), exact, fmt)
    env.reset()
    step = env.step(call)
    assert step.observation == ("<|im_start|>user\n<tool_response>\n1665\n</tool_response>"
                                "<|im_end|>\n<|im_start|>assistant\n")
    bad = env.step('<tool_call>{"name": "calc", "arguments": "1/0"}</tool_call></s>')
    assert "<tool_response>\nerror: division by zero\n</tool_response>" in bad.observation
    assert env.step("1665</s>").reward == 1.0


def test_chat_format_needs_a_template(chat_tok):
    from mcore_rl.tasks.envs.tool_format import tool_format

    template, chat_tok.chat_template = chat_tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            tool_format(chat_tok, True)
    finally:
        chat_tok.chat_template = template
