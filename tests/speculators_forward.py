"""Runs in an environment that has the speculators package (`make speculators`), never under selfspec's own
transformers: loads an EAGLE-3 or DFlash directory with speculators' own classes, runs its forward on given inputs
and writes the draft logits; then saves the model again with speculators' own `save_pretrained`, for selfspec to
import. EAGLE-3: the training-time-test loop, `steps` steps, logits of every step. DFlash: the anchored-block
forward over `anchors` random blocks, logits of every block position, and the anchors speculators drew. Used by
tests/test_speculators.py.

usage: python speculators_forward.py EXPORT_DIR INPUTS.pt OUT.pt RESAVE_DIR
"""

import json
import sys

import torch
from safetensors import safe_open
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash import core as dflash_core
from speculators.models.eagle3 import Eagle3DraftModel


def eagle3_logits(export_dir: str, inputs: dict):
    model = Eagle3DraftModel.from_pretrained(export_dir).float().eval()
    steps = []
    model.lm_head.register_forward_hook(lambda module, args, output: steps.append(output.detach()))
    input_ids = inputs["input_ids"]
    with torch.no_grad():
        model(
            hidden_states=inputs["hidden_states"],
            input_ids=input_ids,
            document_ids=torch.zeros_like(input_ids),
            ttt_steps=inputs["steps"],
        )
    return model, {
        "logits": torch.stack([step[0] for step in steps]),  # [steps, T, V_draft]
        "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
    }


def dflash_logits(export_dir: str, inputs: dict):
    config = DFlashSpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: dense masks, no flex attention
    model = DFlashDraftModel.from_pretrained(export_dir, config=config).float().eval()
    drawn = []
    select = dflash_core.select_anchors
    dflash_core.select_anchors = lambda *args, **kwargs: drawn.append(select(*args, **kwargs)) or drawn[-1]
    input_ids = inputs["input_ids"]
    hidden = inputs["hidden_states"]
    with torch.no_grad():
        logits = model._backbone_forward(
            hidden,
            input_ids,
            torch.ones_like(input_ids),
            torch.randn(*hidden.shape[:2], config.transformer_layer_config.hidden_size),
            torch.zeros_like(input_ids),
            max_anchors=inputs["anchors"],
        )[1]
    anchors, valid = drawn[0]
    assert bool(valid.all())
    return model, {
        "logits": logits[0],
        "anchors": anchors,
        "layer_ids": list(model.config.aux_hidden_state_layer_ids),
        "mask_token_id": model.mask_token_id,
        "block_size": model.block_size,
    }


def main(export_dir: str, inputs_path: str, out_path: str, resave_dir: str) -> None:
    inputs = torch.load(inputs_path)
    kind = json.loads(open(f"{export_dir}/config.json").read())["speculators_model_type"]
    model, result = {"eagle3": eagle3_logits, "dflash": dflash_logits}[kind](export_dir, inputs)
    with safe_open(f"{export_dir}/model.safetensors", framework="pt") as file:
        stored = set(file.keys())
    state = model.state_dict()
    model.save_pretrained(resave_dir)
    torch.save(
        {
            **result,
            "not_stored": sorted(set(state) - stored),  # what speculators took from the verifier instead
            "unexpected": sorted(stored - set(state)),
            "nan": sorted(
                name for name, tensor in state.items() if tensor.is_floating_point() and tensor.isnan().any()
            ),
            "d2t": model.d2t.clone(),
        },
        out_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
