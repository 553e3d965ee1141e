"""Every bad input is one clear line: SelfspecError from the API, exit code 2 and no traceback from the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from selfspec import SelfSpec, SelfspecError
from selfspec.cli import main
from selfspec.decoding import speculative_generate
from selfspec.heads import create_drafter

from .helpers import make_tiny_target


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
        (["--prompt", "cat", "--max-new-tokens", "0"], "max-new-tokens"),
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
    assert pytest.importorskip("re").search(fragment, err), err


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
    run = subprocess.run(
        [sys.executable, "-m", "selfspec.cli", "generate", "--model", str(tmp_path / "x"), "--prompt", "hi"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and run.stderr.strip().startswith("selfspec: error:")


def test_cli_generates_and_prints_stats(tiny_checkpoint, capsys):
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "the cat sat", "--max-new-tokens", "12", "--drafter", "ngram"]) == 0
    captured = capsys.readouterr()
    assert "12 tokens" in captured.err and "mean accepted length" in captured.err
