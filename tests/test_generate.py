"""The `python -m pipelinerl_jax.generate` CLI on a tiny checkpoint + tokenizer made here.

End to end: greedy completions equal transformers' greedy generate on the same prompt ids,
group attempts agree, text is the tokenizer's decode, EOS from the tokenizer stops generation.
Bad input: one-line errors with exit code 2 (empty file, malformed JSON with its line number,
unknown model dir, n > slots, missing flag), and a per-request error line for a prompt longer
than the context while the other prompts still complete.
"""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from pipelinerl_jax import generate
from pipelinerl_jax.models.tokenizer import Tokenizer

WORDS = "the a cat dog sat ran on mat far big small red blue one two three is was and or".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "[UNK]"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
VOCAB = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS + ["user", "assistant"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "</s>",
                "bos_token": "<s>",
                "pad_token": "<pad>",
                "chat_template": TEMPLATE,
            }
        )
    )
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.15,
        eos_token_id=vocab["</s>"],
        bos_token_id=vocab["<s>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # make EOS likely after a few tokens for some prompts
        model.lm_head.weight[vocab["</s>"]] *= 3.0
    model.save_pretrained(path, safe_serialization=True)
    return path


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _run(argv, capsys):
    code = generate.run_cli(["generate", "--progress=false"] + argv)
    return code, capsys.readouterr().err


def test_greedy_cli_matches_transformers(model_dir, tmp_path, capsys):
    prompts = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "the cat sat on the mat", "id": "a"}),
            json.dumps({"prompt": "two dog"}),
            json.dumps({"messages": [{"role": "user", "content": "red or blue"}]}),
        ],
    )
    out = tmp_path / "out.jsonl"
    code, err = _run(
        [
            f"--model_dir={model_dir}",
            f"--prompts={prompts}",
            f"--out={out}",
            "--temperature=0",
            "--max_new_tokens=10",
            "--n=2",
            "--num_slots=4",
            "--chunk_steps=4",
            "--chat",
        ],
        capsys,
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["attempt"]) for r in rows] == [
        ("a", 0),
        ("a", 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    tok = Tokenizer.from_dir(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for r in rows:
        ids = torch.tensor([tok.encode(r["prompt"], add_special_tokens=False)])
        assert r["prompt"].startswith("<|im_start|>user ")
        with torch.no_grad():
            want = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=10,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=list(tok.eos_token_ids),
            )[0, ids.shape[1] :].tolist()
        assert r["token_ids"] == want
        assert r["completion"] == tok.decode(want, skip_special_tokens=True)
        assert len(r["logprobs"]) == len(want) and all(lp <= 0 for lp in r["logprobs"])
        assert r["finish_reason"] == ("stop" if want[-1] in tok.eos_token_ids else "length")
    assert any(r["finish_reason"] == "stop" for r in rows)


def test_prompt_longer_than_context_is_an_error_line(model_dir, tmp_path, capsys):
    prompts = _write(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt": "the " * 40}), json.dumps({"prompt": "big red dog"})],
    )
    out = tmp_path / "out.jsonl"
    code, err = _run(
        [
            f"--model_dir={model_dir}",
            f"--prompts={prompts}",
            f"--out={out}",
            "--temperature=0",
            "--max_new_tokens=4",
            "--max_seq_len=32",
            "--num_slots=4",
            "--chunk_steps=4",
        ],
        capsys,
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["finish_reason"] == "error" and "max_seq_len=32" in rows[0]["error"]
    assert rows[1]["finish_reason"] in ("stop", "length") and rows[1]["token_ids"]


@pytest.mark.parametrize(
    "case,match",
    [
        ("empty", "no prompts"),
        ("malformed", "p.jsonl:2: malformed JSON"),
        ("no_prompt_key", "p.jsonl:1: expected an object"),
        ("unknown_model", "model directory does not exist"),
        ("n_too_large", "--n=5 must be between 1 and --num_slots=4"),
        ("page_size_0", "--page_size=0 must be >= 1"),
        ("negative_kv_budget", "--kv_memory_gb=-1.0 must be >= 0"),
        ("negative_max_seq_len", "--max_seq_len=-5 must be >= 0"),
        ("missing_flag", "--out is required"),
        ("out_unwritable", "its folder is not a writable directory"),
        ("out_a_directory", "is a directory; name the file to write"),
        ("out_is_prompts", "is the --prompts file; name another file to write"),
    ],
)
def test_bad_input_one_line_error_exit_2(model_dir, tmp_path, capsys, case, match):
    lines = {
        "empty": [],
        "malformed": ['{"prompt": "a"}', '{"prompt": "b"'],
        "no_prompt_key": ['{"text": "a"}'],
    }.get(case, ['{"prompt": "the cat"}'])
    prompts = _write(tmp_path / "p.jsonl", lines)
    argv = [
        f"--model_dir={tmp_path / 'nope' if case == 'unknown_model' else model_dir}",
        f"--prompts={prompts}",
        "--num_slots=4",
        f"--n={5 if case == 'n_too_large' else 1}",
    ]
    out = {  # a path under a file cannot be created, even as root
        "out_unwritable": tmp_path / "p.jsonl" / "out.jsonl",
        "out_a_directory": tmp_path,
        "out_is_prompts": prompts,
    }.get(case, tmp_path / "out.jsonl")
    argv += {
        "page_size_0": ["--page_size=0"],
        "negative_kv_budget": ["--kv_memory_gb=-1"],
        "negative_max_seq_len": ["--max_seq_len=-5"],
    }.get(case, [])
    if case != "missing_flag":
        argv.append(f"--out={out}")
    before = prompts.read_text()
    code, err = _run(argv, capsys)
    assert code == 2
    assert match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.jsonl").exists()
    assert prompts.read_text() == before


def test_module_entry_point_exits_2(tmp_path):
    prompts = _write(tmp_path / "p.jsonl", ["not json"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelinerl_jax.generate",
            f"--model_dir={tmp_path}",
            f"--prompts={prompts}",
            f"--out={tmp_path / 'o.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
