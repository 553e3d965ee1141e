"""EAGLE-3 and DFlash drafters in the speculators format (what vLLM loads): export -> import round trips give
identical drafts, and the speculators package's own classes load our export and compute the same forward (run in a
venv of their own, `make speculators`, since speculators pins an older transformers than selfspec's)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.cli import main as cli_main
from selfspec.errors import SelfspecError
from selfspec.exchange import export_heads
from selfspec.exchange import import_heads as import_any
from selfspec.heads import create_drafter
from selfspec.heads.artifacts import save_head
from selfspec.training.recipes.eagle import EagleTraining

from .helpers import (
    FLAT,
    PROMPT,
    make_tiny_target,
    random_dflash_dir,
    random_dflash_head,
    random_eagle3_dir,
    random_eagle3_head,
    random_eagle_dir,
)

ROOT = Path(__file__).resolve().parent.parent
SIDE_PYTHON = Path(os.environ.get("SELFSPEC_SPECULATORS_PYTHON", ROOT / ".speculators-venv" / "bin" / "python"))
# The speculators format carries no tree options: the same for both sides.
OPTIONS = {"eagle3": {"top_k": 3, "depth": 3, "fixed_nodes": 8}, "dflash": {"top_k": 3, "fixed_nodes": 8}}


def import_heads(target, source, out):
    return import_any(target, source, out)[1]


def _half(target):
    return torch.arange(0, target.vocab_size, 2)


def _drafts(target, heads, steps: int = 4, drafter: str = "eagle3") -> list[tuple[list[int], list[int]]]:
    """The trees a drafter proposes along one greedy decode (what the target accepts moves it along)."""
    from selfspec.decoding import speculative_generate

    drafter = create_drafter(drafter, target, heads, **OPTIONS[drafter])
    drafter.cost_curve = FLAT
    trees = []
    original = drafter.propose

    def recording(request):
        tree = original(request)
        trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    drafter.propose = recording
    speculative_generate(target, drafter, torch.tensor(PROMPT), steps * 3, pace=False)  # every step's tree
    return trees


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_export_then_import_gives_identical_drafts(tmp_path, weights_dtype):
    target = make_tiny_target("llama")
    heads = random_eagle3_dir(target, tmp_path / "heads", draft_vocab=_half(target))
    exported = export_heads(target, heads, tmp_path / "export", "tiny-verifier", weights_dtype)
    document = json.loads((exported / "config.json").read_text())
    assert document["speculators_model_type"] == "eagle3" and document["draft_vocab_size"] == target.vocab_size // 2
    assert document["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert document["transformer_layer_config"]["num_hidden_layers"] == 1
    assert document["speculators_config"]["verifier"]["name_or_path"] == "tiny-verifier"
    state = load_file(str(exported / "model.safetensors"))
    assert torch.equal(torch.arange(len(state["d2t"])) + state["d2t"], _half(target))
    assert int(state["t2d"].sum()) == len(state["d2t"])
    assert torch.equal(
        state["embed_tokens.weight"].float(),
        target.model.get_input_embeddings().weight.to(state["embed_tokens.weight"].dtype).float(),
    )
    assert state["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.config.hidden_size

    imported = import_heads(target, exported, tmp_path / "imported")
    assert json.loads((imported / "config.json").read_text())["config"]["own_lm_head"] is False  # the target's rows
    reference = _drafts(target, heads)
    assert any(len(tokens) > 1 for tokens, _ in reference)
    if weights_dtype == "float32":  # bf16 rounding may reorder near-tied candidates; fp32 must not change a thing
        assert _drafts(target, exported) == reference  # --heads pointing at the speculators directory
        assert _drafts(target, imported) == reference
    else:
        assert _drafts(target, imported)  # loads and drafts


def test_an_lm_head_of_its_own_survives_the_round_trip(tmp_path):
    target = make_tiny_target("qwen3")
    exported = export_heads(target, random_eagle3_dir(target, tmp_path / "heads"), tmp_path / "export", "v", "float32")
    state = load_file(str(exported / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 1.5  # a head that trained its LM head (as SpecForge's do)
    save_file(state, str(exported / "model.safetensors"))
    imported = import_heads(target, exported, tmp_path / "imported")
    assert json.loads((imported / "config.json").read_text())["config"]["own_lm_head"] is True
    again = export_heads(target, imported, tmp_path / "again", "v", "float32")
    assert torch.equal(load_file(str(again / "model.safetensors"))["lm_head.weight"], state["lm_head.weight"])
    assert _drafts(target, imported) == _drafts(target, exported)


def test_bad_directories_are_one_line_errors(tmp_path, capsys):
    target = make_tiny_target("llama")
    with pytest.raises(SelfspecError, match="does not exist"):
        export_heads(target, tmp_path / "missing", tmp_path / "out", "v")
    with pytest.raises(SelfspecError, match="only eagle3 and dflash heads export .* EAGLE-1"):
        export_heads(target, random_eagle_dir(target, tmp_path / "eagle1"), tmp_path / "out", "v")
    with pytest.raises(SelfspecError, match="not a speculators directory"):
        import_heads(target, random_eagle3_dir(target, tmp_path / "ours"), tmp_path / "out")
    exported = export_heads(target, tmp_path / "ours", tmp_path / "export", "v")
    with pytest.raises(SelfspecError, match="made for another base model: hidden_size 32 .this model: 48"):
        import_heads(make_tiny_target("llama", hidden_size=48), exported, tmp_path / "out")
    with pytest.raises(SelfspecError, match="model_type 'llama' .this model: 'qwen3'"):
        create_drafter("eagle3", make_tiny_target("qwen3"), exported)
    with pytest.raises(SelfspecError, match="speculators 'eagle3' heads, not 'eagle': use --drafter eagle3"):
        create_drafter("eagle", target, exported)
    with pytest.raises(
        SelfspecError, match="speculators defines EAGLE-3 draft layers for llama, qwen3 models, not 'mistral'"
    ):
        mistral = make_tiny_target("mistral")
        export_heads(mistral, random_eagle3_dir(mistral, tmp_path / "mistral"), tmp_path / "out", "v")
    state = load_file(str(exported / "model.safetensors"))
    embeddings = state["embed_tokens.weight"].clone()
    state["embed_tokens.weight"] = embeddings.flip(0)  # another model's embeddings
    save_file(state, str(exported / "model.safetensors"))
    with pytest.raises(SelfspecError, match="carries embeddings that are not this model's"):
        import_heads(target, exported, tmp_path / "out")
    state["embed_tokens.weight"] = embeddings
    state["d2t"][0] = 10_000
    save_file(state, str(exported / "model.safetensors"))
    with pytest.raises(SelfspecError, match="d2t and t2d do not describe a draft vocabulary"):
        import_heads(target, exported, tmp_path / "out")
    document = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**document, "speculators_model_type": "dspark"}))
    with pytest.raises(SelfspecError, match="speculators 'dspark' drafter: selfspec imports eagle3 and dflash only"):
        import_heads(target, exported, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
    for argv, message in [
        (
            ["export", "--heads", str(tmp_path / "missing"), "--format", "speculators", str(tmp_path / "o")],
            "does not exist",
        ),
        (["import", str(tmp_path / "missing"), str(tmp_path / "o")], "has no config.json"),
    ]:
        capsys.readouterr()
        assert cli_main(argv) == 2
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1 and "Traceback" not in error


def _side_environment() -> Path:
    built = "SELFSPEC_SPECULATORS_PYTHON" in os.environ or (SIDE_PYTHON.parent.parent / ".installed").is_file()
    if not (built and SIDE_PYTHON.is_file()):  # `make speculators` marks a venv whose installs all finished
        pytest.skip(
            f"no environment with the speculators package at {SIDE_PYTHON} (speculators 0.9 pins "
            "transformers<=5.19, selfspec runs on 5.23): `make speculators` builds one"
        )
    return SIDE_PYTHON


def _run_side_script(python: Path, tmp_path: Path) -> dict:
    """tests/speculators_forward.py on tmp_path/export and tmp_path/inputs.pt -> what it wrote (resaved:
    tmp_path/resaved)."""
    script = Path(__file__).with_name("speculators_forward.py")
    args = [
        str(python),
        str(script),
        str(tmp_path / "export"),
        str(tmp_path / "inputs.pt"),
        str(tmp_path / "theirs.pt"),
        str(tmp_path / "resaved"),
    ]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.load(tmp_path / "theirs.pt")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculators_own_classes_load_our_export_and_agree(tmp_path, family):
    """speculators' Eagle3DraftModel loads the export (the verifier: the tiny target saved as a checkpoint), runs its
    training-time-test forward for three steps, and its logits equal ours on the same inputs; what it saves again
    with its own save_pretrained imports back into the same drafts."""
    python = _side_environment()
    target = make_tiny_target(family)
    head = random_eagle3_head(target, draft_vocab=_half(target)).eval()
    target.model.save_pretrained(tmp_path / "verifier")
    heads = save_head(
        tmp_path / "heads",
        "eagle3",
        replace(head.config, feature_layers=head.feature_layers),
        head.state_dict(),
        target.fingerprint,
    )
    export_heads(target, heads, tmp_path / "export", str(tmp_path / "verifier"), "float32")
    rows, steps = 128, 3  # speculators' flex-attention masks come in blocks of 128
    torch.manual_seed(1)
    features = torch.randn(1, rows, len(head.feature_layers) * target.config.hidden_size)
    input_ids = torch.randint(3, target.vocab_size, (1, rows + 1))
    torch.save({"hidden_states": features, "input_ids": input_ids[:, 1:], "steps": steps}, tmp_path / "inputs.pt")
    theirs = _run_side_script(python, tmp_path)
    assert theirs["unexpected"] == [] and theirs["nan"] == []  # every stored weight used, none left unloaded
    assert theirs["not_stored"] == ["verifier_lm_head.weight", "verifier_norm.weight"]  # training-only copies
    assert theirs["layer_ids"] == list(head.feature_layers)
    assert torch.equal(torch.arange(len(theirs["d2t"])) + theirs["d2t"], _half(target))
    with torch.no_grad():
        ours = [
            head.draft_logits(out)[0]
            for out in EagleTraining(head, head.config).unroll(head.fuse(features), input_ids, steps)
        ]
    for step in range(steps):
        valid = rows - step  # later steps' last rows run past the sequence (padding), in both implementations
        torch.testing.assert_close(theirs["logits"][step][:valid], ours[step][:valid], atol=1e-4, rtol=1e-4)
    assert _drafts(target, tmp_path / "resaved") == _drafts(target, tmp_path / "export")


def test_dflash_export_then_import_gives_identical_drafts(tmp_path):
    target = make_tiny_target("llama")
    heads = random_dflash_dir(target, tmp_path / "heads", draft_vocab=_half(target), num_layers=2)
    exported = export_heads(target, heads, tmp_path / "export", "tiny-verifier", "float32")
    document = json.loads((exported / "config.json").read_text())
    assert document["speculators_model_type"] == "dflash" and document["architectures"] == ["DFlashSpeculator"]
    assert document["block_size"] == 4 and document["mask_token_id"] == target.vocab_size - 1
    assert document["aux_hidden_state_layer_ids"] == [0, 1, 2] and document["sample_from_anchor"] is False
    layer = document["transformer_layer_config"]
    assert (
        layer["model_type"] == "qwen3"
        and layer["num_hidden_layers"] == 2
        and layer["hidden_size"] == target.config.hidden_size
    )
    assert document["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    state = load_file(str(exported / "model.safetensors"))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "norm.weight",
        "lm_head.weight",
    } <= set(state)
    imported = import_heads(target, exported, tmp_path / "imported")
    reference = _drafts(target, heads, drafter="dflash")
    assert any(len(tokens) > 1 for tokens, _ in reference)
    assert _drafts(target, exported, drafter="dflash") == reference  # --heads pointing at the speculators directory
    assert _drafts(target, imported, drafter="dflash") == reference
    assert (
        _drafts(target, export_heads(target, imported, tmp_path / "again", "v", "float32"), drafter="dflash")
        == reference
    )


def test_dflash_directories_selfspec_cannot_run_are_refused(tmp_path):
    target = make_tiny_target("qwen3")
    exported = export_heads(target, random_dflash_dir(target, tmp_path / "heads"), tmp_path / "export", "v", "float32")
    document = json.loads((exported / "config.json").read_text())
    cases = [
        ({**document, "sample_from_anchor": True}, "drafts from the anchor position too"),
        ({**document, "mask_token_id": None}, "has no mask_token_id"),
        (
            {**document, "transformer_layer_config": {**document["transformer_layer_config"], "intermediate_size": 7}},
            "made for another base model: intermediate_size 7",
        ),
        (
            {**document, "transformer_layer_config": {**document["transformer_layer_config"], "num_hidden_layers": 12}},
            "has 12 draft layers",
        ),
    ]
    for changed, message in cases:
        (exported / "config.json").write_text(json.dumps(changed))
        with pytest.raises(SelfspecError, match=message):
            import_heads(target, exported, tmp_path / "out")
        with pytest.raises(SelfspecError, match=message):
            create_drafter("dflash", target, exported)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculators_own_classes_load_our_dflash_export_and_agree(tmp_path, family):
    """speculators' DFlashDraftModel loads the DFlash export and runs its anchored-block forward (the one it trains
    with) on random blocks; for the anchors it drew, its logits at every block position equal ours; what it saves
    again imports back into the same drafts."""
    python = _side_environment()
    target = make_tiny_target(family)
    head = random_dflash_head(target, draft_vocab=_half(target), num_layers=2).eval()
    target.model.save_pretrained(tmp_path / "verifier")
    heads = save_head(
        tmp_path / "heads",
        "dflash",
        replace(head.config, feature_layers=head.feature_layers),
        head.state_dict(),
        target.fingerprint,
    )
    export_heads(target, heads, tmp_path / "export", str(tmp_path / "verifier"), "float32")
    rows, anchors = 48, 6
    torch.manual_seed(1)
    features = torch.randn(1, rows, len(head.feature_layers) * target.config.hidden_size)
    input_ids = torch.randint(3, target.vocab_size, (1, rows))
    torch.save({"hidden_states": features, "input_ids": input_ids, "anchors": anchors}, tmp_path / "inputs.pt")
    theirs = _run_side_script(python, tmp_path)
    assert theirs["unexpected"] == [] and theirs["nan"] == []
    assert theirs["not_stored"] == ["verifier_lm_head.weight", "verifier_norm.weight"]
    assert theirs["layer_ids"] == list(head.feature_layers) and theirs["mask_token_id"] == head.config.mask_token_id
    assert theirs["block_size"] == head.config.block_size
    with torch.no_grad():
        ours = head.draft_logits(head.blocks(features, input_ids, theirs["anchors"].view(1, -1)))  # [1, A, B, V_draft]
    torch.testing.assert_close(theirs["logits"], ours.view(-1, ours.shape[-1]), atol=1e-4, rtol=1e-4)
    assert _drafts(target, tmp_path / "resaved", drafter="dflash") == _drafts(
        target, tmp_path / "export", drafter="dflash"
    )
