from __future__ import annotations

from pathlib import Path

import pytest

from selfspec import SelfspecError, load_target

from .helpers import make_tiny_target


def test_load_checkpoint_directory(tiny_checkpoint):
    target = load_target(tiny_checkpoint, device="cpu")
    assert target.tokenizer is not None and target.num_layers == 2
    ids = target.encode_prompt("the cat sat")
    assert ids.shape[0] == 1 and ids.shape[1] > 3  # chat template added role markers
    assert target.encode_prompt("the cat sat", chat=False).shape[1] < ids.shape[1]
    assert target.fingerprint.architecture == "LlamaForCausalLM"
    assert target.fingerprint == load_target(tiny_checkpoint, device="cpu").fingerprint


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_weights_are_copied_out_of_the_checkpoint_files_memory_map(tiny_checkpoint):
    target = load_target(tiny_checkpoint, device="cpu")
    mapped = []  # address ranges where the checkpoint's safetensors file is mapped into this process
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(".safetensors") and str(tiny_checkpoint) in line:
            start, end = (int(part, 16) for part in line.split()[0].split("-"))
            mapped.append((start, end))
    tensors = [*target.model.parameters(), *target.model.buffers()]
    assert not [t for t in tensors for start, end in mapped if start <= t.data_ptr() < end]
    model = target.model  # tied weights stay tied
    assert (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
        or not model.config.tie_word_embeddings
    )


def test_fingerprint_differences():
    a, b = make_tiny_target("llama").fingerprint, make_tiny_target("qwen2").fingerprint
    assert a.differences(a) == [] and any("architecture" in d for d in a.differences(b))


def test_directory_without_config(tmp_path):
    with pytest.raises(SelfspecError, match="no config.json"):
        load_target(tmp_path)


def test_hub_id_without_local_copy_is_an_offline_error():
    with pytest.raises(SelfspecError, match="no offline copy"):
        load_target("someone/not-a-cached-model")


def test_sliding_window_models_are_limited_to_their_window():
    assert make_tiny_target("gemma2").context_limit == 200
    assert make_tiny_target("llama").context_limit == 256


def test_with_eos_is_a_new_target_sharing_the_model_and_its_execution_path():
    target = make_tiny_target("llama")
    path = target.execution
    plain = target.with_eos(())
    assert plain.eos_token_ids == () and target.eos_token_ids == (2,)  # the original keeps its own
    assert plain.model is target.model and plain.execution is path and plain.path == target.path
    assert plain.with_eos([5, 7]).eos_token_ids == (5, 7)
