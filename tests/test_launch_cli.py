"""launch.py's command line: overrides of any field (lists and dicts as JSON) reach the
RunConfig, every bad input is one line on stderr with exit code 2, --dry_run checks and prints
without compiling, third-party INFO logs are off by default, and `make run` gets a workdir.

Most cases call launch.launch in-process (seconds each); a few run the script itself.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags
from absl import logging as absl_logging

import launch
from pipelinerl_jax import config_cli
from pipelinerl_jax.errors import ConfigError
from tests.config_args import run_config

ROOT = Path(__file__).resolve().parents[1]
TINY = f"--config={ROOT / 'configs' / 'tiny.py'}"


@pytest.fixture(autouse=True)
def _fresh_flags():
    verbosity = absl_logging.get_verbosity()
    yield
    flags.FLAGS.unparse_flags()  # the next in-process launch parses from scratch
    absl_logging.set_verbosity(verbosity)


def _launch(*args, capsys):
    """(exit code, stdout, stderr) of launch.py with these arguments, in-process."""
    with pytest.raises(SystemExit) as e:
        launch.launch(["launch.py", *args])
        raise SystemExit(0)  # --help returns instead of exiting
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def test_list_and_dict_overrides_reach_the_run_config():
    cfg = run_config(
        "--config.data.task=word_problems",
        "--config.data.task_options={}",
        "--config.reward.fn=math",
        '--config.data.few_shot=[{"question": "1+2?", "answer": "3"}]',
        "--config.reward.table=success_and_format",
        '--config.reward.table_options={"format_weight": 0.3}',
        '--config.eval.datasets=[{"path": "x.jsonl", "format": "gsm8k"}]',
        "--config.eval_every=5",
    )
    assert cfg.data.few_shot == (("1+2?", "3"),)
    assert dict(cfg.reward.table_options) == {"format_weight": 0.3}
    assert cfg.eval.datasets[0].path == "x.jsonl" and cfg.eval.datasets[0].format == "gsm8k"
    cfg = run_config(
        "--config.data.task=",
        "--config.eval_every=0",
        '--config.data.datasets=[{"path": "train.jsonl", "format": "gsm8k"}]',
    )
    assert cfg.data.task == "" and cfg.data.datasets[0].path == "train.jsonl"


def test_fields_the_file_leaves_out_and_dict_keys_can_be_set():
    cfg = run_config(
        "--config.reward.timeout_s=12",
        "--config.reward.workers=1",
        "--config.data.task_options.num_problems=50",
        "--config.model.init.num_layers",
        "3",
        "--config.sampler.num_pages=9",
        "--config.trainer.b2=0.95",
    )
    assert cfg.reward.timeout_s == 12.0 and isinstance(cfg.reward.timeout_s, float)
    assert dict(cfg.data.task_options)["num_problems"] == 50
    assert dict(cfg.data.task_options)["max_digits"] == 5  # the file's other options stay
    assert dict(cfg.model.init)["num_layers"] == 3
    assert cfg.sampler.num_pages == 9 and cfg.trainer.b2 == 0.95


def test_values_convert_to_the_field_type():
    cfg = run_config(
        "--config.devices.sampler=1",
        "--config.model.remat",
        "--config.data.system_prompt=null",
        "--config.loss.entropy_coef_end=0.01",
        "--config.compile_cache=",
        "--config.trainer.learning_rate=1e-3",
        "--config.max_lag=3",
        "--config.data.prompt_template=chat",
    )
    assert cfg.devices.sampler == 1.0 and isinstance(cfg.devices.sampler, float)
    assert cfg.model.remat is True and cfg.data.system_prompt is None
    assert cfg.trainer.loss.entropy_coef_end == 0.01 and cfg.compile_cache == ""
    assert cfg.trainer.learning_rate == 1e-3 and cfg.max_lag == 3
    assert cfg.data.prompt_template == "chat"
    assert run_config("--config.seed=1", "--config.seed=2").seed == 2  # the last one wins


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config.nosuch=1"], "config error: --config.nosuch: no such field"),
        (["--config.max_lagg=3"], "did you mean --config.max_lag?"),
        (["--config.learning_rate=1e-3"], "did you mean --config.trainer.learning_rate?"),
        (["--config=configs/nosuch.py"], "--config=configs/nosuch.py: no such file"),
        (["--config=configs/defualt.py"], "did you mean configs/default.py?"),
        (["--config.max_lag=abc"], "--config.max_lag=abc: expected an integer"),
        (["--config.trainer.learning_rate=fast"], "expected a number"),
        (["--config.model.remat=maybe"], "expected true or false"),
        (
            ["--config.model.remat", "--config.model.remat_policy=all"],
            "remat_policy='all' is not supported; use one of ('attention', 'matmuls')",
        ),
        (["--config.model.remat_policy=matmuls"], "set config.model.remat=True too"),
        (["--config.data.datasets=x.jsonl"], "expected a JSON list, e.g. --config.data.datasets="),
        (["--config.reward.table_options=0.3"], "expected a JSON object"),
        (["--config.batch_size=30"], "not divisible by config.group_size"),
        (["--config.data.task_options.difficulty=2"], "task reverse_digits has no such option"),
        (
            [
                "--config.data.task=reasoning_gym",
                '--config.data.task_options={"name": "chain_sun"}',
                "--config.reward.fn=reasoning_gym",
            ],
            "task reasoning_gym: unknown dataset name='chain_sun'; did you mean chain_sum",
        ),
        (
            [
                "--config.data.task=reasoning_gym",
                '--config.data.task_options={"name": "chain_sum"}',
            ],
            "scored by reward.fn=reasoning_gym, not reward.fn=task; set --config.reward.fn=",
        ),
        (
            [
                "--config.data.task=reasoning_gym",
                '--config.data.task_options={"name": "chain_sum", "min_term": 2}',
                "--config.reward.fn=reasoning_gym",
            ],
            "dataset chain_sum has no option 'min_term' (did you mean 'min_terms'?)",
        ),
        (
            [
                "--config.data.task=reasoning_gym",
                '--config.data.task_options={"name": "chain_sum", "config": {"min_term": 2}}',
                "--config.reward.fn=reasoning_gym",
            ],
            "dataset chain_sum has no option 'min_term' (did you mean 'min_terms'?)",
        ),
        (["--config.batch.max_sequences=3"], "is set from batch_size; leave it out"),
        (["--config.max_lag"], "--config.max_lag needs a value"),
        (["--config.sampler.head_dtype=int8"], "sampler head_dtype='int8': use one of"),
        (["--config.generation.top_p=1.5"], "generation.top_p=1.5 must be in (0, 1]"),
        (["--config.generation.top_k=-3"], "generation.top_k=-3 must be >= 0"),
        (["--config.generation.max_new_tokens=0"], "generation.max_new_tokens=0 must be >= 1"),
        (["--config.generation.max_prompt_tokens=0"], "max_prompt_tokens=0 must be >= 1"),
        (["--config.sampler.page_size=0"], "sampler.page_size=0 must be >= 1"),
        (["--config.sampler.max_prefill_rows=0"], "sampler.max_prefill_rows=0 must be >= 1"),
        (["--config.reward.workers=-1"], "config.reward: workers=-1 must be >= 0"),
        (["--config.reward.timeout_s=0"], "timeout_s=0.0 finite and > 0"),
        (["--config.reward.timeout_s=3"], "reward.timeout_s=3.0 applies only with reward.workers"),
        (
            ["--config.model.hf_dir=models/SmolLM2-135M-Instruct"],
            "config.model.init is for a fresh model, and model.hf_dir=models/SmolLM2-135M",
        ),
        (["--config.trainer.b2=1"], "trainer.b2=1.0 must be in [0, 1)"),
        (["--config.trainer.eps=0"], "trainer.eps=0.0 must be > 0"),
        (["--config.trainer.weight_decay=-0.1"], "trainer.weight_decay=-0.1 must be >= 0"),
        (["--config.trainer.min_lr_ratio=2"], "trainer.min_lr_ratio=2.0 must be in [0, 1]"),
        (["--config.checkpoint_every=-1"], "checkpoint_every=-1 must be >= 0"),
        (["--config.checkpoint_keep=0"], "config.checkpoint_keep=0 must be >= 1"),
        (["--config.seed=-1"], "config.seed=-1, data.shuffle_seed=0 and sampler.seed=0 must be"),
        (
            ["--config.sampler.num_slots=10", "--config.sampler.decode_widths=3"],
            "decode_widths=3: num_slots=10 halves into 2 widths (10, 5); use decode_widths <= 2",
        ),
        (
            [TINY, "--config.env.name=guess"],
            "config.env.name='guess' cannot play the character task data.task=reverse_digits",
        ),
        (
            [TINY, "--config.env.name=calculator"],
            "whose vocabulary is '0123456789+=:': system prompt",
        ),
        (
            ["--config=configs/guess.py", '--config.env.options={"closeness": "abc"}'],
            "environment guess: option closeness='abc' must be a finite number >= 0",
        ),
        (
            ["--config=configs/guess.py", '--config.env.options={"role": "bogus"}'],
            "option role='bogus' must be one of ['user', 'tool', 'text']",
        ),
        (
            ["--config=configs/guess.py", '--config.env.options={"higher": 5}'],
            "option higher=5 must be a non-empty string",
        ),
        (
            ["--config=configs/guess.py", '--config.env.options={"lo": 10, "hi": 2}'],
            "options lo=10 > hi=2",
        ),
        (
            [
                "--config=configs/guess.py",
                "--config.env.max_turns=3",
                '--config.env.options={"max_turns": 5}',
            ],
            "config.env.max_turns=3 and env.options max_turns=5 disagree",
        ),
        (["--config.env.workers=5"], "config.env.workers=5 needs env.name"),
        (["--config.env.timeout_s=30"], "config.env.timeout_s=30.0 needs env.name"),
        (
            ["--config=configs/guess.py", "--config.env.workers=0", "--config.env.timeout_s=1"],
            "config.env.timeout_s=1.0 applies only with env.workers >= 1",
        ),
        (
            ["--config=configs/guess.py", "--config.env.workers=1", "--config.env.timeout_s=inf"],
            "timeout_s=inf finite and > 0",
        ),
        (
            ["--config=configs/guess.py", "--config.env.turn_tokens=12"],
            "config.env.turn_tokens=12 exceeds generation.max_new_tokens=11",
        ),
        (["--config.env.name=gues"], "unknown environment 'gues'"),
        (["--config.env.name=gues"], "did you mean guess?"),
        (
            ["--config.env.name=single_turn", "--config.env.max_turns=6"],
            "config.env.max_turns=6: environment 'single_turn' takes no max_turns",
        ),
        (["--nosuchflag"], "error: Unknown command line flag 'nosuchflag'"),
        (["stray"], "error: unexpected arguments ['stray']"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, expected, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = _launch(*args, "--dry_run", capsys=capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and expected in err, err
    assert out == ""


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            "def get_config():\n    raise ValueError('no\\nway')\n",
            "get_config() raised ValueError: no way",
        ),
        ("x = 1\n", "defines no get_config()"),
        ("def get_config(:\n", "loading it failed: SyntaxError"),
        ("def get_config():\n    return 3\n", "get_config() returned int"),
    ],
)
def test_broken_config_file_is_one_line_and_exit_2(tmp_path, body, expected, capsys):
    path = tmp_path / "broken.py"
    path.write_text(body)
    code, _, err = _launch(f"--config={path}", "--dry_run", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and expected in err, err


@pytest.mark.parametrize(
    "line, expected",
    [
        ("c.max_lagg = 3", "config.max_lagg: no such field; did you mean max_lag?"),
        (
            "c.generation.max_new_token = 3",
            "config.generation.max_new_token: no such field; did you mean max_new_tokens?",
        ),
        ("c.trainr = {}", "config.trainr: no such field; did you mean trainer?"),
        (
            "c.model.init.num_layerz = 3",
            "config.model.init.num_layerz: no such ModelConfig field; did you mean num_layers?",
        ),
    ],
)
def test_typo_in_a_config_file_is_one_line_and_exit_2(tmp_path, line, expected, capsys):
    path = tmp_path / "typo.py"
    path.write_text(
        f"from configs import tiny\n\ndef get_config():\n    c = tiny.get_config()\n"
        f"    {line}\n    return c\n"
    )
    code, _, err = _launch(f"--config={path}", "--dry_run", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and expected in err, err


def test_unwritable_workdir_is_one_line_and_exit_2(tmp_path, capsys):
    # A path under a regular file: not creatable even as root (chmod would not stop root).
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for extra in ([], ["--dry_run"]):
        code, _, err = _launch(TINY, f"--workdir={blocker / 'run'}", *extra, capsys=capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(
            f"config error: --workdir={blocker / 'run'} is not a writable directory"
        ), err
    code, _, err = _launch(TINY, f"--workdir={blocker}", capsys=capsys)
    assert code == 2 and "is not a writable directory" in err
    assert blocker.is_file()


def test_unusable_compile_cache_is_one_line_and_exit_2_before_the_workdir(tmp_path, capsys):
    """A compilation cache folder the run cannot make is refused before anything is written:
    the workdir is not even created, in a run or a dry run."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for extra in ([], ["--dry_run"]):
        code, _, err = _launch(
            TINY,
            f"--config.compile_cache={blocker / 'cache'}",
            f"--workdir={tmp_path / 'run'}",
            *extra,
            capsys=capsys,
        )
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(
            f"config error: --config.compile_cache={blocker / 'cache'} is not a writable directory"
        ), err
        assert not (tmp_path / "run").exists()
    # Through the Python API (pipeline.run): the same refusal, as a ConfigError.
    from pipelinerl_jax.pipeline.compile_watch import enable_persistent_cache

    with pytest.raises(ConfigError, match="--config.compile_cache=.* is not a writable directory"):
        enable_persistent_cache(blocker / "cache")


def test_a_model_directory_as_workdir_is_refused_and_its_config_kept(tmp_path, capsys):
    """--workdir=<a Hugging Face model> (meant for model.hf_dir) would lose the model's
    config.json to the run's; any other foreign config.json likewise. A run's own is resumed."""
    model = tmp_path / "model"
    model.mkdir()
    hf_config = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    (model / "config.json").write_text(hf_config)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("[1, 2]")
    for workdir, says in (
        (model, f"(a Hugging Face model's): pass the model as --config.model.hf_dir={model}"),
        (other, "(the run would overwrite it): move it, or name a new --workdir"),
    ):
        for extra in ([], ["--dry_run"]):
            code, _, err = _launch(TINY, f"--workdir={workdir}", *extra, capsys=capsys)
            assert code == 2 and err.count("\n") == 1, err
            assert "holds a config.json that is not a run's" in err and says in err, err
            assert sorted(p.name for p in workdir.iterdir()) == ["config.json"]
    assert (model / "config.json").read_text() == hf_config
    # Through the Python API too.
    from pipelinerl_jax import pipeline, presets

    with pytest.raises(ConfigError, match="not a run's"):
        pipeline.run(presets.tiny(steps=1), model)


def test_check_workdir_creates_only_for_a_run(tmp_path):
    config_cli.check_workdir(str(tmp_path / "new" / "run"), create=False)
    assert not (tmp_path / "new").exists()
    config_cli.check_workdir(str(tmp_path / "new" / "run"), create=True)
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
    with pytest.raises(ConfigError, match="is a file"):
        (tmp_path / "f").write_text("")
        config_cli.check_workdir(str(tmp_path / "f" / "x"), create=False)


def test_dry_run_prints_config_params_and_memory_and_exits_0(tmp_path, capsys):
    code, out, err = _launch(
        TINY,
        "--dry_run",
        "--config.reward.workers=1",
        "--config.reward.timeout_s=9",
        f"--workdir={tmp_path / 'run'}",
        capsys=capsys,
    )
    assert code == 0, err
    resolved = json.loads(out[: out.index("\ndevices: ")])
    assert resolved["reward"]["timeout_s"] == 9.0 and resolved["steps"] == 8
    assert "devices: cpu x 1: sampler 1, trainer 1 (shared)" in out
    assert "parameters (float32)" in out and "memory estimate:" in out
    assert "nothing was loaded or compiled" in out
    assert "compiling" not in out + err
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def _hf_config(path: Path) -> None:
    """A model directory as far as a dry run reads it: config.json (no torch needed)."""
    from pipelinerl_jax.models import config_json
    from tests.tiny_models import model_config

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_json.to_hf(model_config(vocab_size=64))))


def test_dry_run_of_a_reasoning_gym_task(tmp_path, capsys):
    _hf_config(tmp_path / "hf")  # a text task needs a model (the dry run reads its config)
    task = [
        "--config.data.task=reasoning_gym",
        '--config.data.task_options={"name": "chain_sum", "config": {"max_terms": 3}}',
        "--config.reward.fn=reasoning_gym",
    ]
    # Without model.hf_dir the run is refused before its workdir is touched: so is the dry run.
    code, _, err = _launch(TINY, "--dry_run", *task, capsys=capsys)
    assert code == 2 and "config.data.task is text: it needs model.hf_dir" in err, err
    code, _, err = _launch(TINY, *task, f"--workdir={tmp_path / 'run'}", capsys=capsys)
    assert code == 2 and "config.data.task is text: it needs model.hf_dir" in err, err
    assert not (tmp_path / "run").exists()  # no config.json, no lock
    code, out, err = _launch(
        TINY,
        "--dry_run",
        *task,
        f"--config.model.hf_dir={tmp_path / 'hf'}",
        "--config.model.init={}",
        capsys=capsys,
    )
    assert code == 0, err
    resolved = json.loads(out[: out.index("\ndevices: ")])
    assert resolved["data"]["task_options"] == [["config", {"max_terms": 3}], ["name", "chain_sum"]]
    assert resolved["reward"]["fn"] == "reasoning_gym"


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--config.devices.sampler_tp=2"],
            "devices.sampler_tp=2 and devices.trainer_tp=1 need more",
        ),
        (
            ["--config.model.init.num_layers=100000", "--config.model.init.hidden_size=8192"],
            "config error: memory estimate",
        ),
        (
            [
                '--config.data.datasets=[{"path": "no/such.jsonl"}]',
                "--config.data.task=",
                "--config.eval_every=0",
            ],
            "dataset file not found: no/such.jsonl",
        ),
        (
            [
                f'--config.data.datasets=[{{"path": "{ROOT / "tests/data/gsm8k.jsonl"}"}}]',
                "--config.data.task=",
                "--config.eval_every=0",
            ],
            "config.data.datasets is text: it needs model.hf_dir",
        ),
        (["--spawn_local=1"], "--spawn_local=1: use 2 or more"),
        (["--spawn_local=3", "--config.devices.trainer_processes=3"], "trainer_processes=3: use"),
        (["--spawn_local=3", "--num_processes=3"], "--spawn_local sets it for its processes"),
        (["--num_processes=2"], "--num_processes > 1 needs --coordinator=host:port"),
        (["--num_processes=2", "--coordinator=h:1", "--process_id=2"], "outside 0..1"),
        (["--num_processes=0"], "--num_processes=0: use 2 or more"),
        (["--process_id=1"], "--process_id: for multi-process runs; add --spawn_local=N"),
        (["--coordinator=h:1", "--elastic"], "--coordinator, --elastic: for multi-process runs"),
        (
            ["--spawn_local=2", "--config.deterministic=true"],
            "config.deterministic runs in one process",
        ),
    ],
)
def test_dry_run_refuses_what_a_run_would(args, expected, capsys):
    code, _, err = _launch(TINY, "--dry_run", *args, capsys=capsys)
    assert code == 2 and expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args, roles",
    [
        (
            ["--spawn_local=3", "--elastic", "--config.devices.trainer_processes=2"],
            "processes: 3: trainer 2 (ids 0..1), sampler 1 (elastic: they may leave and join)",
        ),
        (
            ["--num_processes=3", "--coordinator=10.0.0.1:8476", "--process_id=2"],
            "processes: 3: trainer 1 (id 0), sampler 2; the devices line is one process's",
        ),
        (["--num_processes=1", "--process_id=0"], None),  # a script's flags for one process
    ],
)
def test_dry_run_accepts_a_valid_process_layout(args, roles, capsys):
    code, out, err = _launch(TINY, "--dry_run", *args, capsys=capsys)
    assert code == 0 and out.endswith(
        "dry run: the config is valid; nothing was loaded or compiled\n"
    ), err
    # The processes' roles, beside the devices line (which is one process's).
    assert (roles in out) if roles else ("processes: " not in out)


def test_third_party_info_logs_are_off_unless_verbosity_asks(capsys):
    assert _launch(TINY, "--dry_run", capsys=capsys)[0] == 0
    assert absl_logging.get_verbosity() == absl_logging.WARNING
    flags.FLAGS.unparse_flags()
    assert _launch(TINY, "--dry_run", "--verbosity=0", capsys=capsys)[0] == 0
    assert absl_logging.get_verbosity() == absl_logging.INFO


def test_launch_script_dry_run_and_error_exit_codes():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    run = lambda *a: subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *a],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    proc = run("--dry_run")  # the embedded default
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory estimate:" in proc.stdout and "395,904 parameters" in proc.stdout
    proc = run("--config.max_lagg=3")
    assert proc.returncode == 2
    assert proc.stderr == (
        "config error: --config.max_lagg: no such field; did you mean "
        "--config.max_lag? (launch.py --help lists every field)\n"
    )


def test_make_run_gets_a_timestamped_workdir_unless_args_name_one():
    make = lambda *a: (
        subprocess.run(
            ["make", "-n", "run", *a], cwd=ROOT, capture_output=True, text=True, timeout=60
        ).stdout
    )
    line = [l for l in make().splitlines() if "launch.py" in l][-1]
    assert "launch.py --workdir=runs/$(date +%Y%m%d-%H%M%S)" in line
    line = [
        l for l in make("ARGS=--workdir=/tmp/x --config.seed=3").splitlines() if "launch.py" in l
    ][-1]
    assert "runs/" not in line and line.endswith("--workdir=/tmp/x --config.seed=3")


def test_dry_run_reads_the_dataset_files_as_the_run_would(tmp_path, capsys):
    _hf_config(tmp_path / "hf")  # text data needs a model (the dry run reads its config)
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(
            json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(3)
        )
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    args = [
        "--config.data.task=",
        "--config.eval_every=0",
        f"--config.model.hf_dir={tmp_path / 'hf'}",
        "--config.model.init={}",
    ]
    code, out, err = _launch(
        TINY, "--dry_run", *args, f'--config.data.datasets=[{{"path": "{good}"}}]', capsys=capsys
    )
    assert code == 0 and "data: 3 train problems" in out, err
    flags.FLAGS.unparse_flags()
    code, _, err = _launch(
        TINY, "--dry_run", *args, f'--config.data.datasets=[{{"path": "{bad}"}}]', capsys=capsys
    )
    assert code == 2 and err.count("\n") == 1, err
    assert "none of its 1 records is usable as format 'fields'" in err
