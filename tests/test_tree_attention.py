"""The tree as data, its mask, the forward over it and cache compaction, checked against plain causal forwards."""

from __future__ import annotations

import pytest
import torch

from selfspec.cost import load_cost_curve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import Drafter
from selfspec.sampling import SamplingConfig
from selfspec.tree_attention import (
    DraftTree,
    ancestor_matrix,
    build_tree_inputs,
    chunk_forward,
    compact_cache,
    tree_forward,
    verify,
)

from .helpers import CORE_FAMILIES, make_tiny_target

# root -> a(1), b(2); a -> c(3), d(4); b -> e(5); d -> f(6)
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def example_tree(tokens=(11, 20, 21, 30, 31, 32, 40)) -> DraftTree:
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(TREE_PARENTS))


def test_tree_structure_and_paths():
    tree = example_tree()
    assert tree.depth_list == (0, 1, 1, 2, 2, 2, 3)
    assert tree.children(0) == (1, 2) and tree.children(1) == (3, 4) and tree.children(6) == ()
    assert tree.path_to(6) == [0, 1, 4, 6]
    pruned = tree.pruned(2)
    assert pruned.tokens.tolist() == [11, 20, 21, 30, 31, 32] and pruned.parent_list == (-1, 0, 0, 1, 1, 2)


def test_from_paths_merges_shared_prefixes():
    tree = DraftTree.from_paths(5, [[1, 2, 3], [1, 2, 4], [7]])
    assert tree.tokens.tolist() == [5, 1, 2, 3, 4, 7]
    assert tree.parent_list == (-1, 0, 1, 2, 2, 0)


def test_bad_tree_is_rejected():
    # Public contract checks raise (not assert), so they hold under `python -O` too.
    with pytest.raises(SelfspecError, match=r"parents\[1\] = 2: a node's parent must come before it"):
        DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 2, 0]))
    with pytest.raises(SelfspecError, match="node 0 must be the root"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, 0]))
    with pytest.raises(SelfspecError, match="one shape"):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1]))
    with pytest.raises(SelfspecError, match="one row of logits per tree node"):
        verify(DraftTree.root_only(1), torch.zeros(2, 5), SamplingConfig())


def test_a_tree_rooted_at_the_wrong_token_is_a_clear_error():
    class WrongRoot(Drafter):
        def propose(self, request):
            return DraftTree.root_only(request.root_token + 1)

    target = make_tiny_target("llama")
    drafter = WrongRoot(target, load_cost_curve("cpu", target.name))
    with pytest.raises(SelfspecError, match="rooted its tree at token .* not at the last committed token"):
        speculative_generate(target, drafter, torch.tensor([1, 5, 7]), 4)


def test_mask_and_positions():
    tree = example_tree()
    visible = ancestor_matrix(tree)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node in range(7):
        for ancestor in tree.path_to(node):
            expected[node, ancestor] = True
    assert torch.equal(visible, expected)
    inputs = build_tree_inputs(tree, prefix_len=4, dtype=torch.float32, device="cpu")
    assert inputs.position_ids.tolist() == [[4, 5, 5, 6, 6, 6, 7]]
    mask = inputs.attention_mask[0, 0]
    assert mask.shape == (7, 11)
    assert torch.all(mask[:, :4] == 0)  # everyone sees the cached prefix
    assert torch.equal(mask[:, 4:] == 0, expected)


@pytest.mark.parametrize("family", CORE_FAMILIES + ["gemma2"])
def test_node_logits_equal_chain_logits_and_compacted_cache_equals_prefill(family):
    target = make_tiny_target(family)
    model = target.model
    prefix = [1, 9, 4, 22, 13]
    tree = example_tree()
    with torch.inference_mode():
        cache = target.new_cache()
        chunk_forward(model, cache, torch.tensor([prefix[:-1]]))
        prefix_len = len(prefix) - 1
        tree = example_tree(tokens=(prefix[-1], 20, 21, 30, 31, 32, 40))
        output = tree_forward(model, cache, build_tree_inputs(tree, prefix_len, torch.float32, "cpu"), (1, -1))
        for node in range(tree.size):
            chain = prefix[:-1] + [tree.token_list[i] for i in tree.path_to(node)]
            plain = model(torch.tensor([chain]), output_hidden_states=True)
            torch.testing.assert_close(output.logits[node], plain.logits[0, -1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(output.hidden[-1][node], plain.hidden_states[-1][0, -1], rtol=1e-4, atol=1e-4)
        # Accept root -> b -> e (non-contiguous in the layout): the cache must equal a fresh prefill of that path.
        accepted = (0, 2, 5)
        compact_cache(cache, tree.size, accepted)
        fresh = target.new_cache()
        chunk_forward(model, fresh, torch.tensor([prefix[:-1] + [tree.token_list[i] for i in accepted]]))
        assert cache.get_seq_length() == fresh.get_seq_length() == prefix_len + len(accepted)
        for layer, fresh_layer in zip(cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(layer.keys, fresh_layer.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.values, fresh_layer.values, rtol=1e-4, atol=1e-5)


def test_chain_compaction_trims():
    target = make_tiny_target("llama")
    with torch.inference_mode():
        cache = target.new_cache()
        chunk_forward(target.model, cache, torch.tensor([[1, 2, 3]]))
        chain = DraftTree(tokens=torch.tensor([4, 5, 6, 7]), parents=torch.tensor([-1, 0, 1, 2]))
        tree_forward(target.model, cache, build_tree_inputs(chain, 3, torch.float32, "cpu"))
        compact_cache(cache, 4, (0, 1))
        assert cache.get_seq_length() == 5


def test_chain_needs_no_custom_mask_and_matches_the_masked_path():
    target = make_tiny_target("qwen3")
    chain = DraftTree(tokens=torch.tensor([4, 5, 6]), parents=torch.tensor([-1, 0, 1]))
    inputs = build_tree_inputs(chain, 3, torch.float32, "cpu")
    assert inputs.attention_mask is None and inputs.position_ids.tolist() == [[3, 4, 5]]
    with torch.inference_mode():
        cache = target.new_cache()
        chunk_forward(target.model, cache, torch.tensor([[1, 2, 3]]))
        plain = tree_forward(target.model, cache, inputs).logits
        reference = target.model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits[0, 3:]
    torch.testing.assert_close(plain, reference, rtol=1e-4, atol=1e-4)
