"""The task tokenizer: ~one token per character, fixed special ids, deterministic, loads as
an HF tokenizer offline, and its ids turn into the text the reward expects."""

import pytest

from mcore_rl.tasks import tokenizer as tk
from mcore_rl.tasks.addition import AdditionTask, reward

pytestmark = pytest.mark.fast  # the fast tier: scripts/test.sh -m fast


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tk.build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_training_is_deterministic_and_small():
    first, second = tk.train_sentencepiece(), tk.train_sentencepiece()
    assert first == second
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=first)
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    assert pieces == {"<unk>", "<s>", "</s>", "<pad>", "+", "=", *"0123456789"}
    assert [sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()] == [0, 1, 2, 3]


def test_tokenizer_dir_is_byte_identical_across_builds(tok_dir, tmp_path):
    again = tk.build_tokenizer_dir(tmp_path)
    names = sorted(p.name for p in tok_dir.iterdir())
    assert names == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    for name in names:
        assert (tok_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_one_token_per_character(tok_dir):
    tok = tk.load_tokenizer(tok_dir)       # AutoTokenizer, local_files_only
    assert len(tok) == 16
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        tk.UNK_ID, tk.BOS_ID, tk.EOS_ID, tk.PAD_ID)
    task = AdditionTask()
    for prompt, answer in task.warmup_examples(200, seed=0, p=0.0):
        ids = tk.encode_prompt(tok, prompt)
        assert len(ids) == 7 and ids[0] == tk.BOS_ID
        assert tok.convert_ids_to_tokens(ids[1:]) == list(prompt)
        target = tk.encode_answer(tok, answer)
        assert len(target) == 4 and target[-1] == tk.EOS_ID
        assert tk.UNK_ID not in ids + target
    wide = tk.encode_prompt(tok, AdditionTask(digits=3).prompt(7, 993))
    assert len(wide) == 9


def test_batched_encoding_equals_one_call_per_text(tok_dir):
    """encode_prompts / encode_answers (one tokenizer call for a batch, as the warm-up and the
    rollouts use them) give every text the ids of its own call, lengths mixed, no padding."""
    tok = tk.load_tokenizer(tok_dir)
    examples = (AdditionTask().warmup_examples(20, seed=1, p=0.5)
                + AdditionTask(digits=3).warmup_examples(20, seed=2, p=0.5))
    prompts, answers = [p for p, _ in examples], [a for _, a in examples]
    assert tk.encode_prompts(tok, prompts) == [
        list(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts]
    assert tk.encode_answers(tok, answers) == [
        list(tok(a, add_special_tokens=False)["input_ids"]) + [tk.EOS_ID] for a in answers]
    assert {len(ids) for ids in tk.encode_prompts(tok, prompts)} == {7, 9}
    assert tk.encode_prompts(tok, []) == [] and tk.encode_answers(tok, []) == []


def test_response_text_feeds_reward(tok_dir):
    tok = tk.load_tokenizer(tok_dir)
    digits = tk.encode_answer(tok, "042")[:-1]
    eos, pad = tk.EOS_ID, tk.PAD_ID
    assert tk.response_text(digits + [eos], tok) == "042</s>"
    assert reward("37+05=", tk.response_text(digits + [eos], tok)) == 1.0
    assert reward("37+05=", tk.response_text(digits + [eos, pad, pad], tok)) == 1.0  # padding
    assert reward("37+05=", tk.response_text(digits, tok)) == 0.0           # no EOS
    assert reward("37+05=", tk.response_text(digits + digits[:1] + [eos], tok)) == 0.0
    assert reward("37+05=", tk.response_text(digits + [pad, eos], tok)) == 0.0
    assert reward("37+05=", tk.response_text([eos] + digits, tok)) == 0.0
