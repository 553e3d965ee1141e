"""The target's execution paths: the fast CPU path (pre-packed linear weights, grouped-head attention under tree
masks, a KV cache written in place) computes what the stock modules compute, puts them back whatever happens, and
decoding through either path equals plain greedy decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from selfspec.cli import main
from selfspec.cost import CostCurve, load_cost_curve, profile_path, save_cost_curve, target_cost_curve
from selfspec.decoding import speculative_generate
from selfspec.errors import SelfspecError
from selfspec.execution import (
    CALIBRATION_ROWS,
    GROUPED_SDPA,
    STOCK_ROWS_ENV,
    CompiledStep,
    ExecutionPath,
    InPlaceLayer,
    PackedLinear,
    RowDispatch,
    SharedInputLinear,
    SharedInputProduct,
    packed_linear,
)
from selfspec.execution import calibration as calibration_module
from selfspec.execution import native as native_module
from selfspec.execution.compiled import FEW_ROWS_ENV, SPLIT_REVISION, SPLIT_SIZES
from selfspec.heads import create_drafter
from selfspec.models import Target, load_target
from selfspec.tree_attention import DraftTree, build_tree_inputs, chunk_forward, compact_cache, tree_forward, trim_cache

from .helpers import (
    CORE_FAMILIES,
    FAMILIES,
    PROMPT,
    hf_greedy,
    make_tiny_target,
    model_as_made,
    random_dflash_dir,
    random_eagle_dir,
    random_medusa_dir,
    without_eos,
)


def linear_types(model) -> set[type]:
    return {
        type(module)
        for module in model.modules()
        if isinstance(module, (torch.nn.Linear, PackedLinear, SharedInputLinear))
    }


FAST_LINEARS = {PackedLinear, SharedInputLinear}  # the target's q/k/v projections run as one GEMM


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_layers_equal_the_stock_ones(family):
    target = make_tiny_target(family, path="fast")
    assert make_tiny_target(family).execution.name == "stock"  # auto: too small for packing to pay
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        stock = target.model(tokens, output_hidden_states=True)
        with target.execution.active():
            assert linear_types(target.execution.runner) == FAST_LINEARS  # in the path's twin of the model
            assert linear_types(target.model) == {torch.nn.Linear}  # the model keeps its own
            fast = target.forward(tokens, output_hidden_states=True)
    torch.testing.assert_close(fast.logits, stock.logits, atol=1e-4, rtol=1e-4)
    for fast_hidden, stock_hidden in zip(fast.hidden_states, stock.hidden_states, strict=True):
        torch.testing.assert_close(fast_hidden, stock_hidden, atol=1e-4, rtol=1e-4)


def test_projections_sharing_an_input_run_as_one_product_in_any_call_order():
    """q/k/v as one GEMM: each member returns what its own linear layer computes, whichever member is called first,
    and one called alone or with another input recomputes rather than handing out a stale output."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(24, 24), torch.nn.Linear(24, 8, bias=False), torch.nn.Linear(24, 8)]
    product = SharedInputProduct(layers, RowDispatch())
    members = [SharedInputLinear(layer, product, index) for index, layer in enumerate(layers)]
    first, second = torch.randn(1, 5, 24), torch.randn(1, 5, 24)
    with torch.inference_mode():
        for order in ((0, 1, 2), (2, 0, 1), (1, 1, 0, 2)):
            for index in order:
                torch.testing.assert_close(members[index](first), layers[index](first), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(members[0](first), layers[0](first), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(members[1](second), layers[1](second), atol=1e-5, rtol=1e-5)  # another input
        torch.testing.assert_close(members[2](first), layers[2](first), atol=1e-5, rtol=1e-5)
        for member in members:
            member(second)
        assert product.input is None  # every output handed out: nothing held
        assert members[0](first).is_contiguous() and members[0](first).shape == (1, 5, 24)


def test_row_dispatch_sends_few_rows_to_the_stock_kernel():
    """Below stock_rows rows a packed layer (alone or sharing its input) gives exactly what the stock kernel does; from
    there on exactly what the packed one does."""
    torch.manual_seed(0)
    dispatch = RowDispatch(stock_rows=3)
    layers = [torch.nn.Linear(24, 40), torch.nn.Linear(24, 8, bias=False)]
    single = PackedLinear(layers[0], dispatch)
    shared = [
        SharedInputLinear(layer, SharedInputProduct(layers, dispatch), index) for index, layer in enumerate(layers)
    ]
    with torch.inference_mode():
        for rows in (1, 2, 3, 5):
            hidden = torch.randn(1, rows, 24)
            packed = packed_linear(hidden, single.packed, single._bias, 40)
            want = layers[0](hidden) if rows < 3 else packed
            assert torch.equal(single(hidden), want)
            outputs = [member(hidden) for member in shared]
            for output, layer, _member in zip(outputs, layers, shared, strict=True):
                if rows < 3:
                    assert torch.equal(output, layer(hidden))
                else:
                    torch.testing.assert_close(output, layer(hidden), atol=1e-5, rtol=1e-5)


def test_the_stock_row_split_is_measured_once_per_machine_and_stored(tmp_path, monkeypatch):
    """(Every timing counts as quiet here: the suite's other worker can make this machine look busy, and a busy
    verdict is not stored, by design.)"""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(STOCK_ROWS_ENV)
    monkeypatch.setattr(calibration_module, "BUSY_SPREAD", float("inf"))
    target = make_tiny_target("llama", path="fast")
    with target.execution.active():
        pass
    measured = target.execution.dispatch
    stored = list((tmp_path / "profiles").glob("*-rows.json"))
    assert measured.source.startswith("measured") and len(stored) == 1
    report = json.loads(stored[0].read_text())
    assert report["stock_rows"] == measured.stock_rows and 1 <= measured.stock_rows <= max(CALIBRATION_ROWS) + 1
    assert sorted(map(int, report["ms_stock_packed"])) == list(CALIBRATION_ROWS)
    again = make_tiny_target("llama", path="fast").execution  # another path, same shapes: read, not measured
    with again.active():
        pass
    assert again.dispatch.source == str(stored[0]) and again.dispatch.stock_rows == measured.stock_rows
    monkeypatch.setenv(STOCK_ROWS_ENV, "5")
    fixed = make_tiny_target("llama", path="fast").execution
    with fixed.active():
        pass
    assert fixed.dispatch.stock_rows == 5 and fixed.dispatch.source == f"${STOCK_ROWS_ENV}"


TREE = DraftTree(tokens=torch.tensor([17, 5, 9, 33, 40, 8, 5]), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_tree_forward_on_the_fast_path_equals_the_stock_one(family):
    """Under a tree mask the fast path's attention reads the grouped key/value heads without repeating them, and its
    cache is written in place: logits and the cache after compaction match the stock path's."""
    target = make_tiny_target(family, path="fast")
    stock = ExecutionPath(target.model, "stock")
    prefix = torch.tensor([PROMPT])
    results = {}
    with torch.inference_mode():
        for name, path in (("stock", stock), ("fast", target.execution)):
            with path.active():
                if name == "fast":  # grouped key/value heads (2 per 4 query heads), read as they are
                    assert path.runner.config._attn_implementation == GROUPED_SDPA
                cache = path.new_cache()
                chunk_forward(path.forward, cache, prefix)
                output = tree_forward(path.forward, cache, build_tree_inputs(TREE, len(PROMPT), target.dtype, "cpu"))
                compact_cache(cache, TREE.size, (0, 2, 5))  # a second child wins: a gather, not a trim
                results[name] = output.logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    assert target.config._attn_implementation == "sdpa"  # the model's own config is never changed
    torch.testing.assert_close(results["fast"][0], results["stock"][0], atol=1e-4, rtol=1e-4)
    for (fast_keys, fast_values), (keys, values) in zip(results["fast"][1], results["stock"][1], strict=True):
        torch.testing.assert_close(fast_keys, keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast_values, values, atol=1e-5, rtol=1e-5)


def test_the_in_place_cache_equals_a_fresh_prefill_after_compaction_and_growth():
    """Steps of trees with non-contiguous accepted paths, past the storage first reserved (so it grows), then a trim:
    the cache holds exactly what one prefill of the committed tokens computes."""
    target = make_tiny_target("llama", path="fast", max_position_embeddings=512)
    generator = torch.Generator().manual_seed(0)
    committed = list(PROMPT)
    with torch.inference_mode(), target.execution.active():
        cache = target.new_cache()
        assert all(type(layer) is InPlaceLayer for layer in cache.layers)
        chunk_forward(target.forward, cache, torch.tensor([committed[:-1]]))
        for step in range(90):  # 3 tokens a step: past the 256 positions reserved at first
            tokens = torch.randint(3, 96, (TREE.size,), generator=generator)
            tokens[0] = committed[-1]
            tree = DraftTree(tokens=tokens, parents=TREE.parents)
            tree_forward(target.forward, cache, build_tree_inputs(tree, len(committed) - 1, target.dtype, "cpu"))
            path = (0, 1, 3) if step % 2 else (0, 2, 5)
            compact_cache(cache, tree.size, path)
            committed.extend(tree.token_list[i] for i in path[1:])
            committed.append(int(tokens[-1]))  # the step's own token, whose KV comes with the next tree's root
        assert cache.get_seq_length() == len(committed) - 1 > 256
        trim_cache(cache, 100)
        fresh = target.new_cache()
        chunk_forward(target.forward, fresh, torch.tensor([committed[:100]]))
    for layer, reference in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(layer.keys, reference.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, reference.values, atol=1e-4, rtol=1e-4)
    with pytest.raises(AttributeError, match="storage"):  # keys are views of the storage: no other tensor replaces them
        cache.layers[0].keys = cache.layers[0].keys.clone()


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_every_path_leaves_the_model_as_transformers_made_it(family, tmp_path):
    """The execution path is something the loop calls: decoding on `stock` and `fast`, with a drafter that runs the
    target's own layers (layer-skip) and one with heads, leaves the model's modules, parameters, config and forward
    as they were (the compiled path: test_compiled)."""
    target = make_tiny_target(family, path="fast")
    made = model_as_made(target.model)
    prompt = torch.tensor([PROMPT])
    outputs = []
    for kernels in ("stock", "fast"):
        on_path = Target(target.model, None, target.name, path=kernels).with_eos(())
        for name, heads in (("layerskip:skip=every-other", None), ("eagle", random_eagle_dir(target, tmp_path / "e"))):
            drafter = create_drafter(name, on_path, heads)
            tokens, _ = speculative_generate(on_path, drafter, prompt, max_new_tokens=12)
            outputs.append(tokens)
            assert model_as_made(target.model) == made, (kernels, name)
    assert len(set(outputs)) == 1  # greedy: every drafter and path gives the same text
    with pytest.raises(RuntimeError, match="boom"), target.execution.active():
        raise RuntimeError("boom")
    assert model_as_made(target.model) == made


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_greedy_is_plain_greedy_on_both_paths(family, tmp_path):
    outputs = {}
    for kernels in ("stock", "fast"):
        base = without_eos(make_tiny_target(family))
        target = Target(model=base.model, tokenizer=None, name=base.name, path=kernels).with_eos(())
        assert target.execution.name == kernels
        reference = hf_greedy(target, PROMPT, 24, eos=-1)
        for spec, heads in (
            ("none", None),
            ("ngram", None),
            ("eagle:fixed_nodes=6", random_eagle_dir(target, tmp_path / kernels)),
        ):
            tokens, _ = speculative_generate(target, create_drafter(spec, target, heads), torch.tensor(PROMPT), 24)
            assert list(tokens) == reference, f"{family} {kernels} {spec}"
        outputs[kernels] = reference
    assert outputs["stock"] == outputs["fast"]


def test_kernel_choices_are_checked(tiny_checkpoint, capsys):
    with pytest.raises(SelfspecError, match="the execution path must be one of auto, stock, fast"):
        load_target(str(tiny_checkpoint), path="turbo")
    bf16 = make_tiny_target("llama")
    bf16.model.to(torch.bfloat16)
    with pytest.raises(SelfspecError, match="packs float32 weights.*use --path stock or auto"):
        ExecutionPath(bf16.model, "fast")
    assert ExecutionPath(bf16.model, "auto").name == "stock"
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_checkpoint),
                "--prompt",
                "the cat",
                "--path",
                "fast",
                "--dtype",
                "bfloat16",
                "--max-new-tokens",
                "4",
            ]
        )
        == 2
    )
    assert "packs float32 weights" in capsys.readouterr().err


def test_profile_reports_both_paths(tiny_checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    assert main(["profile", "--model", str(tiny_checkpoint), "--cache-length", "16", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["ms"]) == {"stock", "fast"} and all(len(v) == len(report["sizes"]) for v in report["ms"].values())
    stored = sorted(path.name for path in (tmp_path / "cache" / "profiles").iterdir())
    assert len(stored) == 2 and stored[0].endswith("--fast.json") and stored[1].endswith("--stock.json")
    target = load_target(str(tiny_checkpoint), path="fast")
    assert create_drafter("ngram", target).cost_curve.source.endswith("--fast.json")  # drafters read the path in use
    assert create_drafter("ngram", load_target(str(tiny_checkpoint))).cost_curve.source.endswith("--stock.json")
    assert main(["profile", "--model", str(tiny_checkpoint), "--cache-length", "16", "--repeats", "1"]) == 0
    assert "x stock@1" in capsys.readouterr().out


def test_profile_recalibrate_measures_the_row_split_anew(tiny_checkpoint, capsys, tmp_path, monkeypatch):
    """A stored row split is read as it is (even one measured on a busy machine) until `--recalibrate` measures and
    stores it anew; asking that of the stock kernels alone is refused in one line. (Every timing counts as quiet here:
    the suite's other worker can make this machine look busy, and a busy verdict is not stored, by design.)"""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(STOCK_ROWS_ENV, raising=False)
    monkeypatch.setattr(calibration_module, "BUSY_SPREAD", float("inf"))
    args = ["profile", "--model", str(tiny_checkpoint), "--cache-length", "8", "--repeats", "1", "--json"]
    assert main(args) == 0
    capsys.readouterr()
    (stored,) = (tmp_path / "cache" / "profiles").glob("*-rows.json")
    stored.write_text(json.dumps({"stock_rows": 99}))  # a wrong verdict, as a loaded moment can leave
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["fast_stock_rows"] == 99
    assert main([*args, "--recalibrate"]) == 0
    measured = json.loads(stored.read_text())
    assert json.loads(capsys.readouterr().out)["fast_stock_rows"] == measured["stock_rows"] <= max(CALIBRATION_ROWS) + 1
    assert set(map(int, measured["ms_stock_packed"])) == set(CALIBRATION_ROWS)
    assert main([*args, "--recalibrate", "--path", "stock"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_machine_without_a_profile_measures_one_once(tmp_path, monkeypatch, capsys):
    # Every timing counts as quiet: the suite's other worker made a CI run's quick curve look busy (1.9x) once.
    monkeypatch.setattr(calibration_module, "BUSY_SPREAD", float("inf"))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "1")
    target = make_tiny_target("llama", path="fast")
    first = create_drafter("ngram", target).cost_curve
    assert first.source.endswith("--fast.json") and first.sizes == (1, 2, 4, 8, 16, 32, 64)
    assert "measuring this machine's verification cost curve once" in capsys.readouterr().err
    assert create_drafter("eagle:fixed_nodes=3", target, random_eagle_dir(target, tmp_path / "h")).cost_curve == first
    assert capsys.readouterr().err == ""  # stored: not measured again
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "0")
    assert create_drafter("ngram", Target(target.model, None, "other-model")).cost_curve.source.startswith("builtin")


def test_a_row_split_measured_on_a_busy_machine_is_used_once_and_not_stored(tmp_path, monkeypatch, capsys):
    """A verdict taken under other load once sent every 1-token step to the slower kernel for good (37.8 ms against
    21.5 ms on the real model): after three busy tries it serves this run only, and the next run measures again."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(STOCK_ROWS_ENV)
    tries = []

    def measured(modules, dispatch):
        tries.append(1)
        return 4, {rows: [1.0, 2.0] for rows in CALIBRATION_ROWS}, (2.0 if len(tries) <= 3 else 1.1)

    monkeypatch.setattr("selfspec.execution.calibration.measure_stock_rows", measured)
    busy = make_tiny_target("llama", path="fast").execution
    with busy.active():
        pass
    assert busy.dispatch.stock_rows == 4 and "busy" in busy.dispatch.source and len(tries) == 3
    assert "the machine is busy" in capsys.readouterr().err and not (tmp_path / "profiles").exists()
    quiet = make_tiny_target("llama", path="fast").execution
    with quiet.active():
        pass
    assert len(tries) == 4 and quiet.dispatch.source.startswith("measured, stored")
    assert json.loads(next((tmp_path / "profiles").glob("*-rows.json")).read_text())["stock_rows"] == 4


def test_a_curve_measured_on_a_busy_machine_is_not_stored(tmp_path, monkeypatch, capsys):
    """Rounds that vary a lot mean other load: the quick curve is measured again, and if the machine stays busy the
    built-in estimate sizes the trees and nothing is stored (a lucky 1-token round once made 2 tokens cost 2.6 steps,
    and every later run drafted nothing)."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "1")
    target = make_tiny_target("llama", path="fast")
    quiet = {n: [0.010 * (1 + n / 64)] * 3 for n in (1, 2, 4, 8, 16, 32, 64)}
    busy = {**quiet, 1: [0.010, 0.025, 0.030]}
    rounds = []

    def measured(target, paths, cache_length, repeats, sizes):
        rounds.append(len(rounds))
        return {"path": busy if len(rounds) <= 3 else quiet}

    monkeypatch.setattr("selfspec.cost.forward_time_samples", measured)
    curve = target_cost_curve(target)
    assert curve.source.startswith("builtin") and len(rounds) == 3  # measured three times, busy each time
    assert "the machine is busy (the same step's time varied 2.5x)" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "profiles").exists()
    curve = target_cost_curve(target)  # the next run measures again; quiet now: stored
    assert curve.source.endswith("--fast.json") and len(rounds) == 4
    assert curve.cost(64) == pytest.approx(128 / 65, abs=1e-3)


def test_each_dtype_has_its_own_profile(tmp_path, monkeypatch, capsys):
    """A bfloat16 step costs differently from a float32 one: a curve measured in one never sizes the other's trees."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "1")
    import selfspec.cost as cost_module

    monkeypatch.setattr(cost_module, "busy_spread", lambda samples: 1.0)  # stored even beside a busy test worker
    single = make_tiny_target("llama", path="stock")
    half = Target(copy.deepcopy(single.model).to(torch.bfloat16), None, single.name, path="stock")
    assert create_drafter("ngram", single).cost_curve.source.endswith("--stock.json")  # float32: the name it had
    capsys.readouterr()
    assert create_drafter("ngram", half).cost_curve.source.endswith("--stock--bfloat16.json")
    assert "measuring this machine's verification cost curve once" in capsys.readouterr().err
    stored = sorted(path.name for path in (tmp_path / "cache" / "profiles").iterdir())
    assert len(stored) == 2 and stored[1].endswith("--stock.json")


@pytest.mark.parametrize("kernel", [True, False])
def test_compiled_steps_take_few_up_to_its_split_and_tree_beyond(kernel, monkeypatch):
    """A step runs in `few` (selfspec's small-row kernel and row attention) up to `few_limit` rows in all (requests x
    new tokens), only where that kernel is loaded and wins at one row; until the two graphs are timed against each other
    the linear layers' split bounds it; $SELFSPEC_FEW_ROWS fixes it. The graphs themselves: test_compiled."""
    monkeypatch.setattr(native_module, "loaded", lambda: kernel)
    monkeypatch.delenv(FEW_ROWS_ENV)
    sizes = (1, 2, 3, 4, 9, 16, 17)
    for stock_rows in (1, 2, 3, 4):
        step = CompiledStep(torch.nn.Linear(1, 1), "m", dispatch=RowDispatch(stock_rows))
        want = [("few" if kernel and n < stock_rows else "tree", n) for n in sizes]
        assert [step.graph_for(n) for n in sizes] == want, stock_rows
        step.few_rows = 9  # the graphs timed: `few` up to 9 rows, unless the packed kernel wins from one row
        want = [("few" if kernel and stock_rows > 1 and n <= 9 else "tree", n) for n in sizes]
        assert [step.graph_for(n) for n in sizes] == want, stock_rows
        few = kernel and stock_rows > 1
        assert [step.graph_for(n, batch=3)[0] for n in (1, 3, 4)] == ["few" if few else "tree"] * 2 + ["tree"]
    no_split = CompiledStep(torch.nn.Linear(1, 1), "m")
    assert [no_split.graph_for(n)[0] for n in (16, 17)] == (["few", "tree"] if kernel else ["tree", "tree"])
    monkeypatch.setenv(FEW_ROWS_ENV, "2")
    assert [no_split.graph_for(n)[0] for n in (2, 3)] == (["few", "tree"] if kernel else ["tree", "tree"])
    if kernel:
        monkeypatch.setenv(FEW_ROWS_ENV, "two")
        with pytest.raises(SelfspecError, match="SELFSPEC_FEW_ROWS must be a whole number"):
            no_split.graph_for(1)


@pytest.mark.parametrize(
    "few_ms, tree_ms, few_rows",
    [
        ([1.0, 1.0, 1.04, 1.2, 1.0, 1.0, 1.0, 1.0], [1.0] * 8, 3),  # within 5% at 3 rows, not at 4: up to 3
        ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.1], [1.0] * 8, 15),  # lost only at 16: up to 15
        ([0.9] * 8, [1.0] * 8, 16),
        ([1.1] * 8, [1.0] * 8, 0),  # `tree` wins from one row: `few` is never taken
    ],
)
def test_the_split_between_the_compiled_graphs_is_timed_once_and_stored(
    few_ms, tree_ms, few_rows, tmp_path, monkeypatch
):
    """Where both graphs are loaded, `few` takes steps up to the row count before the first of SPLIT_SIZES where it
    runs over 5% slower than `tree`, measured once and stored beside the packages; a later load reads it; a busy
    machine's timing is used for the run only."""
    monkeypatch.setattr(native_module, "loaded", lambda: True)
    monkeypatch.delenv(FEW_ROWS_ENV)
    timings = {n: [few, tree] for n, few, tree in zip(SPLIT_SIZES, few_ms, tree_ms, strict=True)}
    messages = []
    step = CompiledStep(torch.nn.Linear(1, 1), "m", log=messages.append, dispatch=RowDispatch(4))
    step._directory, step.runners = tmp_path, {"few": None, "tree": None}
    monkeypatch.setattr(step, "time_graphs", lambda: (timings, 1.6))  # busy: not stored
    step.settle_split()
    assert step.few_limit() == few_rows and not (tmp_path / "few-rows.json").exists() and "varied 1.6x" in messages[-1]
    monkeypatch.setattr(step, "time_graphs", lambda: (timings, 1.1))
    step.settle_split()
    stored = json.loads((tmp_path / "few-rows.json").read_text())
    assert stored["few_rows"] == few_rows and stored["ms_few_tree"] == {str(n): ms for n, ms in timings.items()}
    again = CompiledStep(torch.nn.Linear(1, 1), "m", dispatch=RowDispatch(4))
    again._directory, again.runners = tmp_path, {"few": None, "tree": None}
    monkeypatch.setattr(again, "time_graphs", lambda: pytest.fail("measured again"))
    again.settle_split()
    assert again.few_limit() == few_rows
    older = stored | {"revision": SPLIT_REVISION - 1, "few_rows": 16 - few_rows}  # stored before the kernels changed
    (tmp_path / "few-rows.json").write_text(json.dumps(older))
    remeasured = CompiledStep(torch.nn.Linear(1, 1), "m", dispatch=RowDispatch(4))
    remeasured._directory, remeasured.runners = tmp_path, {"few": None, "tree": None}
    monkeypatch.setattr(remeasured, "time_graphs", lambda: (timings, 1.1))
    remeasured.settle_split()
    assert remeasured.few_limit() == few_rows
    assert json.loads((tmp_path / "few-rows.json").read_text())["revision"] == SPLIT_REVISION


def test_a_curve_measured_on_an_older_revision_of_its_path_is_not_read(tmp_path, monkeypatch):
    """The compiled path's small steps changed graph (PATH_REVISIONS): a curve stored before, without the revision,
    falls back to the built-in estimate (so `target_cost_curve` measures anew); one saved now is read; paths that did
    not change read their old files as before."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    curve = CostCurve((1, 4, 16), (1.0, 1.1, 1.5), source="test")
    for kernels in ("compiled", "fast", "stock"):
        profile_path("cpu", "m", kernels).parent.mkdir(parents=True, exist_ok=True)
        profile_path("cpu", "m", kernels).write_text(json.dumps(curve.to_dict()))  # as stored before revisions
    assert load_cost_curve("cpu", "m", "compiled").source == "builtin (cpu-compiled)"
    assert load_cost_curve("cpu", "m", "fast").source == "builtin (cpu-fast)"  # its small steps changed kernel
    assert load_cost_curve("cpu", "m", "stock").relative_cost == curve.relative_cost
    save_cost_curve(curve, "cpu", "m", "compiled")
    assert load_cost_curve("cpu", "m", "compiled").relative_cost == curve.relative_cost


def test_two_models_of_one_folder_name_do_not_share_a_cost_curve(tmp_path, monkeypatch):
    """Curves are stored under `Target.cost_key` (the folder name and a digest of the shapes): a model of other shapes
    in a folder of the same name measures its own curve rather than sizing its trees by the first one's; a model of
    the same shapes and other weights (a fine-tune) reads it."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    first, wider, finetune = make_tiny_target(), make_tiny_target(intermediate_size=128), make_tiny_target(seed=1)
    assert first.name == wider.name == finetune.name
    assert first.cost_key != wider.cost_key and first.cost_key == finetune.cost_key
    assert first.cost_key.startswith(first.name + "-")
    curve = CostCurve((1, 4, 16), (1.0, 1.1, 1.5), source="test")
    save_cost_curve(curve, first.device, first.cost_key, first.execution.name, first.dtype)
    monkeypatch.setenv("SELFSPEC_AUTO_PROFILE", "0")  # no measuring: a miss shows as the built-in estimate
    assert target_cost_curve(finetune).relative_cost == curve.relative_cost
    assert target_cost_curve(wider).source.startswith("builtin")


@pytest.mark.parametrize("drafter", ["eagle", "medusa", "dflash"])
def test_drafter_heads_are_packed_on_the_fast_path_and_compute_the_same(drafter, tmp_path):
    """On the fast path a drafter's frozen head runs its linear layers and its draft LM head packed, as the target's;
    the outputs equal the stock head's, and the head's state (what a heads directory holds) is unchanged."""
    make_dir = {"eagle": random_eagle_dir, "medusa": random_medusa_dir, "dflash": random_dflash_dir}[drafter]
    fast_target = make_tiny_target("llama", path="fast")
    directory = make_dir(fast_target, tmp_path / drafter)
    stock_target = Target(model=fast_target.model, tokenizer=None, name=fast_target.name, path="stock")
    heads = {}
    for name, target in (("fast", fast_target), ("stock", stock_target)):
        instance = create_drafter(drafter, target, directory)
        heads[name] = getattr(instance, "head", None) or instance.heads
    assert linear_types(heads["fast"]) == {PackedLinear} and heads["fast"].packed_lm is not None
    assert linear_types(heads["stock"]) == {torch.nn.Linear} and heads["stock"].packed_lm is None
    assert heads["fast"].state_dict().keys() == heads["stock"].state_dict().keys()
    hidden = torch.randn(5, fast_target.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(
            heads["fast"].draft_logits(hidden), heads["stock"].draft_logits(hidden), atol=1e-4, rtol=1e-4
        )
        packed = 0
        for fast_module, stock_module in zip(heads["fast"].modules(), heads["stock"].modules(), strict=True):
            if isinstance(fast_module, PackedLinear):
                rows = torch.randn(3, fast_module.in_features)
                torch.testing.assert_close(fast_module(rows), stock_module(rows), atol=1e-4, rtol=1e-4)
                packed += 1
        assert packed >= 1
