"""Runs in an environment that has the speculators package (`make speculators`), never under selfspec's own
transformers: loads an EAGLE-3 directory with speculators' own classes, runs its forward (the training-time-test
loop, `ttt_steps` steps) on given inputs, and writes the draft logits of every step; then saves the model again with
speculators' own `save_pretrained`, for selfspec to import. Used by tests/test_speculators.py.

usage: python speculators_forward.py EXPORT_DIR INPUTS.pt OUT.pt RESAVE_DIR
"""

import sys

import torch
from safetensors import safe_open
from speculators.models.eagle3 import Eagle3DraftModel


def main(export_dir: str, inputs_path: str, out_path: str, resave_dir: str) -> None:
    inputs = torch.load(inputs_path)
    model = Eagle3DraftModel.from_pretrained(export_dir).float().eval()
    with safe_open(f"{export_dir}/model.safetensors", framework="pt") as file:
        stored = set(file.keys())
    state = model.state_dict()
    steps = []
    model.lm_head.register_forward_hook(lambda module, args, output: steps.append(output.detach()))
    hidden, input_ids = inputs["hidden_states"], inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=input_ids, document_ids=torch.zeros_like(input_ids), ttt_steps=inputs["steps"])
    model.save_pretrained(resave_dir)
    torch.save({
        "logits": torch.stack([step[0] for step in steps]),  # [steps, T, V_draft]
        "not_stored": sorted(set(state) - stored),  # what speculators took from the verifier instead
        "unexpected": sorted(stored - set(state)),
        "nan": sorted(name for name, tensor in state.items() if tensor.is_floating_point() and tensor.isnan().any()),
        "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
        "d2t": model.d2t.clone(),
    }, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:5])
