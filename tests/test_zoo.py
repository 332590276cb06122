"""The schedule zoo: every entry matches today's profiler, picks are right, and it ships in the wheel."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch
import torchvision

import monetlike.models
import solver
from monetlike import zoo
from monetlike.core.torch_private import tree_flatten
from monetlike.modelspec import build_model
from monetlike.profile import profile
from script_support import load_script

ENTRIES = zoo.entries()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_zoo_is_not_empty():
    assert ENTRIES, "schedules/index.json lists no schedule; run scripts/build_zoo.py"


def _meta_model(spec: str):
    """The model with its parameters on the meta device: shapes only (a 1B model allocates
    nothing)."""
    with torch.device("meta"):
        return build_model(spec)


def _key(e: zoo.ZooEntry) -> tuple:
    """What an entry's graph depends on: model, batch, shape, costs, FSDP2, optimizer, loss."""
    fsdp = None if e.fsdp is None else tuple(sorted(e.fsdp.items()))
    return (e.model, e.batch, e.input_shape, e.cost_provenance, fsdp, e.optimizer, e.loss)


_PROFILES: dict[tuple, tuple] = {}


def _profiled(e: zoo.ZooEntry) -> tuple:
    """(model, example batch, profile's keyword arguments, graph) of an entry's graph: one
    analytical profile per graph in the zoo (meta device: nothing real), made as the entry's own
    settings say (one rank of FSDP2, optimizer state, loss), once in the session."""
    if _key(e) not in _PROFILES:
        model = _meta_model(e.model)
        batch = zoo.example_batch(e, model)
        kwargs = dict(cost=e.cost_provenance, **e.profile_settings(model))
        _PROFILES[_key(e)] = (model, batch, kwargs, profile(model, batch, **kwargs))
    return _PROFILES[_key(e)]


@pytest.fixture(scope="module")
def graphs():
    return {_key(e): _profiled(e)[3] for e in ENTRIES}


def _same_inputs(a, b) -> bool:
    (xs, spec), (ys, spec_b) = tree_flatten(a), tree_flatten(b)
    if spec != spec_b:
        return False
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
        elif ((x.shape, x.dtype, x.device, x.requires_grad, x.stride())
              != (y.shape, y.dtype, y.device, y.requires_grad, y.stride())
              or (x.device.type != "meta" and not torch.equal(x, y))):
            return False
    return True


@pytest.fixture
def profiled_once(monkeypatch):
    """zoo.load's profile answered by `_profiled` when it is called as that one was (the same
    model object, inputs alike in structure, shapes, dtypes, strides and values, the same
    keyword arguments): an analytical profile is a function of those, so the graph is the one
    it would make again. Any other call profiles."""
    real = zoo.profile

    def profile_once(model, example_inputs, **kwargs):
        for m, batch, settings, graph in _PROFILES.values():
            if m is model and settings == kwargs and _same_inputs(batch, example_inputs):
                return graph
        return real(model, example_inputs, **kwargs)
    monkeypatch.setattr(zoo, "profile", profile_once)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_entry_matches_todays_profiler_and_simulator(entry, graphs):
    g = graphs[_key(entry)]
    sched = zoo.schedule(entry.name)
    # A profiler change that alters the graph (ops, shapes, Impl set) must come with a new zoo.
    assert sched.fingerprint == entry.fingerprint == g.fingerprint
    tl = solver.simulate(g, sched)
    assert tl.peak_bytes == entry.predicted_peak_bytes <= entry.budget_bytes
    assert tl.total_time == pytest.approx(entry.predicted_time, rel=1e-12)
    assert entry.cost_provenance.startswith("analytical:")


def test_pick_is_the_cheapest_that_fits_and_refuses_clearly():
    e = ENTRIES[0]
    same = [x for x in ENTRIES if x.model == e.model and x.batch == e.batch]
    big = max(x.budget_bytes for x in same)
    picked = zoo.pick(e.model.rsplit(".", 1)[-1], e.batch, big)
    assert picked.predicted_time == min(x.predicted_time for x in same)
    with pytest.raises(zoo.ZooError, match="none fits for this model and batch.*the nearest "
                                           "entries: ") as miss:
        zoo.pick(e.model, e.batch, min(x.predicted_peak_bytes for x in same) - 1)
    with pytest.raises(zoo.ZooError, match="none exists"):
        zoo.pick(e.model, e.batch + 1, big)
    # a miss names a few entries, never the whole zoo on one line
    listed = [x.name for x in ENTRIES if f"{x.name} (" in str(miss.value)]
    assert 1 <= len(listed) <= zoo.NEAREST < len(ENTRIES)
    assert all(x in same for x in ENTRIES if x.name in listed)


def test_a_miss_on_another_model_names_similar_models_not_every_entry():
    with pytest.raises(zoo.ZooError, match="models of similar name in the zoo: resnet50"):
        zoo.pick("resnet5O", 8, "8GiB")
    with pytest.raises(zoo.ZooError, match="the zoo has no nosuchmodel; its models: ") as e:
        zoo.pick("nosuchmodel", 8, "8GiB")
    assert not any(f"{x.name} (" in str(e.value) for x in ENTRIES)
    with pytest.raises(zoo.ZooError, match=f"the nearest names: {ENTRIES[0].name}"):
        zoo.get(ENTRIES[0].name + "x")


def test_load_refuses_another_model():
    e = ENTRIES[0]
    wrong = torchvision.models.resnet18() if "resnet50" not in e.model else \
        torchvision.models.resnet101()
    with pytest.raises(solver.ScheduleMismatchError, match="was made for"):
        zoo.load(e.name, wrong)


def test_load_accepts_the_right_model(profiled_once):
    e = ENTRIES[0]
    model = _profiled(e)[0]  # built by build_model on meta, as the entry's spec says
    assert zoo.load(e.name, model).fingerprint == e.fingerprint


def test_zoo_ships_in_the_wheel_and_works_installed(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w",
                    str(wheel_dir)], check=True, capture_output=True)
    (whl,) = wheel_dir.glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "monetlike/schedules/index.json" in names
    assert all(f"monetlike/schedules/{e.name}.json" in names for e in ENTRIES)
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import monetlike, monetlike.zoo as z, sys; "
            "assert monetlike.__file__.startswith(sys.argv[1]), monetlike.__file__; "
            "from monetlike.cli import main; sys.exit(main(['zoo', 'list']))")
    r = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    assert all(e.name in r.stdout for e in ENTRIES)


def test_every_package_with_code_is_listed_in_pyproject():
    import tomllib

    listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))
                 ["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("monetlike", "solver"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert found | {"monetlike.schedules"} == listed


def test_a_rebuild_keeps_a_faster_entry_of_the_same_graph_and_costs():
    from types import SimpleNamespace

    keeps = load_script("build_zoo").keeps
    e = ENTRIES[0].to_dict()
    same = SimpleNamespace(fingerprint=e["fingerprint"], cost_provenance=e["cost_provenance"])
    t = e["predicted_time"]
    assert keeps(e, same, t * 1.01) and keeps(e, same, t)  # the new one is no faster
    assert not keeps(e, same, t * 0.99)  # a faster schedule replaces it
    assert not keeps(None, same, t)  # nothing to keep
    # made for another graph or other costs: the old entry is stale whatever its time
    assert not keeps(e, SimpleNamespace(fingerprint="other", cost_provenance=e["cost_provenance"]),
                     t * 2)
    assert not keeps(e, SimpleNamespace(fingerprint=e["fingerprint"], cost_provenance="other"),
                     t * 2)


def test_restamp_drops_only_new_impls_appended_after_the_old_ones():
    restamp = load_script("restamp_zoo")
    new = restamp.NEW_IMPLS[0]
    op = ["conv", "Conv2d", ["conv"], [0], [1], True, None]
    appended = {"ops": [op + [[["default", [0]], ["relu_mask", [0]], [new, [0]]]]]}
    assert restamp.old_kind(appended)["ops"][0][-1] == [["default", [0]], ["relu_mask", [0]]]
    # A new Impl before an old one would shift the old one's index: the schedule's Impl indices
    # would then name other Impls.
    inserted = {"ops": [op + [[["default", [0]], [new, [0]], ["relu_mask", [0]]]]]}
    assert restamp.old_kind(inserted) is None


# -- the Hugging Face transformers shapes (issue 19) ----------------------------------------------
HF = {"monetlike.models.gpt2": (8, (1024,)), "monetlike.models.llama_1b": (4, (1024,))}


@pytest.mark.parametrize("model", sorted(HF))
def test_transformers_shapes_have_four_budgets_between_least_feasible_and_store_all(model, graphs):
    pytest.importorskip("transformers")
    batch, shape = HF[model]
    mine = [e for e in ENTRIES if e.model == model]
    assert len(mine) == 4, [e.name for e in mine]
    assert {(e.batch, e.input_shape) for e in mine} == {(batch, shape)}
    g = graphs[_key(mine[0])]
    assert g.meta["capture"] == "export"  # torch.export: attention at ATen level
    store_all = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    for e in mine:
        assert e.store_all_peak_bytes == store_all
        assert e.predicted_peak_bytes <= e.budget_bytes < store_all
        assert e.cost_provenance == "analytical:A100-40GB" and e.mode == "full"
        assert e.status in ("optimal", "feasible-at-time-limit")


@pytest.mark.parametrize("model", sorted(HF))
def test_transformers_entries_load_against_their_model(model, profiled_once):
    pytest.importorskip("transformers")
    batch, _ = HF[model]
    e = max((x for x in ENTRIES if x.model == model), key=lambda x: x.budget_bytes)
    sched = zoo.load(e.name, _profiled(e)[0])  # the fingerprint check, on meta
    assert sched.fingerprint == e.fingerprint
    # Another configuration of the same family is refused.
    with torch.device("meta"):
        other = getattr(monetlike.models, model.rsplit(".", 1)[-1])(layers=2)
    with pytest.raises(solver.ScheduleMismatchError, match="was made for"):
        zoo.load(e.name, other)


@pytest.mark.parametrize("spec, batch", [("gpt2", 8), ("llama-1b", 4), ("llama_1b", 4)])
def test_zoo_pick_returns_the_transformers_entries(spec, batch, capsys, tmp_path):
    from cli_support import run_cli

    full = f"monetlike.models.{spec.replace('-', '_')}"
    mine = [e for e in ENTRIES if e.model == full]
    assert mine
    top = max(e.budget_bytes for e in mine)
    assert zoo.pick(spec, batch, top) == min(mine, key=lambda e: e.predicted_time)
    low = min(mine, key=lambda e: e.predicted_peak_bytes)
    assert zoo.pick(spec, batch, low.predicted_peak_bytes) == low
    out = tmp_path / "s.json"
    code, stdout, err = run_cli(["zoo", "pick", "--model", spec, "--batch", str(batch),
                                 "--budget", str(low.budget_bytes), "-o", str(out)], capsys)
    assert code == 0, err
    assert low.name in stdout
    assert solver.Schedule.load(str(out)).fingerprint == low.fingerprint


def test_no_entry_is_worse_than_a_smaller_budget_entry_of_the_same_model():
    """A plan that fits a smaller budget fits a larger one: no entry may be slower than one of
    a smaller budget for the same graph (vgg16_176_8GiB was, labelled optimal; issue 52)."""
    bad = [(e.name, s.name) for e, s in zoo.dominated()]
    assert bad == []


def test_dominated_finds_a_slower_entry_of_a_larger_budget_only_for_the_same_graph():
    def entry(name, budget, time, fingerprint="f"):
        return zoo.ZooEntry(name=name, model="m", batch=1, input_shape=(3,), budget_bytes=budget,
                            predicted_peak_bytes=budget - 1, predicted_time=time,
                            store_all_time=1.0, store_all_peak_bytes=100, mode="full",
                            status="optimal", mip_gap=None, cost_provenance="analytical:X",
                            fingerprint=fingerprint)
    small, mid, big = entry("a", 10, 1.2), entry("b", 20, 1.1), entry("c", 30, 1.3)
    other = entry("d", 40, 1.4, fingerprint="g")  # another graph: not comparable
    assert [(e.name, s.name) for e, s in zoo.dominated([small, mid, big, other])] == [("c", "b")]


# -- one rank of FSDP2 (issue 53) ---------------------------------------------------------------
FSDP = {"monetlike.models.llama3_8b": (8, 32), "monetlike.models.llama_70b": (64, 80)}


@pytest.mark.parametrize("model", sorted(FSDP))
def test_fsdp_entries_plan_one_rank_of_their_shape(model, graphs):
    pytest.importorskip("transformers")
    ranks, layers = FSDP[model]
    mine = [e for e in ENTRIES if e.model == model]
    assert mine
    for e in mine:
        assert e.fsdp == {"world_size": ranks, "param_dtype": "bfloat16"}
        assert (e.optimizer, e.loss, e.cost_provenance) == ("adam", "model", "analytical:H100-80GB")
        g = graphs[_key(e)]
        f = g.meta["fsdp"]
        assert f["world_size"] == ranks and len(f["units"]) == layers
        assert g.param_bytes < f["per_rank"]["unsharded_params"] / ranks * 2.01  # fp32 shards
        assert g.optimizer_bytes == 2 * f["per_rank"]["sharded_grads"]
        assert e.predicted_peak_bytes <= e.budget_bytes < e.store_all_peak_bytes
        assert zoo.ZooEntry.from_dict(e.to_dict(), "e") == e


def test_entries_without_fsdp_keep_their_index_form():
    e = next(x for x in ENTRIES if x.fsdp is None)
    assert not {"fsdp", "optimizer", "loss"} & set(e.to_dict())
    with pytest.raises(solver.FormatError, match="param_dtype"):
        zoo.ZooEntry.from_dict({**e.to_dict(), "fsdp": {"world_size": 8,
                                                        "param_dtype": "int8"}}, "e")
