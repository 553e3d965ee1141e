"""The speculators check of tests/test_speculators.py on the real default model: export a trained dflash or eagle3
heads directory with the converted SmolLM2 checkpoint as verifier, let speculators' own classes (in the side venv,
`make speculators`) run their training forward on real hidden states of a real prompt and its greedy continuation,
and compare their draft logits with selfspec's.

usage: python scripts/speculators_real_check.py HEADS_DIR [--positions 128] [--out DIR] [--verifier CHECKPOINT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from selfspec.exchange import export_heads
from selfspec.heads import create_drafter
from selfspec.heads.artifacts import heads_kind
from selfspec.models import load_target
from selfspec.training.recipes.eagle import EagleTraining

ROOT = Path(__file__).resolve().parent.parent  # the checkout: its side venv and tests/speculators_forward.py
SIDE_PYTHON = ROOT / ".speculators-venv" / "bin" / "python"
PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of the same effect."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads")
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--out", default="runs/speculators-real-check")
    parser.add_argument(
        "--verifier",
        default="~/.cache/selfspec/models/SmolLM2-135M-Instruct",
        help="the default model as a transformers checkpoint (selfspec converts the GGUF into it)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_target("default", device="cpu", dtype=torch.float32, path="stock")
    kind = heads_kind(Path(args.heads))
    head = create_drafter(kind, target, Path(args.heads)).head.float().eval()
    verifier = Path(args.verifier).expanduser()
    export = export_heads(target, Path(args.heads), out / "export", str(verifier), "float32")

    chat = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt"
    )
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    with torch.inference_mode():
        ids = target.model.generate(chat, max_new_tokens=args.positions, do_sample=False)[:, : args.positions]
        hidden = target.model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[layer] for layer in head.feature_layers], dim=-1).float()
    inputs = {"hidden_states": features, "input_ids": ids, "anchors": 8, "steps": 3}
    if kind == "eagle3":
        inputs["input_ids"] = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token j + 1 beside feature j
    torch.save(inputs, out / "inputs.pt")
    script = ROOT / "tests" / "speculators_forward.py"
    run = subprocess.run(
        [
            str(SIDE_PYTHON),
            str(script),
            str(export),
            str(out / "inputs.pt"),
            str(out / "theirs.pt"),
            str(out / "resaved"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    theirs = torch.load(out / "theirs.pt")
    with torch.no_grad():
        if kind == "dflash":
            ours = head.draft_logits(head.blocks(features, ids, theirs["anchors"].view(1, -1)))
            ours, their_logits = ours.view(-1, ours.shape[-1]), theirs["logits"]
        else:
            steps = EagleTraining(head, head.config).unroll(head.fuse(features), inputs["input_ids"], 3)
            ours = torch.stack([head.draft_logits(step)[0][: args.positions - 3] for step in steps])
            their_logits = theirs["logits"][:, : args.positions - 3]
    report = {
        "heads": args.heads,
        "kind": kind,
        "verifier": str(verifier),
        "positions": args.positions,
        "unexpected_weights": theirs["unexpected"],
        "weights_from_verifier": theirs["not_stored"],
        "nan_weights": theirs["nan"],
        "max_abs_logit_difference": float((ours - their_logits).abs().max()),
        "argmax_agreement": float((ours.argmax(-1) == their_logits.argmax(-1)).float().mean()),
        "anchors": theirs.get("anchors", torch.tensor([])).tolist(),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
