"""The contract every registered drafter meets, run over the registry itself (PEFT's common-tester idea):

- greedy output equals transformers' own greedy decoding on every core architecture family, at several budgets;
- sampled output follows the target's distribution (chi-square through the real loop, mask and cache);
- seeded sampled output equals plain sampling (`none`) with the same seed, token for token, whatever the drafter's
  state (position-keyed draws);
- trained heads or tuned data survive a save/load round trip with identical drafts, and refuse another base model;
- options parse the same from a spec string and from keyword arguments, typed, and unknown ones are a clear error.

A drafter registered later (a plugin, a new module) joins the suite by registering: parameter-free ones need nothing
more; ones that read artifacts need a CASES entry that makes random ones, and the suite fails until they have it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.heads import (
    Drafter,
    create_drafter,
    drafter_entry,
    drafter_names,
    parse_drafter_options,
    register_drafter,
    unregister_drafter,
)
from selfspec.heads.artifacts import load_head, save_head
from selfspec.heads.base import DrafterStats
from selfspec.heads.layerskip import load_skip_file, save_skip_file
from selfspec.models import Target
from selfspec.options import format_option
from selfspec.sampling import SamplingConfig
from selfspec.tree_attention import DraftTree

from .helpers import (
    CORE_FAMILIES,
    FLAT,
    PROMPT,
    SAMPLING,
    VOCAB,
    chi_square_p_value,
    chi_target,
    expected_joint,
    hf_greedy,
    make_tiny_target,
    plain_greedy,
    random_dflash_dir,
    random_eagle3_dir,
    random_eagle_dir,
    random_medusa_dir,
    tuned_skip_file,
    without_eos,
)

BUILTIN = {"none", "ngram", "history", "medusa", "eagle", "eagle3", "dflash", "layerskip", "auto"}
CHI_PROMPT = [5, 3, 5]  # a prefill for the heads' hidden states, and a repeat for prompt lookup to copy
CHI_SAMPLES = 4_000


def _half(target: Target) -> torch.Tensor:
    return torch.arange(0, target.vocab_size, 2)  # a reduced draft vocabulary: every other id


def _resave_head(drafter_name: str) -> Callable[[Target, Path, Path], Path]:
    def resave(target: Target, source: Path, destination: Path) -> Path:
        config_cls = drafter_entry(drafter_name).config_cls
        artifact = load_head(source, drafter_name, config_cls, target)
        return save_head(
            destination, drafter_name, artifact.config, artifact.state, artifact.fingerprint, artifact.extra
        )

    return resave


def _resave_skip_file(target: Target, source: Path, destination: Path) -> Path:
    return save_skip_file(destination / "layerskip.json", load_skip_file(source, target))


@dataclass(frozen=True)
class Case:
    """How to exercise one drafter: random artifacts (None = parameter-free) and the options to run with."""

    make_artifacts: Callable[..., Path] | None = None  # (target, path, reduced_vocab: bool) -> heads path
    resave: Callable[[Target, Path, Path], Path] | None = None  # (target, source, destination dir) -> new path
    greedy_options: tuple[dict, ...] = ({},)
    chi_options: dict = field(default_factory=dict)
    drafts: bool | None = None  # whether it proposes anything on the test prompts (None: not checked)
    primed: bool = False  # serve one request first (a drafter that learns across requests drafts nothing in its first)


CASES: dict[str, Case] = {
    "none": Case(drafts=False),
    "ngram": Case(greedy_options=({}, {"max_candidates": 1, "max_draft": 2}), drafts=True),
    "history": Case(
        greedy_options=({}, {"max_candidates": 1, "max_draft": 2}, {"min_ngram": 1}), drafts=True, primed=True
    ),
    "medusa": Case(
        make_artifacts=lambda target, path, reduced: random_medusa_dir(
            target, path, draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_head("medusa"),
        greedy_options=({}, {"max_nodes": 4}, {"max_nodes": 12}),
        chi_options={"max_nodes": 7},
        drafts=True,
    ),
    "eagle": Case(
        make_artifacts=lambda target, path, reduced: random_eagle_dir(
            target, path, draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_head("eagle"),
        greedy_options=({}, {"max_nodes": 3}, {"fixed_nodes": 10, "top_k": 2}),
        chi_options={"max_nodes": 5, "top_k": 2, "depth": 2},
        drafts=True,
    ),
    "eagle3": Case(
        make_artifacts=lambda target, path, reduced: random_eagle3_dir(
            target, path, draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_head("eagle3"),
        greedy_options=({}, {"max_nodes": 3}, {"fixed_nodes": 10, "top_k": 2}),
        chi_options={"max_nodes": 5, "top_k": 2, "depth": 2},
        drafts=True,
    ),
    "dflash": Case(
        make_artifacts=lambda target, path, reduced: random_dflash_dir(
            target, path, draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_head("dflash"),
        greedy_options=({}, {"max_nodes": 2}, {"fixed_nodes": 10}),
        chi_options={"max_nodes": 5, "top_k": 2},
        drafts=True,
    ),
    "layerskip": Case(
        make_artifacts=lambda target, path, reduced: tuned_skip_file(
            target, path / "layerskip.json", draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_skip_file,
        greedy_options=({}, {"branch_threshold": 0.9, "threshold": 0.2}, {"adaptive": False, "max_draft": 2}),
        chi_options={"branch_threshold": 1.0, "max_draft": 2},
        drafts=True,
    ),
    "auto": Case(  # one tree merged from prompt lookup and an EAGLE head (the heads directory goes to its kind)
        make_artifacts=lambda target, path, reduced: random_eagle_dir(
            target, path, draft_vocab=_half(target) if reduced else None
        ),
        resave=_resave_head("eagle"),
        greedy_options=({}, {"sources": ("ngram", "eagle"), "max_nodes": 4}, {"sources": ("eagle", "ngram")}),
        chi_options={"sources": ("ngram", "eagle"), "max_nodes": 6},
        drafts=True,
    ),
}


def contract_names() -> list[str]:
    """Every registered drafter: what the suite is parametrised over (read at collection time)."""
    return drafter_names()


def case_for(name: str) -> Case:
    if name in CASES:
        return CASES[name]
    if drafter_entry(name).has_artifacts:
        pytest.fail(f"drafter '{name}' reads trained heads or tuned data: add a CASES entry that makes random ones")
    return Case()


def build(name: str, target: Target, tmp_path: Path, reduced: bool = False, **options) -> Drafter:
    case = case_for(name)
    heads = (
        None if case.make_artifacts is None else case.make_artifacts(target, tmp_path / f"{name}-{reduced}", reduced)
    )
    drafter = create_drafter(name, target, heads, **options)
    drafter.cost_curve = FLAT  # free trees: the largest the options allow get verified
    return drafter


def check_greedy(name: str, family: str, tmp_path: Path, path: str = "fast") -> None:
    case = case_for(name)
    target = without_eos(make_tiny_target(family, path=path))
    # transformers' generate runs the model as it is; the q4 path's LM head rounds to bfloat16: its own plain decoding
    reference = plain_greedy(target, PROMPT, 30) if path == "q4" else hf_greedy(target, PROMPT, 30, eos=-1)
    for reduced in (False, True) if case.make_artifacts else (False,):
        for options in case.greedy_options:
            drafter = build(name, target, tmp_path, reduced, **options)
            if case.primed:  # a request that shares the prompt's tail but not its output
                speculative_generate(target, drafter, torch.tensor(PROMPT[len(PROMPT) // 2 :]), 12)
            tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 30)
            assert list(tokens) == reference, f"{name} {family} reduced={reduced} {options}"
            if case.drafts is not None:
                assert (max(stats.tree_sizes) > 1) == case.drafts, (
                    f"{name} {options}: tree sizes {set(stats.tree_sizes)}"
                )
            budget = options.get("fixed_nodes") or options.get("max_nodes")
            assert budget is None or max(stats.tree_sizes) <= budget
            assert isinstance(drafter.stats(), DrafterStats)  # what the faces read instead of drafter-specific fields


# ---- the registry is the suite's table -------------------------------------------------------------------------------


def test_every_builtin_drafter_is_registered_and_has_a_case():
    missing = BUILTIN - set(drafter_names())
    assert not missing, f"built-in drafters no longer registered: {sorted(missing)}"
    for name in contract_names():
        case_for(name)  # fails for a drafter with artifacts and no way to make them


def test_a_new_registration_joins_the_suite(tmp_path):
    @register_drafter("contract-probe")
    class ProbeDrafter(Drafter):
        def propose(self, request):  # the root token twice over: a chain the loop verifies (and mostly rejects)
            depth = min(2, request.max_depth)
            return DraftTree.from_paths(request.root_token, [[request.root_token] * depth] if depth else [])

    target = make_tiny_target("llama")
    try:
        assert "contract-probe" in contract_names()  # parametrised over at the next collection
        assert case_for("contract-probe") == Case()  # parameter-free: the default case serves it
        drafter = build("contract-probe", target, tmp_path)
        assert type(drafter) is ProbeDrafter and drafter_entry("contract-probe").drafter_cls is ProbeDrafter
        _, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 8, pace=False)
        assert max(stats.tree_sizes) == 3  # its trees reach the verifier
        check_greedy("contract-probe", "llama", tmp_path)
        with pytest.raises(SelfspecError, match=r"^unknown drafter 'contract-prob': choose one of .*contract-probe"):
            create_drafter("contract-prob", target)
    finally:
        unregister_drafter("contract-probe")
    assert "contract-probe" not in contract_names()
    with pytest.raises(SelfspecError, match="unknown drafter 'contract-probe'"):
        create_drafter("contract-probe", target)


# ---- the contract, per registered drafter ----------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["stock", "fast"])
@pytest.mark.parametrize("family", CORE_FAMILIES)
@pytest.mark.parametrize("name", contract_names())
def test_greedy_equals_plain_greedy(name, family, kernels, tmp_path):
    check_greedy(name, family, tmp_path, kernels)


@pytest.mark.parametrize("name", contract_names())
def test_greedy_equals_plain_greedy_on_the_four_bit_path(name, tmp_path):
    # Each drafter on another family, so the suite covers them all at one run per drafter.
    check_greedy(name, CORE_FAMILIES[contract_names().index(name) % len(CORE_FAMILIES)], tmp_path, "q4")


@pytest.mark.parametrize("four_bit", [False, True], ids=["fast", "q4"])
@pytest.mark.parametrize("name", contract_names())
def test_sampling_follows_the_target_distribution(name, four_bit, tmp_path):
    # Losslessness on the path decoding runs by default (and on the 4-bit one); each drafter on another architecture
    # family (shifted by one on q4), so the suite covers them all at the cost of one run per drafter and path.
    family = CORE_FAMILIES[(contract_names().index(name) + four_bit) % len(CORE_FAMILIES)]
    target = chi_target(num_hidden_layers=2, path="q4" if four_bit else "fast", family=family)
    drafter = build(name, target, tmp_path, **case_for(name).chi_options)
    counts, drafted = torch.zeros(VOCAB, VOCAB), 0
    for seed in range(CHI_SAMPLES):
        tokens, stats = speculative_generate(target, drafter, torch.tensor(CHI_PROMPT), 2, SAMPLING, seed=seed)
        counts[tokens[0], tokens[1]] += 1
        drafted += stats.tree_sizes[0] > 1
    if case_for(name).drafts is not None:
        assert (drafted > CHI_SAMPLES // 2) == case_for(name).drafts, (
            f"{name} drafted on {drafted} of {CHI_SAMPLES} first steps"
        )
    p_value = chi_square_p_value(counts, expected_joint(target, CHI_PROMPT))
    assert p_value > 1e-3, (
        f"{name} ({family}): sampled distribution differs from the target's (chi-square p = {p_value:.2e})"
    )


SEEDED = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("family", CORE_FAMILIES)
@pytest.mark.parametrize("name", contract_names())
def test_seeded_sampling_equals_plain_sampling(name, family, tmp_path):
    # The token at output position t is drawn with a uniform keyed on (seed, t): with deterministic children every
    # drafter emits what `none` emits for that seed, at any budget, after any earlier requests through it.
    case = case_for(name)
    target = without_eos(make_tiny_target(family))
    plain = create_drafter("none", target)
    budgets, seeds = (30, 7), (0, 1, 2)
    reference = {
        (budget, seed): speculative_generate(target, plain, torch.tensor(PROMPT), budget, SEEDED, seed=seed)[0]
        for budget in budgets
        for seed in seeds
    }
    drafted = 0  # steps that verified a tree, over every option set (a paced drafter may sit some out)
    for reduced in (False, True) if case.make_artifacts else (False,):
        for options in case.greedy_options:
            drafter = build(name, target, tmp_path, reduced, **options)
            # Other requests first (other prompts and seeds): state carried across requests must not move the text.
            # They are paced (pauses carry over); the checked ones are not, so every step verifies a tree.
            for seed in (5, 6):
                speculative_generate(target, drafter, torch.tensor(PROMPT[seed:]), 12, SEEDED, seed=seed)
            for (budget, seed), expected in reference.items():
                tokens, stats = speculative_generate(
                    target, drafter, torch.tensor(PROMPT), budget, SEEDED, seed=seed, pace=False
                )
                assert tokens == expected, f"{name} {family} reduced={reduced} {options} budget={budget} seed={seed}"
                drafted += sum(size > 1 for size in stats.tree_sizes)
    if case.drafts is not None:
        assert (drafted > 0) == case.drafts, f"{name} {family}: drafted on {drafted} steps"


@pytest.mark.parametrize("name", contract_names())
def test_artifacts_round_trip_and_refuse_another_base(name, tmp_path):
    case = case_for(name)
    target = without_eos(make_tiny_target("llama"))
    if case.make_artifacts is None:
        with pytest.raises(SelfspecError, match="has no trained heads"):
            create_drafter(name, target, tmp_path)
        return
    source = case.make_artifacts(target, tmp_path / "source", True)
    copy = case.resave(target, source, tmp_path / "copy")
    runs = []
    for heads in (source, copy):
        drafter = create_drafter(name, target, heads)
        drafter.cost_curve = FLAT
        # Unpaced: pausing follows wall-clock timings, which differ between any two runs.
        tokens, stats = speculative_generate(target, drafter, torch.tensor(PROMPT), 20, pace=False)
        runs.append((tokens, stats.tree_sizes, stats.accepted_lengths))
    assert runs[0] == runs[1], f"{name}: drafts changed across a save/load round trip"
    with pytest.raises(SelfspecError, match="for another base model"):
        create_drafter(name, make_tiny_target("qwen2", num_hidden_layers=3), source)


@pytest.mark.parametrize("name", contract_names())
def test_options_parse_typed_from_specs_and_keywords(name):
    entry = drafter_entry(name)
    hints = typing.get_type_hints(entry.options_cls)
    for option in dataclasses.fields(entry.options_cls):
        text, value = _sample_value(hints[option.name], option.default)
        _, from_spec = parse_drafter_options(f"{name}:{option.name}={text}")
        _, from_keyword = parse_drafter_options(name, **{option.name: value})
        assert getattr(from_spec, option.name) == value and type(getattr(from_spec, option.name)) is type(value)
        assert from_spec == from_keyword
        described = f"{name}:{option.name}={format_option(value)}"
        assert parse_drafter_options(described)[1] == from_spec  # what `describe()` prints parses back
    with pytest.raises(SelfspecError, match=f"drafter '{name}' options: unknown key.*nonsense.*valid keys"):
        parse_drafter_options(f"{name}:nonsense=1")
    with pytest.raises(SelfspecError, match="not KEY=VALUE"):
        parse_drafter_options(f"{name}:oops")


def _sample_value(hint, default) -> tuple[str, object]:
    """A valid value of an option's type, as typed on a command line and as Python."""
    options = set(typing.get_args(hint)) or {hint}
    tuples = [option for option in options if typing.get_origin(option) is tuple]
    if tuples:
        return ("ngram+eagle", ("ngram", "eagle")) if typing.get_args(tuples[0])[0] is str else ("1+2", (1, 2))
    if bool in options:
        return ("false", False) if default is not False else ("true", True)
    if int in options:
        return "2", 2
    if float in options:
        return "0.5", 0.5
    return str(default), default
