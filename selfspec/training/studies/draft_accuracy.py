"""Teacher-forced draft accuracy of trained heads on the target's own greedy continuations of held-out prompts
(MT-bench, HumanEval, held-out ShareGPT): the chance that a whole chain of d drafts is right, which is what a chain
drafter gets accepted. The data-scaling and accuracy studies in scripts/ measure heads with these.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...decoding import speculative_generate
from ...heads import create_drafter
from ...heads.dflash import DFlashHead
from ...heads.eagle import EagleConfig, EagleFamilyHead
from ...heads.medusa import MedusaHeads
from ...models import Target
from ..data.prompt_sets import load_prompt_set
from ..recipes.eagle import EagleTraining

PROMPT_SETS = ("mtbench", "humaneval", "sharegpt")

Continuations = dict[str, list[tuple[torch.Tensor, int]]]  # prompt set -> [(prompt + continuation [L], prompt length)]


def greedy_continuations(target: Target, cache_dir: Path, per_set: int, new_tokens: int) -> Continuations:
    """The first `per_set` prompts of each set, each with the target's greedy continuation of `new_tokens` tokens;
    cached in `cache_dir`, so a rerun (or another study sharing the directory) reuses them."""
    path = cache_dir / f"eval-{per_set}x{new_tokens}.pt"
    if path.is_file():
        return torch.load(path)
    plain = create_drafter("none", target)
    sets = {}
    for name in PROMPT_SETS:
        rows = []
        for item in load_prompt_set(name, per_set):
            ids = target.encode_prompt(item.text, chat=True).view(-1)
            tokens, _ = speculative_generate(target, plain, ids, new_tokens)
            rows.append((torch.cat([ids.cpu(), torch.tensor(tokens)]), len(ids)))
        sets[name] = rows
    torch.save(sets, path)
    return sets


def eagle_chain_accuracy(
    target: Target, head: EagleFamilyHead, config: EagleConfig, rows, depth: int = 3
) -> list[float]:
    """P(drafts 1..d all equal the target's greedy tokens), d = 1..depth, over the continuation positions of `rows`
    (an EAGLE or an EAGLE-3 head: the features are whichever layers the head reads)."""
    unroller = EagleTraining(head, config).eval()
    hits, total = torch.zeros(depth), 0
    with torch.inference_mode():
        for sequence, prompt_length in rows:
            outputs = target.model(input_ids=sequence.view(1, -1).to(target.device), output_hidden_states=True)
            hidden = {layer: outputs.hidden_states[layer][0, :-1].float() for layer in head.feature_layers}
            features = head.fuse(head.gather_features(hidden))  # row t: feature t
            greedy = outputs.logits[0].argmax(-1).cpu()  # greedy[i]: the target's token after position i
            ids = sequence.view(1, -1)
            correct = []
            for step, predicted in enumerate(unroller.unroll(features.unsqueeze(0), ids, depth)):
                # row t at step s drafts the token after position t + s + 1
                draft = head.draft_vocab[head.draft_logits(predicted[0]).argmax(-1)].cpu()
                want = torch.full_like(draft, -1)
                want[: len(want) - step] = greedy[1 + step :][: len(want) - step]
                correct.append(draft == want)
            rows_used = range(prompt_length - 1, len(sequence) - 1 - depth)  # roots inside the continuation
            chain = torch.ones(len(rows_used), dtype=torch.bool)
            for step in range(depth):
                chain &= correct[step][rows_used.start : rows_used.stop]
                hits[step] += chain.sum()
            total += len(rows_used)
    return [round(float(h) / max(1, total), 4) for h in hits]


def dflash_chain_accuracy(target: Target, head: DFlashHead, rows, depths: tuple[int, ...] = (1, 2, 4)) -> list[float]:
    """P(block drafts 1..d all equal the target's greedy tokens) for d in `depths`, every continuation position of
    `rows` an anchor."""
    hits, total = torch.zeros(len(depths)), 0
    deepest = max(depths)
    with torch.inference_mode():
        for sequence, prompt_length in rows:
            if len(sequence) - deepest <= prompt_length:  # no anchor: the target stopped within `deepest` tokens
                continue
            ids = sequence.view(1, -1).to(target.device)
            hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
            features = torch.cat([hidden[layer] for layer in head.feature_layers], dim=-1).float()
            anchors = torch.arange(prompt_length, len(sequence) - deepest).view(1, -1)  # slot i drafts token a + i
            outputs = head.blocks(features, ids, anchors)[0, :, 1 : deepest + 1]  # [A, deepest, H]
            drafts = head.draft_vocab[head.draft_logits(outputs).argmax(-1)].cpu()
            want = sequence[anchors.view(-1, 1) + torch.arange(1, deepest + 1)]  # the continuation is greedy
            right = (drafts == want).cumprod(dim=1)
            for index, depth in enumerate(depths):
                hits[index] += right[:, depth - 1].sum()
            total += anchors.shape[1]
    return [round(float(h) / max(1, total), 4) for h in hits]


def medusa_chain_accuracy(target: Target, heads: MedusaHeads, rows, depth: int = 3) -> list[float]:
    """P(the top-1 drafts of heads 1..d all equal the target's greedy tokens), d = 1..depth: from the last hidden
    state at position t (whose own next token t + 1 the target gives), head k drafts token t + k + 1 (k from 1)."""
    depth = min(depth, heads.num_heads)
    hits, total = torch.zeros(depth), 0
    with torch.inference_mode():
        for sequence, prompt_length in rows:
            roots = torch.arange(prompt_length - 1, len(sequence) - 1 - depth)  # roots inside the continuation
            if len(roots) == 0:
                continue
            ids = sequence.view(1, -1).to(target.device)
            hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, roots]  # [N, H]
            logits = heads.draft_logits(heads.head_states(hidden.to(heads.draft_lm_weight.dtype))[:depth])
            drafts = heads.draft_vocab[logits.argmax(-1)].cpu()  # [depth, N]
            want = sequence[roots.view(1, -1) + torch.arange(2, depth + 2).view(-1, 1)]  # the continuation is greedy
            right = (drafts == want).cumprod(dim=0)
            hits += right.sum(dim=1).float()
            total += len(roots)
    return [round(float(h) / max(1, total), 4) for h in hits]
