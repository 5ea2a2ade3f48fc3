"""Multi-turn rollouts against a scripted engine (no vLLM): one batched call per turn with only
the running episodes, observations appended with mask 0, engine log-probs kept for model tokens
only, every bound (turns, total tokens, the call cut), and the batch the trainer builds."""

from dataclasses import dataclass

import pytest
import torch

from mcore_rl.tasks.envs import EpisodeConfig, calculator_env
from mcore_rl.rollout.engine import Completion, SamplingConfig
from mcore_rl.rollout.multi_turn import Episode, MultiTurnRollout, episode_metrics, loss_masks
from mcore_rl.tasks import tokenizer as tk
from mcore_rl.tasks.base import Example
from mcore_rl.tasks.tool_calc import ToolCalcTask, reward
from mcore_rl.rollout.batches import build_batch

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tk.load_tokenizer(tk.build_tokenizer_dir(tmp_path_factory.mktemp("tok"),
                                                    ToolCalcTask(), vocab_size=64))


@dataclass
class Scripted:
    """An engine stand-in: `policy(context_text) -> reply text`; records each call. Log-prob
    of the k-th token of a reply is -(k + 1) / 100 (so they can be traced)."""

    tok: object
    policy: object
    calls: list

    def __call__(self, prompts, sampling):
        self.calls.append((len(prompts), sampling))
        outs = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=True)
            reply = self.policy(text)
            out = list(self.tok(reply, add_special_tokens=False)["input_ids"])
            if reply.endswith("</s>"):
                out = list(self.tok(reply[:-4], add_special_tokens=False)["input_ids"]) + [
                    self.tok.eos_token_id]
            out = out[:sampling.max_tokens]
            outs.append([Completion(tuple(out), tuple(-(k + 1) / 100 for k in range(len(out))),
                                    "stop")])
        return outs


def tool_user(text):
    """Calls the calculator once (odd first operand) or answers 0 at once (even), then copies
    the result."""
    prompt = text.split("=")[0]
    if "<result>" in text:
        return text.rsplit("<result>", 1)[1].split("</result>")[0] + "</s>"
    if int(prompt.split("*")[0]) % 2:
        return f"<call>calc: {prompt}</call>"
    return "0</s>"


EXAMPLES = [Example("37*45=", "1665"), Example("12*11=", "132"), Example("91*10=", "910")]


def runner(tok, **episode):
    return MultiTurnRollout(calculator_env, reward, EpisodeConfig(**episode), tok)


def test_turns_are_batched_and_finished_episodes_drop_out(tok):
    engine = Scripted(tok, tool_user, [])
    sampling = SamplingConfig(n=2, max_tokens=16, seed=5, stop_token_ids=(tok.eos_token_id,))
    encode = lambda text: tk.encode_prompt(tok, text)  # noqa: E731
    prompts, groups = runner(tok, max_turns=3, max_total_tokens=40).rollout(
        engine, EXAMPLES, encode, sampling)
    assert prompts == [encode(e.prompt) for e in EXAMPLES]
    # turn 1: all 6 episodes; turn 2: the 4 that called the tool; then all are done
    assert [n for n, _ in engine.calls] == [6, 4]
    assert len({s.seed for _, s in engine.calls} | {sampling.seed}) == 3  # a seed per turn
    close = tok.convert_tokens_to_ids("</call>")
    for turn, (_, s) in enumerate(engine.calls):
        assert s.n == 1 and s.seed == sampling.keyed("turn", turn).seed and s.max_tokens == 16
        assert set(s.stop_token_ids) == {tok.eos_token_id, close}
    called, direct = groups[0][0], groups[1][1]
    assert called.finish_reason == "done" and called.reward == 1.0
    assert (called.turns, called.tool_calls, called.tool_errors) == (2, 1, 0)
    text = tok.decode(called.token_ids, skip_special_tokens=False)
    assert text == "<call>calc: 37*45</call><result>1665</result>1665</s>"
    obs = list(tok("<result>1665</result>", add_special_tokens=False)["input_ids"])
    n_call = len(called.token_ids) - len(obs) - 5
    assert called.loss_mask == (1,) * n_call + (0,) * len(obs) + (1,) * 5
    # engine log-probs of the model tokens only, in order (two turns: -0.01.. restarts)
    assert called.logprobs == tuple(-(k + 1) / 100 for k in range(n_call)) + tuple(
        -(k + 1) / 100 for k in range(5))
    assert called.token_logprobs()[n_call:n_call + len(obs)] == [0.0] * len(obs)
    assert (direct.turns, direct.tool_calls, direct.reward) == (1, 0, 0.0)
    assert direct.loss_mask == (1, 1)  # "0" + EOS
    metrics = episode_metrics([e for g in groups for e in g])
    assert metrics == {"turns/mean": 10 / 6, "tool_calls/mean": 4 / 6, "tool_errors/frac": 0.0,
                       "tokens/generated": float(sum(e.model_tokens for g in groups for e in g)),
                       "tokens/observed": 2.0 * 6 + 2 * 5}  # <result>1665</result>, ...910...


def test_max_turns_ends_without_a_trailing_observation(tok):
    always_call = lambda text: "<call>calc: 1/0</call>"  # noqa: E731
    engine = Scripted(tok, always_call, [])
    _, groups = runner(tok, max_turns=2, max_total_tokens=60).rollout(
        engine, EXAMPLES[:1], lambda t: tk.encode_prompt(tok, t), SamplingConfig(max_tokens=16))
    episode = groups[0][0]
    assert episode.finish_reason == "max_turns" and episode.turns == 2
    assert (episode.tool_calls, episode.tool_errors) == (2, 2)
    assert episode.loss_mask[-1] == 1  # the last observation was not appended
    text = tok.decode(episode.token_ids, skip_special_tokens=False)
    assert text == "<call>calc: 1/0</call><result>error: division by zero</result>" \
                   "<call>calc: 1/0</call>"
    assert episode_metrics([episode])["tool_errors/frac"] == 1.0


def test_total_token_budget(tok):
    engine = Scripted(tok, tool_user, [])
    encode = lambda t: tk.encode_prompt(tok, t)  # noqa: E731
    prompt_len = len(encode("37*45="))
    # room for the call (10 tokens) but not for its 6-token result + one more token
    _, groups = runner(tok, max_turns=3, max_total_tokens=prompt_len + 12).rollout(
        engine, EXAMPLES[:1], encode, SamplingConfig(max_tokens=16))
    episode = groups[0][0]
    assert engine.calls[0][1].max_tokens == 12  # the call's max_tokens is cut to the room
    assert episode.finish_reason == "max_total_tokens" and episode.turns == 1
    assert len(episode.token_ids) == 10 and all(episode.loss_mask)
    # a turn longer than the room is cut to it
    _, groups = runner(tok, max_turns=3, max_total_tokens=prompt_len + 4).rollout(
        Scripted(tok, tool_user, []), EXAMPLES[:1], encode, SamplingConfig(max_tokens=16))
    assert len(groups[0][0].token_ids) == 4 == len(groups[0][0].logprobs)
    assert groups[0][0].reward == 0.0


def test_a_turn_running_past_its_call_is_cut_after_it(tok):
    engine = Scripted(tok, lambda text: "1<call>calc: 2*3</call>99" if "<result>" not in text
                      else "6</s>", [])
    _, groups = runner(tok, max_turns=3, max_total_tokens=60).rollout(
        engine, [Example("2*3=", "6")], lambda t: tk.encode_prompt(tok, t),
        SamplingConfig(max_tokens=30))
    episode = groups[0][0]
    text = tok.decode(episode.token_ids, skip_special_tokens=False)
    assert text == "1<call>calc: 2*3</call><result>6</result>6</s>"
    assert len(episode.logprobs) == episode.model_tokens  # the cut tokens' log-probs dropped
    assert episode.reward == 1.0


def test_warmup_trace_encodes_as_a_rollout_holds_it(tok):
    engine = Scripted(tok, tool_user, [])
    run = runner(tok, max_turns=3, max_total_tokens=40)
    _, groups = run.rollout(engine, EXAMPLES[:1], lambda t: tk.encode_prompt(tok, t),
                            SamplingConfig(max_tokens=16))
    ids, mask = run.encode_trace(ToolCalcTask().trace(37, 45))
    assert tuple(ids) == groups[0][0].token_ids and tuple(mask) == groups[0][0].loss_mask


def test_batch_masks_observation_labels(tok):
    """build_batch with per-token masks: a label counts iff it is a model token."""
    prompt = [1, 5, 6]
    response = [10, 11, 12, 20, 21, 13, 2]
    rmask = [1, 1, 1, 0, 0, 1, 1]
    batch = build_batch([prompt, prompt], [response, response[:2]], 12, 3, [rmask, rmask[:2]])
    assert batch.tokens.shape == (2, 12)
    want = [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert batch.mask[0].tolist() == want
    assert batch.labels[0][torch.tensor(want, dtype=torch.bool)].tolist() == [10, 11, 12, 13, 2]
    assert batch.mask[1].tolist() == [0, 0, 1, 1] + [0] * 8
    # without masks: every response token counts (the single-turn batch is unchanged)
    plain = build_batch([prompt], [response], 12, 3)
    assert plain.mask[0].tolist() == [0, 0] + [1] * 7 + [0] * 3
    # longer than a row: refused, never cut (a cut trains on fewer tokens than were sampled)
    with pytest.raises(ValueError, match=r"row 0: prompt 3 \+ response 7 = 10 tokens do not "
                                         r"fit a row of train.seq_len \+ 1 = 7"):
        build_batch([prompt], [response], 6, 3, [rmask])


def test_loss_masks_only_for_episodes():
    plain = [Completion((1, 2), (-0.1, -0.2), "stop")]
    assert loss_masks(plain) is None and episode_metrics(plain) == {}
    ep = Episode((1, 2, 3), (-0.1, -0.3), "done", loss_mask=(1, 0, 1))
    assert loss_masks([ep]) == [(1, 0, 1)] and ep.token_logprobs() == [-0.1, 0.0, -0.3]


def test_episodes_round_trip_through_checkpoint_state():
    from mcore_rl.rollout.multi_turn import completion_from_state, completion_state

    ep = Episode((1, 2, 3), (-0.1, -0.3), "done", loss_mask=(1, 0, 1), prompt_ids=(1, 9),
                 reward=1.0, turns=2, tool_calls=1, tool_errors=0)
    plain = Completion((4,), (-0.5,), "length")
    for c in (ep, plain):
        assert completion_from_state(completion_state(c)) == c
        assert type(completion_from_state(completion_state(c))) is type(c)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "gae", "reinforce_pp"])
def test_tool_episode_mechanics_end_to_end(tok, estimator):
    """The tool demo's pieces together (real calculator, reward, tokenizer, batch, advantages):
    a well-formed call is parsed and answered with the true product; the loss mask is exactly
    the model's tokens; every estimator puts advantages on those tokens and nowhere else."""
    from mcore_rl.algorithms import AlgorithmConfig
    from mcore_rl.rl.advantages import compute_advantages

    # one group: the episode that calls and copies (reward 1), one that answers 0 (reward 0)
    def policy(text):
        if "<result>" in text:
            return text.rsplit("<result>", 1)[1].split("</result>")[0] + "</s>"
        return "<call>calc: 37*45</call>" if policy.calls % 2 == 0 else "0</s>"

    policy.calls = 0

    def counted(text):
        reply = policy(text)
        if "<result>" not in text:
            policy.calls += 1
        return reply

    run = runner(tok, max_turns=3, max_total_tokens=40)
    prompts, groups = run.rollout(Scripted(tok, counted, []), EXAMPLES[:1],
                                  lambda t: tk.encode_prompt(tok, t),
                                  SamplingConfig(max_tokens=16, n=2))
    called, direct = groups[0]
    assert tok.decode(list(called.token_ids), skip_special_tokens=False) == \
        "<call>calc: 37*45</call><result>1665</result>1665</s>"
    assert (called.reward, called.tool_calls, called.tool_errors) == (1.0, 1, 0)
    assert (direct.reward, direct.tool_calls) == (0.0, 0)
    obs = tok("<result>1665</result>", add_special_tokens=False)["input_ids"]
    model = [t for t, m in zip(called.token_ids, called.loss_mask) if m]
    assert model == list(tok("<call>calc: 37*45</call>", add_special_tokens=False)["input_ids"]) \
        + list(tok("1665", add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    assert [t for t, m in zip(called.token_ids, called.loss_mask) if not m] == list(obs)
    assert len(called.logprobs) == called.model_tokens  # one engine log-prob per model token

    episodes = [called, direct]
    batch = build_batch([prompts[0]] * 2, [list(e.token_ids) for e in episodes], 40,
                        tok.pad_token_id, loss_masks(episodes))
    is_obs = torch.zeros_like(batch.mask, dtype=torch.bool)
    start = len(prompts[0]) - 1  # label position of the first continuation token
    for k, m in enumerate(called.loss_mask):
        is_obs[0, start + k] = not m
    assert int(batch.mask.sum()) == sum(e.model_tokens for e in episodes)
    assert not (batch.mask.bool() & is_obs).any()

    algo = AlgorithmConfig(advantage_estimator=estimator, grpo_eps=1e-4)
    extra = {"values": torch.zeros_like(batch.mask)} if estimator == "gae" else {}
    adv, _, _ = compute_advantages(algo, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                   batch.mask, torch.zeros_like(batch.mask), extra)
    assert (adv[~batch.mask.bool()] == 0).all()  # observations, prompt and padding: none
    assert (adv[0][batch.mask[0].bool()] > 0).all()  # the rewarded episode's model tokens
